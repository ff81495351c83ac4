"""The scheduler half's decisions over its slot directory and small stand-ins for vLLM objects.

The scheduler never does I/O: "a key is in the CPU tier" is a committed entry of its directory,
and "Redis holds it" is what a (hand-made) worker report says.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from connector.vllm_connector.config import TieredConfig
from connector.vllm_connector.plan import WorkerReport
from connector.vllm_connector.scheduler import (
    ATTENTION,
    MAMBA,
    GroupSpec,
    TieredScheduler,
)
from connector.vllm_connector.secondary import HitSource
from offload_tiers.keys import BlockKey, BlockKind
from rigs.sched_doubles import Blk, Req

UNIT = 32
BS = 64
FP = "ab" * 16
# Never contacted: the scheduler half only plans probes; workers run them.
DEAD_REDIS = "redis://127.0.0.1:1/0"

LLAMA = [GroupSpec(0, ATTENTION, UNIT)]
HYBRID = [GroupSpec(0, MAMBA, BS), GroupSpec(1, ATTENTION, BS)]


def _sched(groups: list[GroupSpec], blocks: dict[str, list[list[Blk]]] | None = None,
           world_size: int = 1, num_slots: int = 64, pool: dict[int, Blk] | None = None,
           events: bool = True, **cfg: Any) -> TieredScheduler:
    table = blocks if blocks is not None else {}
    by_id = pool if pool is not None else {}
    return TieredScheduler(TieredConfig(**cfg), groups, UNIT, num_slots, 16, world_size,
                           lambda tenant: FP, lambda rid: table[rid],
                           lambda bid: by_id.get(bid, Blk(bid)), events=events)


def _store(s: TieredScheduler, req: Req, group: int, tokens: int) -> BlockKey:
    """Put ``req``'s entry of ``group`` covering ``tokens`` into the CPU tier's directory."""
    key = s.key(req, FP, s.groups[group], tokens)
    assert s.directory.reserve(key) is not None
    s.directory.commit(key)
    return key


def _pinned(s: TieredScheduler) -> int:
    return int(s.directory.stats()["pinned"])


def test_full_run_stops_at_first_missing_block_and_before_last_token() -> None:
    s = _sched(LLAMA)
    req = Req("r", 130)
    for tokens in (32, 64, 128):
        _store(s, req, 0, tokens)
    assert s.lookup(req, 0) == (64, False)  # block 3 (..96) is missing
    _store(s, req, 0, 96)
    assert s.lookup(req, 0) == (128, False)
    assert s.lookup(req, 64) == (64, False)
    whole = Req("r", 128)  # the whole prompt is stored: offered one short, like vLLM's own
    assert s.lookup(whole, 0) == (127, False)


def test_without_kv_events_no_event_payload_is_kept() -> None:
    """vLLM publishes the connector's events only with KV events enabled: without, a save
    keeps no token ids for a BlockStored that is never built."""
    for events in (True, False):
        blocks = {"r": [[Blk(1, 32), Blk(2, 64)]]}
        s = _sched(LLAMA, blocks, events=events)
        s.on_alloc(Req("r", 70), blocks["r"], 0)
        plan = s.plan({"r": 64}, {}, set())
        assert len(plan.saves) == 2
        assert len(s.event_info) == (2 if events else 0)


def test_whole_prompt_hit_loads_the_last_block_whole_and_counts_what_vllm_took() -> None:
    s = _sched(LLAMA)
    req = Req("r", 96)
    keys = [_store(s, req, 0, tokens) for tokens in (32, 64, 96)]
    assert s.lookup(req, 32) == (63, False)  # vLLM recomputes the last token (at most n - 1)
    s.on_alloc(req, [[Blk(7), Blk(8), Blk(9)]], 63)
    plan = s.plan({}, {}, set())
    assert [(op.block_id, op.key) for op in plan.loads] == [(8, keys[1]), (9, keys[2])]
    assert not any(op.after_fetch for op in plan.loads) and plan.fetches == []
    assert plan.async_reqs == []  # attention-only CPU hit: a synchronous load
    assert s.hit_tiers("r") == {HitSource.CPU: 63, HitSource.REDIS: 0}
    assert _pinned(s) == 0  # the loads run in this step, before any later save: pins go


def test_hybrid_never_offers_the_whole_prompt() -> None:
    s = _sched(HYBRID)
    req = Req("r", 128)
    for group, tokens in ((1, 64), (0, 64), (1, 96), (0, 96), (1, 128), (0, 128)):
        _store(s, req, group, tokens)
    # The Mamba state at 128 already contains token 127: a hit ends at a state <= 127.
    assert s.lookup(req, 0) == (96, True)


def test_pins_are_released_when_vllm_takes_nothing() -> None:
    s = _sched(LLAMA)
    req = Req("r", 100)
    _store(s, req, 0, 32)
    assert s.lookup(req, 0) == (32, False)
    assert _pinned(s) == 1
    s.on_alloc(req, [[Blk(5)]], 0)
    assert _pinned(s) == 0
    assert s.plan({}, {}, set()).loads == []


def test_a_hit_taken_in_part_is_refused_released_and_counted() -> None:
    s = _sched(LLAMA)
    req = Req("r", 100)
    for tokens in (32, 64):
        _store(s, req, 0, tokens)
    assert s.lookup(req, 0) == (64, False)
    s.on_alloc(req, [[Blk(5), Blk(6)]], 32)  # vLLM took 32 of the 64 offered
    assert s.plan({}, {}, set()).loads == []
    assert _pinned(s) == 0 and s.counters.snapshot()["refused_loads"] == 1


def test_a_second_lookup_lets_go_of_the_first_lookups_pins() -> None:
    s = _sched(LLAMA)
    req = Req("r", 100)
    _store(s, req, 0, 32)
    assert s.lookup(req, 0) == (32, False)
    assert s.lookup(req, 0) == (32, False)
    assert _pinned(s) == 1
    s.finished("r")
    assert _pinned(s) == 0


def test_hybrid_hits_withheld_when_switched_off_and_counted() -> None:
    s = _sched(HYBRID, hybrid_hits=False)
    req = Req("r", 200)
    for group, tokens in ((1, 64), (1, 96), (0, 96)):
        _store(s, req, group, tokens)
    assert s.lookup(req, 0) == (0, False)
    snap = s.counters.snapshot()
    assert snap["hybrid_hits_withheld"] == 96 and snap["rounded_down_tokens"] == 96
    assert _pinned(s) == 0


def test_hybrid_partial_only_ends_a_hit_and_needs_the_mamba_state() -> None:
    s = _sched(HYBRID)
    req = Req("r", 200)
    _store(s, req, 1, 64)  # FULL attention block 0
    _store(s, req, 1, 96)  # PARTIAL attention entry in block 1
    assert s.lookup(req, 0) == (0, False)  # no Mamba state anywhere: never a half restore
    _store(s, req, 0, 64)
    assert s.lookup(req, 0) == (64, True)
    _store(s, req, 0, 96)
    assert s.lookup(req, 0) == (96, True)
    # A PARTIAL entry at 96 never stands in for the FULL block 1 (..128).
    _store(s, req, 0, 128)
    assert s.lookup(req, 0) == (96, True)
    _store(s, req, 1, 128)
    assert s.lookup(req, 0) == (128, True)


def test_hybrid_hit_loads_every_group_into_the_right_blocks_asynchronously() -> None:
    # Mamba block 0 is null (vLLM keeps only the blocks holding states).
    blocks = {"r": [[Blk(0, is_null=True), Blk(11)], [Blk(20), Blk(21), Blk(22)]]}
    s = _sched(HYBRID, blocks)
    req = Req("r", 200)
    for group, tokens in ((1, 64), (1, 96), (0, 96)):
        _store(s, req, group, tokens)
    assert s.lookup(req, 0) == (96, True)
    s.on_alloc(req, blocks["r"], 96)
    plan = s.plan({}, {}, set())
    loads = {(op.group, op.block_id, op.key.num_tokens, op.key.kind) for op in plan.loads}
    assert loads == {(1, 20, 64, BlockKind.FULL), (1, 21, 96, BlockKind.PARTIAL),
                     (0, 11, 96, BlockKind.PARTIAL)}
    assert not any(op.after_fetch for op in plan.loads) and plan.fetches == []
    # Hybrid hits are asynchronous loads for vLLM, even from the CPU tier: the request runs
    # only after its blocks (Mamba state included) are in vLLM's cache, so no running-block
    # mirror is needed (docs/connector.md, "Hybrid models").
    assert plan.async_reqs == ["r"]
    assert s.counters.snapshot()["hit_tokens_cpu"] == 96


def test_a_hit_with_no_block_allocated_is_refused_loudly() -> None:
    s = _sched(HYBRID)
    req = Req("r", 200)
    for group, tokens in ((1, 64), (0, 64)):
        _store(s, req, group, tokens)
    assert s.lookup(req, 0) == (64, True)
    with pytest.raises(RuntimeError, match="no block"):
        s.on_alloc(req, [[Blk(0, is_null=True)], [Blk(20)]], 64)


def test_stores_follow_block_hash_num_tokens_and_keep_the_partial() -> None:
    blocks = {"r": [[], [Blk(20, 64), Blk(21, 96), Blk(22, None)]]}
    s = _sched(HYBRID, blocks, pool={7: Blk(7, 96)})
    req = Req("r", 200)
    s.on_alloc(req, blocks["r"], 0)
    plan = s.plan({"r": 96}, {"r": [(0, 7, 96)]}, set())
    saves = [(op.group, op.block_id, op.key.num_tokens, op.key.kind) for op in plan.saves]
    assert saves == [(1, 20, 64, BlockKind.FULL), (1, 21, 96, BlockKind.PARTIAL),
                     (0, 7, 96, BlockKind.PARTIAL)]
    assert len({op.slot for op in plan.saves}) == 3 and len({op.job for op in plan.saves}) == 3
    partial = plan.saves[1].key
    # Not computed yet: nothing; computed later: the FULL block is a save of its own.
    blocks["r"][1][1] = Blk(21, 128)
    assert s.plan({"r": 100}, {}, set()).saves == []
    filled = s.plan({"r": 128}, {}, set()).saves
    assert [(op.block_id, op.key.num_tokens, op.key.kind) for op in filled] == [
        (21, 128, BlockKind.FULL)]
    # Issue 10 item 4: the PARTIAL stays valid for every request sharing its prefix.
    assert s.directory.contains(partial) and s.directory.contains(filled[0].key)
    assert not [c for c in s.outbox if not c.stored]


def test_store_partial_off_and_gone_requests() -> None:
    blocks = {"r": [[], [Blk(20, 64), Blk(21, 96)]]}
    s = _sched(HYBRID, blocks, pool={7: Blk(7, 96)}, store_partial=False)
    req = Req("r", 200)
    s.on_alloc(req, blocks["r"], 0)
    assert s.plan({"r": 96}, {"r": [(0, 7, 96)]}, {"r"}).saves == []
    saves = s.plan({"r": 96}, {"r": [(0, 7, 96)]}, set()).saves
    assert [op.key.kind for op in saves] == [BlockKind.FULL]


def test_mamba_hand_off_whose_block_has_another_hash_length_is_not_saved() -> None:
    blocks = {"r": [[], [Blk(20, 64)]]}
    s = _sched(HYBRID, blocks, pool={7: Blk(7, 64), 8: Blk(8, 96)})
    s.on_alloc(Req("r", 200), blocks["r"], 0)
    saves = s.plan({"r": 96}, {"r": [(0, 7, 96), (0, 8, 96)]}, set()).saves
    assert [(op.group, op.block_id, op.key.num_tokens) for op in saves] == [
        (1, 20, 64), (0, 8, 96)]


def test_saves_without_redis_are_not_pinned_and_with_redis_until_reported() -> None:
    blocks = {"r": [[Blk(1, 32), Blk(2, 64)]]}
    local = _sched(LLAMA, blocks)
    local.on_alloc(Req("r", 70), blocks["r"], 0)
    plan = local.plan({"r": 64}, {}, set())
    assert [op.to_redis for op in plan.saves] == [False, False] and _pinned(local) == 0

    s = _sched(LLAMA, blocks, world_size=2, redis_url=DEAD_REDIS)
    s.on_alloc(Req("r", 70), blocks["r"], 0)
    plan = s.plan({"r": 64}, {}, set())
    assert [op.to_redis for op in plan.saves] == [True, True] and _pinned(s) == 2
    first, second = plan.saves
    s.on_report(WorkerReport(saves={first.job: [1, 1, 0], second.job: [1, 1, 0]}))
    assert _pinned(s) == 2  # one rank of two: still being written
    s.on_report(WorkerReport(saves={first.job: [1, 1, 0], second.job: [0, 1, 0]}))
    assert _pinned(s) == 0
    stored = {(c.key, c.medium) for c in s.outbox if c.stored}
    assert (first.key, "STORAGE") in stored and (second.key, "STORAGE") not in stored
    # Not in Redis on every rank: planned again, but the CPU tier has it (trusted: copied).
    assert s.directory.contains(second.key)


def test_a_save_a_rank_could_not_copy_leaves_the_cpu_tier_and_is_replanned() -> None:
    blocks = {"r": [[Blk(1, 32), Blk(2, 64)]]}
    s = _sched(LLAMA, blocks, world_size=2)
    s.on_alloc(Req("r", 70), blocks["r"], 0)
    plan = s.plan({"r": 64}, {}, set())
    bad = plan.saves[1]
    merged = WorkerReport(saves={bad.job: [1, 1, 0]}).merge(
        WorkerReport(saves={bad.job: [0, 1, 1]}))
    s.on_report(merged)
    assert not s.directory.contains(bad.key)
    assert [c for c in s.outbox if not c.stored][0].key == bad.key
    again = s.plan({"r": 64}, {}, set()).saves
    assert [op.key for op in again] == [bad.key] and again[0].job != bad.job


def test_lookup_asks_again_while_a_probe_is_out_then_uses_its_answer() -> None:
    s = _sched(LLAMA, world_size=2, redis_url=DEAD_REDIS)
    req = Req("r", 130)
    _store(s, req, 0, 32)
    assert s.lookup(req, 0) == (None, False)
    assert s.lookup(req, 0) == (None, False)  # still out: no second probe
    plan = s.plan({}, {}, set())
    assert len(plan.probes) == 1
    probe = plan.probes[0]
    assert [k.num_tokens for k in probe.keys] == [64, 96, 128]  # the CPU key is not probed
    assert s.plan({}, {}, set()).probes == []
    # Rank 0 has all three; rank 1 lacks the 96 one and holds another save of the 128 one:
    # a key counts only where every rank read the same save.
    s.on_report(WorkerReport(probes={probe.job: ([7, 8, 9], 1)}))
    assert s.lookup(req, 0) == (None, False)  # one rank of two answered
    s.on_report(WorkerReport(probes={probe.job: ([7, 0, 5], 1)}))
    assert s.lookup(req, 0) == (64, True)  # Redis keys: an asynchronous load
    blocks = [[Blk(5), Blk(6), Blk(7), Blk(8), Blk(9)]]
    s.on_alloc(req, blocks, 64)
    plan = s.plan({}, {}, set())
    assert [(op.key.num_tokens, op.save_id) for op in plan.fetches] == [(64, 7)]
    assert [(op.block_id, op.after_fetch) for op in plan.loads] == [(5, False), (6, True)]
    assert plan.loads[1].slot == plan.fetches[0].slot and plan.async_reqs == ["r"]
    assert s.hit_tiers("r") == {HitSource.CPU: 32, HitSource.REDIS: 32}
    assert s.directory.stats()["reserved"] == 1  # the fetch's slot, until the job ends
    s.on_report(WorkerReport(fetches={plan.fetches[0].job: [2, 2]}))
    assert s.directory.stats()["reserved"] == 0
    assert s.directory.contains(plan.fetches[0].key)


def test_a_fetch_that_fails_on_one_rank_is_not_offered_again() -> None:
    s = _sched(LLAMA, world_size=2, redis_url=DEAD_REDIS)
    req = Req("r", 100)
    assert s.lookup(req, 0) == (None, False)
    probe = s.plan({}, {}, set()).probes[0]
    s.on_report(WorkerReport(probes={probe.job: ([3, 4, 5], 2)}))
    assert s.lookup(req, 0) == (96, True)
    s.on_alloc(req, [[Blk(1), Blk(2), Blk(3), Blk(4)]], 96)
    fetches = s.plan({}, {}, set()).fetches
    ok = {f.job: [2, 2] for f in fetches}
    ok[fetches[1].job] = [1, 2]  # rank 1 found no valid value for the 64-token block
    s.on_report(WorkerReport(fetches=ok))
    assert s.directory.stats()["reserved"] == 0
    assert not s.directory.contains(fetches[1].key)
    # The 32-token block is in the CPU tier now; the bad key is neither probed nor offered.
    again = Req("r2", 100)
    assert s.lookup(again, 0) == (32, False)
    assert s.plan({}, {}, set()).probes == []


def test_a_probe_answer_is_used_however_many_steps_it_took() -> None:
    s = _sched(LLAMA, redis_url=DEAD_REDIS)
    req = Req("r", 100)
    assert s.lookup(req, 0) == (None, False)
    probe = s.plan({}, {}, set()).probes[0]
    for _ in range(500):  # slow steps or fast ones: only the answer ends the wait
        assert s.lookup(req, 0) == (None, False)
    s.on_report(WorkerReport(probes={probe.job: ([4, 4, 4], 1)}))
    assert s.lookup(req, 0) == (96, True)
    assert s.counters.snapshot()["probe_waits"] == 501


class _CountedWalks:
    """Counts the CPU-tier directory queries of a scheduler's look-ups (one per candidate
    end walked)."""

    def __init__(self, s: TieredScheduler) -> None:
        self.calls = 0
        real = s.directory.contains_many

        def counted(keys: Any) -> Any:
            self.calls += 1
            return real(keys)
        s.directory.contains_many = counted  # type: ignore[method-assign]


def test_asked_again_unchanged_while_its_probe_is_out_the_prompt_is_not_walked() -> None:
    s = _sched(LLAMA, redis_url=DEAD_REDIS)
    walks = _CountedWalks(s)
    req = Req("r", 100)
    assert s.lookup(req, 0) == (None, False)
    probe = s.plan({}, {}, set()).probes[0]
    assert walks.calls == 3  # ends 32, 64, 96
    for _ in range(100):  # vLLM asks every step while the probe is out
        assert s.lookup(req, 0) == (None, False)
    assert walks.calls == 3 and s.plan({}, {}, set()).probes == []
    s.on_report(WorkerReport(probes={probe.job: ([4, 4, 4], 1)}))
    assert s.lookup(req, 0) == (96, True)  # the answer is in: walked, held, offered
    assert walks.calls == 6
    assert s.counters.snapshot()["probe_waits"] == 101


def test_asked_with_more_computed_tokens_or_another_fingerprint_the_prompt_is_walked() -> None:
    fps = {"now": FP}
    s = TieredScheduler(TieredConfig(redis_url=DEAD_REDIS), LLAMA, UNIT, 64, 16, 1,
                        lambda tenant: fps["now"], lambda rid: [], lambda bid: Blk(bid))
    walks = _CountedWalks(s)
    req = Req("r", 100)
    assert s.lookup(req, 0) == (None, False)
    first = s.plan({}, {}, set()).probes[0]
    assert s.lookup(req, 32) == (None, False)  # vLLM's own cache grew: walked from 32
    assert walks.calls == 3 + 2 and s.plan({}, {}, set()).probes == []  # nothing new to ask
    fps["now"] = "cd" * 16  # the weights changed: new keys, asked of Redis
    assert s.lookup(req, 32) == (None, False)
    second = s.plan({}, {}, set()).probes[0]
    assert {k.fingerprint for k in second.keys} == {"cd" * 16}
    s.on_report(WorkerReport(probes={first.job: ([4, 4, 4], 1)}))
    assert s.lookup(req, 32) == (None, False)  # the old keys' answers are no answer
    s.on_report(WorkerReport(probes={second.job: ([0, 0], 1)}))
    assert s.lookup(req, 32) == (0, False)  # the new keys are in no tier


def test_a_grown_key_set_probes_only_the_new_keys_and_keeps_counting() -> None:
    s = _sched(LLAMA, redis_url=DEAD_REDIS)
    req = Req("r", 70)
    assert s.lookup(req, 0) == (None, False)
    first = s.plan({}, {}, set()).probes[0]
    assert [k.num_tokens for k in first.keys] == [32, 64]
    req.block_hashes.append(b"h2")  # the prompt grew a hash unit (another key to ask about)
    req.num_tokens = 100
    assert s.lookup(req, 0) == (None, False)
    second = s.plan({}, {}, set()).probes[0]
    assert [k.num_tokens for k in second.keys] == [96]  # nothing asked twice
    s.on_report(WorkerReport(probes={first.job: ([2, 2], 1)}))
    assert s.lookup(req, 0) == (None, False)  # still waiting for the 96 one
    s.on_report(WorkerReport(probes={second.job: ([2], 1)}))
    assert s.lookup(req, 0) == (96, True)
    assert s.counters.snapshot()["probe_waits"] == 3


def test_the_number_of_ask_again_answers_is_bounded_and_counted() -> None:
    s = _sched(LLAMA, redis_url=DEAD_REDIS, max_probe_asks=3)
    req = Req("r", 100)
    _store(s, req, 0, 32)
    assert [s.lookup(req, 0) for _ in range(3)] == [(None, False)] * 3
    assert s.lookup(req, 0) == (32, False)  # the answer never came: the CPU tier's hit
    snap = s.counters.snapshot()
    assert snap["probe_waits"] == 3 and snap["probe_gave_up"] == 1


def test_redis_reported_down_means_no_probes_and_cpu_only_saves() -> None:
    blocks = {"r": [[Blk(1, 32)]]}
    s = _sched(LLAMA, blocks, redis_url=DEAD_REDIS)
    s.on_report(WorkerReport(redis_up={0: 0}))
    assert not s.redis_up and s.counters.snapshot()["redis_available"] == 0
    assert s.lookup(Req("q", 100), 0) == (0, False)  # asked nobody
    s.on_alloc(Req("r", 40), blocks["r"], 0)
    plan = s.plan({"r": 32}, {}, set())
    assert plan.probes == [] and [op.to_redis for op in plan.saves] == [False]
    snap = s.counters.snapshot()
    assert snap["redis_lookup_skips"] == 1 and snap["redis_unavailable_saves"] == 1
    assert _pinned(s) == 0
    s.on_report(WorkerReport(redis_up={0: 1}))
    assert s.lookup(Req("q", 100), 0) == (None, False)  # asks Redis again


def test_a_full_tier_of_pins_sends_the_rest_to_redis_and_replans_failed_ones() -> None:
    blocks = {"r": [[Blk(i, (i + 1) * UNIT) for i in range(6)]]}
    s = _sched(LLAMA, blocks, num_slots=4, redis_url=DEAD_REDIS)
    s.on_alloc(Req("r", 6 * UNIT + 1), blocks["r"], 0)
    first = s.plan({"r": 6 * UNIT}, {}, set()).saves
    overflow = [op for op in first if op.slot is None]
    assert len(first) == 6 and [op.key.num_tokens for op in overflow] == [5 * UNIT, 6 * UNIT]
    snap = s.counters.snapshot()
    assert snap["store_drops"] == 0 and snap["overflow_saves"] == 2
    # The slotted writes landed; the overflow writes failed on the worker: re-planned.
    s.on_report(WorkerReport(saves={op.job: [int(op.slot is not None), 1, 0]
                                    for op in first}))
    second = s.plan({"r": 6 * UNIT}, {}, set()).saves
    assert [op.key.num_tokens for op in second] == [5 * UNIT, 6 * UNIT]
    assert s.directory.stats()["pinned"] == 2  # the re-planned ones, pinned for Redis again


def test_reset_empties_the_directory_and_announces_it() -> None:
    s = _sched(LLAMA)
    req = Req("r", 100)
    keys = {_store(s, req, 0, tokens) for tokens in (32, 64)}
    assert s.reset() == 2
    assert len(s.directory) == 0
    assert {c.key for c in s.outbox if not c.stored} == keys
    assert s.lookup(req, 0) == (0, False)


def test_tenants_get_their_own_keys() -> None:
    def fingerprint(tenant: str) -> str:
        return hashlib.blake2b(tenant.encode(), digest_size=16).hexdigest()

    s = TieredScheduler(TieredConfig(), LLAMA, UNIT, 64, 16, 1, fingerprint,
                        lambda rid: [], lambda bid: Blk(bid))
    a, b = Req("a", 100, cache_salt="alice"), Req("b", 100, cache_salt="bob")
    key = s.key(a, fingerprint(s.tenant(a)), LLAMA[0], 32)
    assert s.directory.reserve(key) is not None
    s.directory.commit(key)
    assert s.lookup(a, 0) == (32, False)
    assert s.lookup(b, 0) == (0, False)  # same tokens, same hashes, other tenant: a miss
    assert s.tenant(a) == "/alice"


def test_unsupported_groups_never_hit() -> None:
    s = _sched([GroupSpec(0, "SlidingWindowSpec", UNIT)])
    assert s.lookup(Req("r", 100), 0) == (0, False)
    assert s.plan({"r": 100}, {}, set()).saves == []


@pytest.mark.parametrize("bad", [48])
def test_block_size_must_be_a_multiple_of_the_hash_unit(bad: int) -> None:
    with pytest.raises(ValueError, match="multiple"):
        _sched([GroupSpec(0, ATTENTION, bad)])
