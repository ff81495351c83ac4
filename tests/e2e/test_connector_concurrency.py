"""kvtier with many requests per engine step, and with a full CPU tier (real vLLM CPU engine).

Every other e2e test sends one request at a time to a roomy CPU tier. Here every workload is
ONE ``llm.generate([...])`` call of 8 prompts with ``max_num_seqs=8``, so several requests
look up, load and save in the same step, and prompts of one batch share prefixes of
different lengths (block-aligned or not). Engines (one process each, reused by the tests):

* ``baseline``: vLLM alone;
* ``tight``: CPU tier of 1 MiB (the connector's minimum; ~30 slots of one 32-token block),
  no Redis: the first two batches fit in it (nothing evicted: a roomy tier's case), the
  pressure batches that follow evict from it mid-run;
* ``tight_redis``: the same tiny CPU tier with Redis behind it: evicted blocks come back
  from Redis.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from rigs.redis_keys import scratch_prefix
from tests.support import no_faults
from tests.support.batches import HIT, WARM, toks
from tests.support.connector_runner import run_in_subprocess

pytestmark = pytest.mark.e2e

BLOCK = 32
TIGHT_CPU_BYTES = 1 << 20  # the connector's minimum cpu_bytes


# Pressure: 8 unrelated prompts of 6-7 blocks each (~50 blocks) through a ~30-slot CPU tier.
PRESSURE = [toks(40 + i, 200 + 3 * i) for i in range(8)]
PRESSURE_HIT = [p + toks(60 + i, 5) for i, p in enumerate(PRESSURE)]

STEPS = [["batch", "warm", WARM], ["reset"], ["batch", "hit", HIT], ["reset"],
         ["batch", "pwarm", PRESSURE], ["reset"], ["batch", "phit", PRESSURE_HIT]]
ENGINE = {"max_num_seqs": 8}


def by_name(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {o["name"]: o for o in result["outputs"]}


def run(extra: dict[str, Any] | None) -> dict[str, Any]:
    result = run_in_subprocess({"model": "llama", "extra": extra, "steps": STEPS,
                                "engine": ENGINE})
    result["runs"] = by_name(result)
    return result


def assert_identical(result: dict[str, Any], baseline: dict[str, Any], batch: str,
                     n: int) -> None:
    for i in range(n):
        name = f"{batch}/{i}"
        assert result["runs"][name]["token_ids"] == baseline["runs"][name]["token_ids"], name


@pytest.fixture(scope="module")
def baseline(tiny_llama_dir: Any) -> dict[str, Any]:
    return run(None)


@pytest.fixture(scope="module")
def tight(tiny_llama_dir: Any) -> dict[str, Any]:
    return run({"cpu_bytes": TIGHT_CPU_BYTES})


@pytest.fixture(scope="module")
def redis_prefix(redis_url: str) -> Iterator[str]:
    with scratch_prefix(redis_url) as name:
        yield name


@pytest.fixture(scope="module")
def tight_redis(tiny_llama_dir: Any, redis_url: str, redis_prefix: str) -> dict[str, Any]:
    # A write a stalled machine delays past the deadline would count as failed (correctly,
    # but this test asserts none failed): no_faults.
    return run({"cpu_bytes": TIGHT_CPU_BYTES, "redis_url": redis_url,
                "redis_prefix": redis_prefix, **no_faults.CONNECTOR})


def test_batched_requests_hit_the_cpu_tier_with_identical_output(
        baseline: dict[str, Any], tight: dict[str, Any]) -> None:
    """The first two batches (warm, then hit after a reset) fit in the CPU tier: nothing is
    evicted before the pressure batches."""
    assert_identical(tight, baseline, "warm", len(WARM))
    assert_identical(tight, baseline, "hit", len(HIT))
    warm, hit = tight["runs"]["warm"]["delta"], tight["runs"]["hit"]["delta"]
    cached = [tight["runs"][f"hit/{i}"]["num_cached_tokens"] for i in range(len(HIT))]
    base_cached = [baseline["runs"][f"hit/{i}"]["num_cached_tokens"] for i in range(len(HIT))]
    print("KVTIER-BATCH", {"hit_delta": hit, "num_cached": cached, "baseline": base_cached})
    assert warm.get("cpu_evictions", 0) == 0 and hit.get("cpu_evictions", 0) == 0
    assert hit.get("hit_tokens_cpu", 0) > 0
    assert hit.get("hit_requests", 0) >= 4  # several requests restored in one generate()
    assert sum(cached) > sum(base_cached)
    assert all(c >= BLOCK for c in cached), cached
    assert hit.get("load_errors", 0) == 0


def test_full_cpu_tier_evicts_and_keeps_output_identical(
        baseline: dict[str, Any], tight: dict[str, Any]) -> None:
    cpu = tight["cpu_tier"]
    assert cpu["num_slots"] * 32 * 1024 <= TIGHT_CPU_BYTES  # 32 KiB slots (tiny Llama)
    assert cpu["num_slots"] < 40  # fewer slots than the pressure workload's blocks
    for batch, prompts in (("warm", WARM), ("hit", HIT), ("pwarm", PRESSURE),
                           ("phit", PRESSURE_HIT)):
        assert_identical(tight, baseline, batch, len(prompts))
    phit = tight["runs"]["phit"]["delta"]
    print("KVTIER-PRESSURE-CPU", {"cpu_tier": cpu, "phit_delta": phit,
                                  "stats": {k: tight["stats"][k] for k in (
                                      "hit_tokens_cpu", "store_drops", "blocks_saved")}})
    assert cpu["evictions"] > 0
    assert cpu["pinned"] == 0 and cpu["reserved"] == 0  # no pin or reservation leaked
    assert tight["stats"]["load_errors"] == 0
    # A batched prefill saves more blocks in one step than the tier has slots: without
    # Redis nothing is pinned, the tier evicts as it goes, none dropped.
    assert tight["runs"]["pwarm"]["delta"].get("blocks_saved", 0) > cpu["num_slots"]
    assert tight["stats"]["store_drops"] == 0
    assert phit.get("hit_tokens_redis", 0) == 0


def test_full_cpu_tier_with_redis_serves_evicted_blocks_from_redis(
        baseline: dict[str, Any], tight: dict[str, Any],
        tight_redis: dict[str, Any]) -> None:
    for batch, prompts in (("warm", WARM), ("hit", HIT), ("pwarm", PRESSURE),
                           ("phit", PRESSURE_HIT)):
        assert_identical(tight_redis, baseline, batch, len(prompts))
    cpu = tight_redis["cpu_tier"]
    phit = tight_redis["runs"]["phit"]["delta"]
    cpu_only = tight["runs"]["phit"]["delta"]
    print("KVTIER-PRESSURE-REDIS", {"cpu_tier": cpu, "phit_delta": phit,
                                    "cpu_only_phit": cpu_only})
    assert cpu["evictions"] > 0
    assert cpu["pinned"] == 0 and cpu["reserved"] == 0
    assert tight_redis["stats"]["load_errors"] == 0
    assert tight_redis["stats"]["blocks_written_redis"] > 0
    assert phit.get("hit_tokens_redis", 0) > 0  # evicted blocks came back from Redis
    total = phit.get("hit_tokens_cpu", 0) + phit.get("hit_tokens_redis", 0)
    # Every CPU slot can carry a pinned restore: the 6th request restores the blocks that
    # still fit (was: its fetched values evicted each other, no hit, 141 evictions not 87).
    assert total > cpu_only.get("hit_tokens_cpu", 0)
    assert phit.get("hit_requests", 0) > cpu_only.get("hit_requests", 0)
    # Requests whose blocks the CPU tier had evicted (a miss without Redis) are served.
    n = len(PRESSURE_HIT)
    came_back = [i for i in range(n)
                 if tight["runs"][f"phit/{i}"]["num_cached_tokens"] == 0
                 and tight_redis["runs"][f"phit/{i}"]["num_cached_tokens"] > 0]
    assert came_back, "no evicted prefix came back from Redis"
    # No save was dropped for want of a slot while the tier was full but not pinned.
    for batch in ("warm", "hit", "pwarm"):
        assert tight_redis["runs"][batch]["delta"].get("store_drops", 0) == 0, batch
    assert tight_redis["stats"]["redis_write_failures"] == 0
