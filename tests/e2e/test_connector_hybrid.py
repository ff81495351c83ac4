"""kvtier with the tiny hybrid (Mamba + attention, partial prefix entries) in a real engine.

One engine in this process, reused by every assertion, over a multi-turn conversation that
empties vLLM's prefix cache before each turn (so every hit is kvtier's). Its Redis is a
server this module owns: killed (SIGKILL), restarted and paused (SIGSTOP) between turns.
Outputs must equal a baseline engine without kvtier (its own process).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from connector.demo.tiny_models import prompt_words
from connector.events.wire import BlockStored
from rigs import engine_starts
from rigs.redis_keys import scratch_prefix
from rigs.redis_server import RedisServer
from tests.support import no_faults, worker_probe
from tests.support.batches import HIT, WARM
from tests.support.connector_runner import (
    counters,
    kvtier_stats,
    multi_turn,
    run_in_subprocess,
)
from tests.support.vllm_engine import (
    apply_cpu_engine_env,
    hybrid_engine_kwargs,
    kvtier_transfer_config,
)

pytestmark = pytest.mark.e2e

FIRST_PROMPT = prompt_words(21, 100)
TURNS = 6
MARKER = list(range(300, 370))  # token ids no other prompt starts with (a full 64-block)


# Scenarios of their own (each test's steps); one engine without kvtier runs them all, and
# the first Redis engine runs RESTORED_STEPS and SHARED_STEPS after its own: vLLM's prefix
# cache is reset between scenarios and their prompts share no block, so each scenario sees
# what a fresh engine would.
TURN1 = prompt_words(41, 240)
TURN2 = TURN1 + " " + prompt_words(42, 40)
RESTORED_STEPS = [["generate", "T1", TURN1], ["reset"], ["generate", "T1-restored", TURN1],
                  ["generate", "T2", TURN2]]
SHARED = prompt_words(61, 100)  # 100 tokens: blocks of 64, hash unit 32 -> hit ends at 96
SHARED_STEPS = [["generate", "P", SHARED], ["reset"],
                ["generate", "P-short", SHARED + " " + prompt_words(62, 2)], ["reset"],
                ["generate", "P-again", SHARED],
                ["generate", "P-cross", SHARED + " " + prompt_words(63, 48)],  # fills block 1
                ["reset"], ["generate", "P-after", SHARED]]
FAILED = prompt_words(64, 130)
FAILED_STEPS = [["generate", "F", FAILED], ["generate", "G", prompt_words(65, 70)]]


def by_name(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {o["name"]: o for o in result["outputs"]}


# Batches of requests sharing prefixes (4 sequences at once; max_num_batched_tokens stays
# at the preset's 32): the engines below run with max_num_seqs=4.
BATCH_STEPS = [["batch", "warm", WARM], ["reset"], ["batch", "hit", HIT]]
ENGINE = {"max_num_seqs": 4}


@pytest.fixture(scope="module")
def base_runs(tiny_hybrid_dir: Path) -> dict[str, dict[str, Any]]:
    """vLLM alone, every scenario of the module, one engine (a reset before each)."""
    steps = [["multi_turn", FIRST_PROMPT, TURNS]]
    for scenario in (RESTORED_STEPS, SHARED_STEPS, FAILED_STEPS, BATCH_STEPS):
        steps += [["reset"], *scenario]
    return by_name(run_in_subprocess({"model": "hybrid", "extra": None, "steps": steps,
                                      "engine": ENGINE}))


@pytest.fixture(scope="module")
def baseline(base_runs: dict[str, dict[str, Any]]) -> list[list[int]]:
    return [base_runs[f"turn{i}"]["token_ids"] for i in range(TURNS)]


@pytest.fixture(scope="module")
def redis_runs(tiny_hybrid_dir: Path, redis_url: str) -> Iterator[list[dict[str, Any]]]:
    """Two kvtier engines on one Redis prefix, one after the other. The first stores a
    3-turn conversation and FAILED, then runs the restored-state, shared-partial and batch
    scenarios (served by its CPU tier, which holds everything it stored); the second (fresh
    CPU tier) restores the conversation from Redis, then every value is flipped and it asks
    for FAILED."""
    with scratch_prefix(redis_url) as prefix:
        extra = {"cpu_bytes": 64 << 20, "redis_url": redis_url, "redis_prefix": prefix,
                 **no_faults.CONNECTOR}  # this test injects no fault
        conversation = ["multi_turn", FIRST_PROMPT, 3]
        first = run_in_subprocess({"model": "hybrid", "extra": extra, "engine": ENGINE,
                                   "steps": [conversation, FAILED_STEPS[0], ["reset"],
                                             *RESTORED_STEPS, ["reset"], *SHARED_STEPS,
                                             ["reset"], *BATCH_STEPS]})
        second = run_in_subprocess({"model": "hybrid", "extra": extra, "steps": [
            conversation, ["damage_rank", redis_url, prefix, "flip"], *FAILED_STEPS]})
        yield [first, second]


@pytest.fixture(scope="module")
def cpu_runs(redis_runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The first Redis engine's scenarios after its conversation, by name; the counters of
    the engine at rest under ``"at_rest"``."""
    return {**by_name(redis_runs[0]), "at_rest": redis_runs[0]}


class EventSink:
    """A real ZMQ SUB socket, bound: vLLM's KV-event publisher connects to it (an endpoint
    without ``*``), and every batch is decoded with kvtier's own decoder. An exception in
    its thread (an undecodable batch) fails the test: ``received()`` and ``close()`` raise
    it."""

    def __init__(self) -> None:
        import threading

        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.events: list[Any] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        from connector.events.wire import decode_batch

        try:
            while not self._stop.is_set():
                try:
                    frames = self._sock.recv_multipart()
                except zmq.Again:
                    continue
                self.events.extend(decode_batch(frames[-1]).events)
        except BaseException as exc:  # re-raised in the test's thread
            self.error = exc

    def received(self) -> list[Any]:
        """The events received so far (raises what the receiving thread raised)."""
        if self.error is not None:
            raise self.error
        return list(self.events)

    def wait_for(self, predicate: Any, what: str, deadline_s: float = 300.0) -> list[Any]:
        """Poll until ``predicate(events)``; the deadline only ends a hang."""
        deadline = time.monotonic() + deadline_s
        while not predicate(events := self.received()):
            assert time.monotonic() < deadline, f"never received: {what}"
            time.sleep(0.02)  # polling interval
        return events

    def close(self) -> None:
        self._stop.set()
        self._thread.join(60)  # one receive timeout (0.2 s) at most: only a hang takes long
        assert not self._thread.is_alive(), "the event sink's thread did not stop"
        self._sock.close(0)
        self._ctx.term()
        if self.error is not None:
            raise self.error


@pytest.fixture(scope="module")
def run(tiny_hybrid_dir: Path, redis_srv: RedisServer) -> Iterator[dict[str, Any]]:
    """The kvtier engine's conversation (vLLM's default executors), with Redis faults
    between turns; kvtier's counters come from vLLM's metrics, its events from the wire."""
    apply_cpu_engine_env()
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig

    sink = EventSink()
    extra = {"cpu_bytes": 64 << 20, "redis_url": redis_srv.url, "redis_prefix": "hyb",
             "redis_timeout_s": 0.5}
    events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                   endpoint=sink.endpoint, topic="kv")
    engine_starts.record("in-process engine: hybrid tp1 kvtier")
    llm = LLM(**hybrid_engine_kwargs(tiny_hybrid_dir, kv_events_config=events_config,
                                     kv_transfer_config=kvtier_transfer_config(extra),
                                     worker_extension_cls=worker_probe.PROBE_CLS))
    params = SamplingParams(max_tokens=8, temperature=0.0)
    per_turn: list[dict[str, Any]] = []
    outputs: list[list[int]] = []

    def stats() -> dict[str, Any]:
        return counters(kvtier_stats(llm))

    def poke() -> None:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1),
                     use_tqdm=False)  # the workers report with each step

    def generate(name: str, prompt: str) -> str:
        before = stats()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        # The turn's Redis writes have their outcome before the next turn's fault: counted
        # in this turn, never in the next one.
        worker_probe.drain(llm, lambda: kvtier_stats(llm), poke)
        after = stats()
        per_turn.append({k: after[k] - before.get(k, 0) for k in after} | {
            "redis_available": after.get("redis_available"),
            "num_cached_tokens": out.num_cached_tokens})
        outputs.append(list(out.outputs[0].token_ids))
        return out.outputs[0].text

    def wait_available(want: int, timeout_s: float = 120) -> int:
        deadline = time.monotonic() + timeout_s  # only a Redis that never comes back
        while time.monotonic() < deadline and stats().get("redis_available") != want:
            poke()
            time.sleep(0.2)  # polling interval (the tier's probe backs off on its own)
        return int(stats().get("redis_available", -1))

    seen: dict[str, int] = {}

    def pause_when_up() -> None:
        seen["before_pause"] = wait_available(1)  # up again since the restart ...
        redis_srv.pause()  # ... so the 0 seen during the pause is the pause's

    hooks = {2: redis_srv.kill, 3: redis_srv.start, 4: pause_when_up, 5: redis_srv.resume}
    try:
        multi_turn(generate, llm.reset_prefix_cache, FIRST_PROMPT, TURNS, hooks)
        # Redis is back: kvtier notices (background probe with backoff) and writes again.
        recovered = wait_available(1)
        final = stats()
        # A marker request, last: once its GPU block is announced, every batch vLLM published
        # before it has arrived too (one PUB socket, in order).
        llm.generate([{"prompt_token_ids": MARKER}], SamplingParams(max_tokens=1),
                     use_tqdm=False)
        events = sink.wait_for(lambda evs: any(
            isinstance(e, BlockStored) and tuple(e.token_ids[:32]) == tuple(MARKER[:32])
            for e in evs), "the marker request's BlockStored")
        yield {"outputs": outputs, "per_turn": per_turn, "events": events,
               "stats": final, "recovered": recovered, **seen}
    finally:
        llm.llm_engine.engine_core.shutdown()  # now, not at the worker's exit
        sink.close()
        if redis_srv.proc is not None and redis_srv.proc.poll() is None:
            redis_srv.resume()


def test_outputs_equal_baseline_through_redis_faults(run: dict[str, Any],
                                                     baseline: list[list[int]]) -> None:
    assert run["outputs"] == baseline


def test_hybrid_prefixes_restored_including_partial_ends(run: dict[str, Any]) -> None:
    """Every turn after the first is restored (attention blocks + Mamba state) by kvtier."""
    served = [t["hit_tokens_cpu"] + t["hit_tokens_redis"] for t in run["per_turn"]]
    assert served[0] == 0
    assert all(h > 0 for h in served[1:]), served
    # Some hits end on a PARTIAL entry (inside a 64-token block), never served as full.
    assert any(h % 64 for h in served), served
    assert all(t["num_cached_tokens"] == h for t, h in zip(run["per_turn"], served, strict=True))
    assert run["stats"]["load_errors"] == 0
    assert run["stats"]["hybrid_hits_withheld"] == 0


def test_second_engine_serves_hybrid_prefix_from_redis(
        baseline: list[list[int]], redis_runs: list[dict[str, Any]]) -> None:
    first, second = (
        [o for o in run["outputs"] if o["name"].startswith("turn")] for run in redis_runs)
    assert [o["token_ids"] for o in first] == baseline[:3]
    assert [o["token_ids"] for o in second] == baseline[:3]
    from_redis = [o["delta"].get("hit_tokens_redis", 0) for o in second]
    print("KVTIER-HYBRID-REDIS", from_redis)
    assert from_redis[0] > 0  # the fresh engine's very first request is served from Redis


def test_partial_entries_stored_as_partial(run: dict[str, Any]) -> None:
    """PARTIAL entries reach the CPU tier as PARTIAL: announced with the hash unit (32) as
    their block size and one hash, never as a 64-token block."""
    from connector.events.wire import BlockStored

    assert run["stats"]["partial_blocks_saved"] > 0
    cpu = [e for e in run["events"] if isinstance(e, BlockStored) and e.medium == "CPU"
           and e.kv_cache_spec_kind == "full_attention"]
    partial = [e for e in cpu if e.block_size == 32]
    assert partial, "no PARTIAL entry announced for the CPU tier"
    assert all(len(e.block_hashes) == 1 and len(e.token_ids) == 32 for e in partial)


def test_events_shaped_as_vllm_shapes_them(run: dict[str, Any]) -> None:
    from connector.events.wire import BlockStored

    stored = [e for e in run["events"] if isinstance(e, BlockStored)
              and e.medium in ("CPU", "STORAGE")]
    attn = [e for e in stored if e.kv_cache_spec_kind == "full_attention"]
    partial = [e for e in attn if e.block_size == 32]
    full = [e for e in attn if e.block_size == 64]
    assert partial and full
    assert all(len(e.block_hashes) == 1 and len(e.token_ids) == 32 for e in partial)
    assert all(len(e.token_ids) == 64 for e in full)
    mamba = [e for e in stored if e.kv_cache_spec_kind == "mamba"]
    assert mamba and all(e.token_ids == [] and e.block_size == 0 for e in mamba)
    assert {e.medium for e in stored} == {"CPU", "STORAGE"}
    assert {e.ownership for e in stored} == {"kvtier"}  # told apart from vLLM's own


def test_redis_degradation_visible_and_recovers(run: dict[str, Any]) -> None:
    turns = run["per_turn"]
    keep = ("hit_tokens_cpu", "hit_tokens_redis", "blocks_saved", "partial_blocks_saved",
            "blocks_written_redis", "store_drops", "redis_write_failures", "redis_lookup_skips",
            "redis_unavailable_saves", "redis_available", "redis_backfills",
            "blocks_backfilled_redis", "redis_backfill_failures")
    print("KVTIER-HYBRID-SUMMARY", json.dumps([{k: t.get(k) for k in keep} for t in turns]))
    assert turns[1]["blocks_written_redis"] > 0  # healthy
    assert turns[2]["redis_available"] == 0  # killed before turn 2
    # Saves with Redis down go to the CPU tier only (counted); nothing is written to Redis.
    assert turns[2]["redis_unavailable_saves"] + turns[2]["store_drops"] > 0
    assert turns[2]["blocks_written_redis"] == 0
    assert run["before_pause"] == 1  # up after the restart, before the pause
    assert turns[4]["redis_available"] == 0  # paused before turn 4
    assert run["recovered"] == 1
    # What turn 2 saved while Redis was gone was sent to it once it was back (the backfill;
    # a write the pause cut short is a counted failure).
    assert run["stats"]["redis_backfills"] > 0


def test_restored_state_is_kept_in_vllms_own_cache_for_the_next_turn(
        base_runs: dict[str, dict[str, Any]], cpu_runs: dict[str, dict[str, Any]]) -> None:
    """A restore is handed to vLLM asynchronously, so vLLM caches the restored blocks and
    Mamba state before the request runs: the next turn hits vLLM's own cache there instead of
    kvtier loading the same prefix again (a synchronous restore's state was overwritten)."""
    base, runs = base_runs, cpu_runs
    restored = runs["T1-restored"]["delta"].get("hit_tokens_cpu", 0)
    t2 = runs["T2"]
    local = t2["num_cached_tokens"] - t2["delta"].get("hit_tokens_cpu", 0)
    print("KVTIER-HYBRID-NEXT-TURN", {"restored": restored, "t2_cached": t2["num_cached_tokens"],
                                      "t2_from_vllm": local})
    assert restored > 0 and base["T1-restored"]["num_cached_tokens"] == 0
    assert local >= restored  # vLLM's own cache serves at least the restored prefix
    for name in ("T1", "T1-restored", "T2"):
        assert runs[name]["token_ids"] == base[name]["token_ids"], name


def test_shared_partial_entry_survives_a_request_that_fills_its_block(
        base_runs: dict[str, dict[str, Any]], cpu_runs: dict[str, dict[str, Any]]) -> None:
    """A PARTIAL entry is a cache entry for every request sharing its prefix: a request that
    fills the block (a FULL block of a different hash) must not take it away from the next
    request with the same prompt (issue #10 item 4: 96 restored before, only 64 after)."""
    names = [step[1] for step in SHARED_STEPS if step[0] == "generate"]
    served = {n: cpu_runs[n]["delta"].get("hit_tokens_cpu", 0) for n in names}
    print("KVTIER-SHARED-PARTIAL", served)
    assert served["P-again"] == 96
    assert served["P-after"] == 96  # still 96 after P-cross filled the block
    for name in names:
        assert cpu_runs[name]["token_ids"] == base_runs[name]["token_ids"], name


def test_failed_hybrid_restore_is_recomputed_and_the_engine_keeps_serving(
        base_runs: dict[str, dict[str, Any]], redis_runs: list[dict[str, Any]]) -> None:
    """Every Redis value's payload flipped: the probe passes (headers intact), the fetch
    fails its checksum, the request is reported in ``failed_recving`` and recomputed by vLLM
    (issue #10 item 5: this raised RuntimeError in the engine before). The engine had
    restored a conversation from Redis before the damage (``redis_runs``)."""
    runs = by_name(redis_runs[1])
    assert runs["damage_rank-flip"]["result"]["damaged"] > 0
    assert runs["F"]["delta"].get("failed_restores", 0) == 1
    assert runs["F"]["delta"].get("hit_tokens_redis", 0) == 0
    assert runs["F"]["num_cached_tokens"] == 0
    for name in ("F", "G"):  # and the engine serves the next request too
        assert runs[name]["token_ids"] == base_runs[name]["token_ids"], name


def test_hybrid_batched_requests_hit_with_identical_output(
        base_runs: dict[str, dict[str, Any]], cpu_runs: dict[str, dict[str, Any]]) -> None:
    """Batches sharing prefixes, 4 sequences at once: every request gets a prefix hit,
    never less than vLLM alone finds, with identical outputs."""
    for batch, prompts in (("warm", WARM), ("hit", HIT)):
        for i in range(len(prompts)):
            name = f"{batch}/{i}"
            assert cpu_runs[name]["token_ids"] == base_runs[name]["token_ids"], name
    hit = cpu_runs["hit"]["delta"]
    cached = [cpu_runs[f"hit/{i}"]["num_cached_tokens"] for i in range(len(HIT))]
    baseline = [base_runs[f"hit/{i}"]["num_cached_tokens"] for i in range(len(HIT))]
    print("KVTIER-HYBRID-BATCH", {"hit_delta": hit, "num_cached": cached,
                                  "baseline": baseline})
    # Each request that gets more than vLLM alone is kvtier's restore (the others' hits
    # are vLLM's own, from a batch-mate restored in the same step).
    assert all(c > 0 for c in cached), cached
    assert all(c >= b for c, b in zip(cached, baseline, strict=True))
    extended = sum(c > b for c, b in zip(cached, baseline, strict=True))
    assert hit.get("hit_requests", 0) >= extended > 0
    assert hit.get("hit_tokens_cpu", 0) >= sum(
        c - b for c, b in zip(cached, baseline, strict=True))
    at_rest = cpu_runs["at_rest"]
    assert at_rest["stats"]["load_errors"] == 0
    assert at_rest["cpu_tier"]["pinned"] == 0 and at_rest["cpu_tier"]["reserved"] == 0
