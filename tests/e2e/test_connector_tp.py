"""kvtier with ``tensor_parallel_size=2`` (tiny Llama, vLLM's default executors; one core
per rank via ``VLLM_CPU_OMP_THREADS_BIND="0|1"``): each rank saves and restores its own
shard, a hit counts only if every rank can restore it, one rank's missing or corrupt value
is a miss with correct output, and what both ranks saved while Redis refused them reaches
Redis once it answers (backfill)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import pytest

from connector.demo.tiny_models import prompt_words
from rigs.redis_keys import scratch_prefix
from tests.support import no_faults
from tests.support.connector_runner import run_in_subprocess

pytestmark = pytest.mark.e2e

A = prompt_words(51, 150)
B = prompt_words(52, 150)
C = prompt_words(53, 150)
D = prompt_words(54, 150)
E = prompt_words(55, 150)  # saved while Redis refuses the engine; backfilled; read back
A2, B2, C2, D2 = A + " w1 w2", B + " w3", C + " w4", D + " w5"
TP2 = {"tensor_parallel_size": 2}
FIRST = [["generate", "A1", A], ["generate", "B1", B], ["reset"],
         ["generate", "A2", A2], ["generate", "B2", B2]]


def by_name(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {o["name"]: o for o in result["outputs"]}


def why_missed(result: dict[str, Any], name: str) -> str:
    """For a failed restore: every counter of request ``name``, the steps' waits and the
    engine's kvtier log lines, in full (pytest cuts a long repr short)."""
    return "\n".join([json.dumps(by_name(result)[name]["delta"], sort_keys=True),
                      json.dumps([o for o in result["outputs"] if "delta" not in o])[:4000],
                      *[line for line in result.get("log", "").splitlines()
                        if "kvtier" in line][-40:]])


@pytest.fixture(scope="module")
def prefix(redis_url: str) -> Iterator[str]:
    with scratch_prefix(redis_url) as name:
        yield name


URL_ENV = "KVTIER_TEST_TP_REDIS_URL"


@pytest.fixture(scope="module")
def extra(redis_url: str, prefix: str) -> dict[str, Any]:
    # These tests are about shards and saves, not Redis faults: a machine that stalls for
    # seconds must not make a miss (tests/support/no_faults.py). The URL is read from the
    # environment (redis_url_env) by the scheduler and by each rank's worker process.
    return {"cpu_bytes": 64 << 20, "redis_url_env": URL_ENV, "redis_prefix": prefix,
            **no_faults.CONNECTOR}


def run_tp(spec: dict[str, Any], redis_url: str) -> dict[str, Any]:
    """A TP=2 kvtier engine whose processes find the Redis URL in their environment; its
    steps start once kvtier reports Redis up on every rank (a lookup while it is not is a
    correct miss, but not what these tests are about: seen once in CI under load)."""
    steps = [["wait_redis", 1, 300.0], *spec["steps"]]
    return run_in_subprocess({**spec, "steps": steps, "engine": TP2}, env={URL_ENV: redis_url})


@pytest.fixture(scope="module")
def baseline(tiny_llama_dir: Any) -> dict[str, dict[str, Any]]:
    steps = [*FIRST, ["generate", "C1", C], ["generate", "C2", C2], ["generate", "D1", D],
             ["generate", "D2", D2], ["generate", "E1", E], ["generate", "E2", E + " w6"]]
    return by_name(run_in_subprocess({"model": "llama", "extra": None, "steps": steps,
                                      "engine": TP2}))


@pytest.fixture(scope="module")
def first(tiny_llama_dir: Any, extra: dict[str, Any], redis_url: str) -> dict[str, Any]:
    return run_tp({"model": "llama", "extra": extra, "steps": FIRST}, redis_url)


@pytest.fixture(scope="module")
def second(first: dict[str, Any], extra: dict[str, Any], redis_url: str,
           prefix: str) -> dict[str, Any]:
    """A new engine: restores A2 from Redis; then one rank's values are replaced by valid
    values of another save and B1 (stored by ``first``) is asked for; then it computes C1
    and D1 (stored whole, for ``third``)."""
    return run_tp({"model": "llama", "extra": extra, "steps": [
        ["generate", "A2", A2], ["damage_rank", redis_url, prefix, "other_save"],
        ["generate", "B1", B], ["generate", "C1", C], ["generate", "D1", D]]}, redis_url)


@pytest.fixture(scope="module")
def third(second: dict[str, Any], extra: dict[str, Any], redis_url: str,
          prefix: str) -> dict[str, Any]:
    """Yet another engine: B1 again (``second`` recomputed and stored it whole); then one
    rank's payloads flipped (C2 asked for), then that rank's values deleted (D2)."""
    return run_tp({"model": "llama", "extra": extra, "steps": [
        ["generate", "B1", B], ["damage_rank", redis_url, prefix, "flip"],
        ["generate", "C2", C2], ["damage_rank", redis_url, prefix, "delete"],
        ["generate", "D2", D2]]}, redis_url)


def test_tp2_cpu_tier_hits_with_identical_output(baseline: dict[str, Any],
                                                 first: dict[str, Any]) -> None:
    runs = by_name(first)
    for name in ("A1", "B1", "A2", "B2"):
        assert runs[name]["token_ids"] == baseline[name]["token_ids"], name
    assert baseline["A2"]["num_cached_tokens"] == 0
    assert runs["A2"]["delta"].get("hit_tokens_cpu", 0) == 128
    assert runs["A2"]["num_cached_tokens"] == 128
    # Both ranks loaded their shard: twice the blocks of one rank.
    assert runs["A2"]["delta"].get("blocks_loaded_cpu", 0) == 2 * 4
    assert first["stats"]["load_errors"] == 0


def test_tp2_new_engine_restores_every_rank_from_redis(baseline: dict[str, Any],
                                                       second: dict[str, Any]) -> None:
    a2 = by_name(second)["A2"]
    assert a2["delta"].get("hit_tokens_redis", 0) == 128, why_missed(second, "A2")
    assert a2["delta"].get("blocks_loaded_redis", 0) == 2 * 4
    assert a2["token_ids"] == baseline["A2"]["token_ids"]


def test_tp2_one_rank_corrupt_or_missing_is_a_miss(baseline: dict[str, Any],
                                                   third: dict[str, Any]) -> None:
    runs = by_name(third)
    flip, delete = runs["damage_rank-flip"]["result"], runs["damage_rank-delete"]["result"]
    assert flip["fingerprints"] == 2 and flip["damaged"] > 0 and flip["kept"] > 0
    assert delete["fingerprints"] == 2 and delete["damaged"] > 0 and delete["kept"] > 0
    c2, d2 = runs["C2"], runs["D2"]
    assert c2["token_ids"] == baseline["C2"]["token_ids"]
    assert c2["delta"].get("hit_tokens_redis", 0) == 0
    assert c2["delta"].get("failed_restores", 0) == 1, why_missed(third, "C2")
    assert c2["delta"].get("redis_corrupt_values", 0) >= 1
    assert c2["delta"].get("redis_corrupt_deleted", 0) == c2["delta"]["redis_corrupt_values"]
    assert d2["token_ids"] == baseline["D2"]["token_ids"]
    assert d2["delta"].get("hit_tokens_redis", 0) == 0
    assert d2["delta"].get("failed_restores", 0) == 0
    assert third["stats"]["load_errors"] == 0


def test_tp2_hybrid_restores_attention_and_mamba_state(tiny_hybrid_dir: Any) -> None:
    """The tiny hybrid (Mamba + attention, partial entries) at TP=2: a restore of both
    groups on both ranks, ending on a PARTIAL entry; outputs identical to TP=2 alone."""
    prompt = prompt_words(81, 100)
    steps = [["generate", "P", prompt], ["reset"], ["generate", "P2", prompt + " w1 w2"]]
    base = by_name(run_in_subprocess({"model": "hybrid", "extra": None, "steps": steps,
                                      "engine": TP2}))
    runs = by_name(run_in_subprocess({"model": "hybrid", "extra": {"cpu_bytes": 64 << 20},
                                      "steps": steps, "engine": TP2}))
    assert base["P2"]["num_cached_tokens"] == 0
    assert runs["P2"]["delta"].get("hit_tokens_cpu", 0) == 96  # 64 FULL + a PARTIAL to 96
    assert runs["P2"]["num_cached_tokens"] == 96
    for name in ("P", "P2"):
        assert runs[name]["token_ids"] == base[name]["token_ids"], name


def test_tp2_shards_of_different_saves_are_never_served_together_and_heal(
        baseline: dict[str, Any], second: dict[str, Any], third: dict[str, Any]) -> None:
    runs = by_name(second)
    damage = runs["damage_rank-other_save"]["result"]
    assert damage["fingerprints"] == 2 and damage["damaged"] > 0 and damage["kept"] > 0
    b1 = runs["B1"]
    assert b1["token_ids"] == baseline["B1"]["token_ids"]
    assert b1["delta"].get("hit_tokens_redis", 0) == 0
    assert b1["delta"].get("blocks_loaded_redis", 0) == 0
    assert b1["delta"].get("failed_restores", 0) == 0
    again = by_name(third)["B1"]
    assert again["delta"].get("hit_tokens_redis", 0) == 128, why_missed(third, "B1")
    assert again["delta"].get("blocks_loaded_redis", 0) == 2 * 4
    assert again["token_ids"] == baseline["B1"]["token_ids"]


@pytest.fixture(scope="module")
def backfilled(tiny_llama_dir: Any, redis_url: str) -> Iterator[tuple[dict[str, Any],
                                                                       dict[str, Any]]]:
    """A TP=2 engine whose Redis (behind a proxy) refuses every connection while it computes
    E; Redis answers again; the engine steps until both ranks answered every backfill. Then
    a new TP=2 engine, on Redis directly, asks for E with a new tail. Both engines use a
    prefix of their own (no other test's damage reaches it)."""
    with scratch_prefix(redis_url) as name:
        extra = {"cpu_bytes": 64 << 20, "redis_prefix": name, **no_faults.CONNECTOR}
        outage = run_in_subprocess({
            "model": "llama", "extra": extra, "engine": TP2,
            "proxy_to": urlparse(redis_url).port, "steps": [
                ["wait_redis", 1, 300.0],
                ["proxy", "mode", "refuse"], ["proxy", "reset"],  # new and open: refused
                ["generate", "E1", E],
                ["snapshot", "refused"],
                ["proxy", "mode", "forward"],
                ["wait_redis", 1, 300.0],
                ["wait_backfills", 300.0],
                ["snapshot", "backfilled"]]})
        reader = run_tp({"model": "llama", "extra": dict(extra, redis_url_env=URL_ENV),
                         "steps": [["generate", "E2", E + " w6"]]}, redis_url)
        yield outage, reader


def test_tp2_what_both_ranks_saved_while_redis_refused_them_is_backfilled(
        baseline: dict[str, Any], backfilled: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """E's 4 blocks, saved to the CPU tier while no rank could write them to Redis, are
    written by both ranks once Redis answers, each exactly once, and a new engine restores
    them from Redis on both ranks with TP=2 alone's output."""
    outage, reader = backfilled
    runs = by_name(outage)
    e1 = runs["E1"]
    assert e1["token_ids"] == baseline["E1"]["token_ids"]
    wait, refused = runs["wait_backfills"], runs["refused"]["stats"]
    e2 = by_name(reader)["E2"]
    print("KVTIER-TP-BACKFILL", json.dumps({"E1": e1["delta"], "wait": wait,
                                            "E2": e2["delta"]}, sort_keys=True))
    assert e1["delta"].get("blocks_saved", 0) == 2 * 4  # per rank
    assert e1["delta"].get("blocks_written_redis", 0) == 0
    assert e1["delta"].get("redis_write_failures", 0) \
        + e1["delta"].get("redis_unavailable_saves", 0) > 0  # the outage, counted
    assert refused["redis_available"] == 0
    assert wait["reached"], wait
    assert (wait["planned"], wait["written"], wait["failed"]) == (4, 2 * 4, 0), wait
    after = runs["backfilled"]["stats"]
    assert after["blocks_backfilled_redis"] == 2 * 4
    assert after["bytes_backfilled_redis"] == e1["delta"]["bytes_saved_cpu"]
    assert e2["delta"].get("hit_tokens_redis", 0) == 128, why_missed(reader, "E2")
    assert e2["delta"].get("blocks_loaded_redis", 0) == 2 * 4
    assert e2["token_ids"] == baseline["E2"]["token_ids"]
