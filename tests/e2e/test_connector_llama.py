"""kvtier inside a real vLLM CPU engine with the tiny Llama (one KV-cache group).

Four engines, each reused by several assertions: a baseline without kvtier (shared with
other modules by the engine host), a first kvtier engine (CPU tier + Redis) that loads
kvtier by its registered name alone, as a user who left out ``kv_connector_module_path``
does, a second kvtier engine on the same Redis (fresh CPU tier), and a kvtier engine with
the test-only ``debug_corrupt_loads`` switch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from connector.demo.tiny_models import prompt_words
from rigs.redis_keys import scratch_prefix
from tests.support import no_faults
from tests.support.connector_runner import run_in_subprocess

# On one pytest worker with the other llama-baseline file (tests/conftest.py SHARED_WORKER):
# vLLM's default llama engine, the baseline, is started once for both.
pytestmark = pytest.mark.e2e

PROMPT_A = prompt_words(11, 150)
PROMPT_B = prompt_words(12, 150)
A2 = PROMPT_A + " w5 w6"
B2 = PROMPT_B + " w7"
# 160 = 5 blocks of 32: a block-aligned prompt, given as token ids (exact length).
ALIGNED = [3 + (7 * i) % 150 for i in range(160)]
STEPS = [["generate", "A1", PROMPT_A], ["generate", "B1", PROMPT_B],
         ["generate", "C1", ALIGNED], ["reset"],
         ["generate", "A2", A2], ["generate", "B2", B2], ["generate", "C2", ALIGNED]]


def by_name(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {o["name"]: o for o in result["outputs"]}


@pytest.fixture(scope="module")
def prefix(redis_url: str) -> Iterator[str]:
    with scratch_prefix(redis_url) as name:
        yield name


@pytest.fixture(scope="module")
def extra(redis_url: str, prefix: str) -> dict[str, Any]:
    # A stalled machine must not make a miss: not what these tests are about (no_faults).
    return {"cpu_bytes": 64 << 20, "redis_url": redis_url, "redis_prefix": prefix,
            **no_faults.CONNECTOR}


@pytest.fixture(scope="module")
def baseline(tiny_llama_dir: Any) -> dict[str, dict[str, Any]]:
    return by_name(run_in_subprocess({"model": "llama", "extra": None, "steps": STEPS}))


@pytest.fixture(scope="module")
def first(tiny_llama_dir: Any, extra: dict[str, Any]) -> dict[str, Any]:
    # No module path: vLLM finds kvtier through its vllm.general_plugins entry point.
    return run_in_subprocess({"model": "llama", "extra": extra, "steps": STEPS,
                              "no_module_path": True})


@pytest.fixture(scope="module")
def second(first: dict[str, Any], extra: dict[str, Any], redis_url: str,
           prefix: str) -> dict[str, Any]:
    steps = [["wait_redis", 1, 300.0], ["generate", "A2", A2],
             ["corrupt_redis", redis_url, prefix], ["generate", "B2", B2]]
    return run_in_subprocess({"model": "llama", "extra": extra, "steps": steps})


def test_cpu_tier_serves_prefix_after_reset_with_identical_output(
        baseline: dict[str, dict[str, Any]], first: dict[str, Any]) -> None:
    runs = by_name(first)
    for name in ("A1", "B1", "C1", "A2", "B2", "C2"):
        assert runs[name]["token_ids"] == baseline[name]["token_ids"], name
    # After reset_prefix_cache() vLLM's GPU cache is empty: the hit is kvtier's.
    assert baseline["A2"]["num_cached_tokens"] == 0
    print("KVTIER-LLAMA-SUMMARY", {n: (runs[n]["delta"].get("hit_tokens_cpu", 0),
                                       runs[n]["num_cached_tokens"]) for n in runs})
    assert runs["A2"]["delta"].get("hit_tokens_cpu", 0) == 128
    assert runs["A2"]["num_cached_tokens"] == 128
    assert runs["B2"]["delta"].get("hit_tokens_cpu", 0) == 128
    assert first["stats"]["blocks_written_redis"] > 0
    assert first["stats"]["load_errors"] == 0


def test_loads_by_name_without_module_path(first: dict[str, Any]) -> None:
    """The first engine's transfer config names kvtier without a module path (the entry
    point registers it): it ran kvtier, whose CPU tier served the prefix."""
    assert "kv_connector_module_path" not in first["kv_transfer_config"]
    assert first["kv_transfer_config"]["kv_connector"] == "TieredOffloadingConnector"
    assert by_name(first)["A2"]["delta"].get("hit_tokens_cpu", 0) == 128


def test_block_aligned_prompt_recomputes_only_its_last_token(
        baseline: dict[str, dict[str, Any]], first: dict[str, Any]) -> None:
    """The whole 160-token prompt is in the CPU tier: vLLM recomputes 1 token, not a block."""
    c2 = by_name(first)["C2"]
    assert c2["prompt_tokens"] == 160 and baseline["C2"]["num_cached_tokens"] == 0
    assert c2["prompt_tokens"] - c2["num_cached_tokens"] == 1
    assert c2["delta"].get("hit_tokens_cpu", 0) == 159
    assert c2["delta"].get("blocks_loaded_cpu", 0) == 5  # the last block loaded whole
    assert c2["token_ids"] == baseline["C2"]["token_ids"]


def test_second_engine_serves_prefix_from_redis(
        baseline: dict[str, dict[str, Any]], second: dict[str, Any]) -> None:
    a2 = by_name(second)["A2"]
    assert a2["delta"].get("hit_tokens_redis", 0) == 128
    assert a2["delta"].get("hit_tokens_cpu", 0) == 0
    assert a2["token_ids"] == baseline["A2"]["token_ids"]
    # A2 alone waits for its fetch: the step that plans it schedules no tokens, so the
    # plan says so (the fetch may run on the worker's compute cores: affinity.py)
    assert a2["delta"].get("fetches_without_forward", 0) >= 1


def test_corrupt_or_foreign_redis_values_are_misses_with_correct_output(
        baseline: dict[str, dict[str, Any]], second: dict[str, Any]) -> None:
    runs = by_name(second)
    damage = runs["corrupt_redis"]["result"]
    assert damage["flipped"] > 0 and damage["swapped"] > 0
    b2 = runs["B2"]
    assert b2["delta"].get("hit_tokens_redis", 0) == 0
    assert b2["token_ids"] == baseline["B2"]["token_ids"]
    assert b2["num_cached_tokens"] == 0
    # Rejected for what they are: values that fail validation (a foreign header at the
    # probe, a flipped payload at the fetch's checksum), never loaded as KV.
    assert b2["delta"].get("redis_corrupt_values", 0) >= 1
    assert second["stats"]["load_errors"] == 0


def test_negative_control_corrupted_loads_change_the_output(
        baseline: dict[str, dict[str, Any]], tiny_llama_dir: Any) -> None:
    steps = [["generate", "A1", PROMPT_A], ["reset"], ["generate", "A2", A2]]
    runs = by_name(run_in_subprocess({
        "model": "llama", "extra": {"cpu_bytes": 64 << 20, "debug_corrupt_loads": True},
        "steps": steps}))
    assert runs["A1"]["token_ids"] == baseline["A1"]["token_ids"]
    assert runs["A2"]["delta"].get("hit_tokens_cpu", 0) == 128
    assert runs["A2"]["token_ids"] != baseline["A2"]["token_ids"]
