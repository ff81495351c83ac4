"""The scheduler half's decisions, over a real CpuTier and small stand-ins for vLLM objects."""

from __future__ import annotations

import hashlib

import pytest

from connector.connector_config import TieredConfig
from connector.connector_metadata import TIER_CPU
from connector.kv_layout import GroupLayout, KVLayout, TensorSlice
from connector.scheduler_side import ATTENTION, MAMBA, GroupSpec, TieredScheduler
from connector.worker_side import TieredWorker, TierRuntime
from offload_tiers.keys import BlockKind
from tests.support.sched_doubles import Blk, Req

UNIT = 32
BS = 64


def _runtime(groups: list[GroupSpec], **cfg: object) -> TierRuntime:
    rt = TierRuntime(TieredConfig(cpu_bytes=1 << 20, **cfg))
    slices = tuple(GroupLayout(g.group, g.kind, g.block_size,
                               (TensorSlice("l", 0, 0, (16,), "uint8", 1, 0, 16),))
                   for g in groups)
    rt.attach_cpu(KVLayout("cpu", 100, slices))
    return rt


def _sched(groups: list[GroupSpec], blocks: dict[str, list[list[Blk]]],
           **cfg: object) -> TieredScheduler:
    rt = _runtime(groups, **cfg)
    return TieredScheduler(rt, groups, UNIT, lambda tenant: "ab" * 16,
                           lambda rid: blocks[rid], lambda bid: Blk(bid))


def _store(s: TieredScheduler, req: Req, group: int, tokens: int) -> None:
    g = s.groups[group]
    assert s.rt.cpu is not None
    assert s.rt.cpu.put(s.key(req, "ab" * 16, g, tokens), bytes(16))


LLAMA = [GroupSpec(0, ATTENTION, UNIT)]
HYBRID = [GroupSpec(0, MAMBA, BS), GroupSpec(1, ATTENTION, BS)]


def test_full_run_stops_at_first_missing_block_and_before_last_token() -> None:
    s = _sched(LLAMA, {})
    req = Req("r", 130)
    for tokens in (32, 64, 128):
        _store(s, req, 0, tokens)
    assert s.lookup(req, 0) == 64  # block 3 (..96) is missing
    _store(s, req, 0, 96)
    assert s.lookup(req, 0) == 128
    assert s.lookup(req, 64) == 64
    whole = Req("r", 128)  # the whole prompt is stored: offered one short, like vLLM's own
    assert s.lookup(whole, 0) == 127


def test_whole_prompt_hit_loads_the_last_block_whole_and_counts_what_vllm_took() -> None:
    s = _sched(LLAMA, {})
    req = Req("r", 96)
    for tokens in (32, 64, 96):
        _store(s, req, 0, tokens)
    assert s.lookup(req, 32) == 63  # vLLM recomputes the last token (sync: at most n - 1)
    s.on_alloc(req, [[Blk(7), Blk(8), Blk(9)]], 63)
    plan = s.plan({}, {}, set())
    assert [(op.block_id, op.key.num_tokens) for op in plan.loads] == [(8, 64), (9, 96)]
    assert not s.load_async and plan.async_reqs == []  # attention-only: synchronous loads
    assert s.hit_tiers("r") == {TIER_CPU: 63, "redis": 0}


def test_hybrid_never_offers_the_whole_prompt() -> None:
    s = _sched(HYBRID, {})
    req = Req("r", 128)
    for group, tokens in ((1, 64), (0, 64), (1, 96), (0, 96), (1, 128), (0, 128)):
        _store(s, req, group, tokens)
    # The Mamba state at 128 already contains token 127: a hit ends at a state <= 127.
    assert s.lookup(req, 0) == 96


def test_pins_are_released_when_vllm_takes_nothing() -> None:
    s = _sched(LLAMA, {})
    req = Req("r", 100)
    _store(s, req, 0, 32)
    assert s.lookup(req, 0) == 32
    assert s.rt.cpu is not None and s.rt.cpu.stats()["pinned"] == 1
    s.on_alloc(req, [[Blk(5)]], 0)
    assert s.rt.cpu.stats()["pinned"] == 0


def test_hybrid_hits_withheld_when_switched_off_and_counted() -> None:
    s = _sched(HYBRID, {}, hybrid_hits=False)
    req = Req("r", 200)
    for group, tokens in ((1, 64), (1, 96), (0, 96)):
        _store(s, req, group, tokens)
    assert s.lookup(req, 0) == 0
    snap = s.rt.counters.snapshot()
    assert snap["hybrid_hits_withheld"] == 96 and snap["rounded_down_tokens"] == 96
    assert s.rt.cpu is not None and s.rt.cpu.stats()["pinned"] == 0


def test_hybrid_partial_only_ends_a_hit_and_needs_the_mamba_state() -> None:
    s = _sched(HYBRID, {})
    req = Req("r", 200)
    _store(s, req, 1, 64)  # FULL attention block 0
    _store(s, req, 1, 96)  # PARTIAL attention entry in block 1
    assert s.lookup(req, 0) == 0  # no Mamba state anywhere: never a half restore
    _store(s, req, 0, 64)
    assert s.lookup(req, 0) == 64
    _store(s, req, 0, 96)
    assert s.lookup(req, 0) == 96
    # A PARTIAL entry at 96 never stands in for the FULL block 1 (..128).
    _store(s, req, 0, 128)
    assert s.lookup(req, 0) == 96
    _store(s, req, 1, 128)
    assert s.lookup(req, 0) == 128


def _hybrid_hit(mamba_ids: list[int], attn_ids: list[int],
                stored: tuple[tuple[int, int], ...], hit: int) -> TieredScheduler:
    """A hybrid request "r" (200 tokens) whose hit of ``hit`` tokens vLLM accepted.

    Mamba block 0 is null (vLLM keeps only the blocks holding states); ``stored`` lists the
    (group, tokens) entries in the CPU tier.
    """
    blocks = [[Blk(0, is_null=True)] + [Blk(i) for i in mamba_ids], [Blk(i) for i in attn_ids]]
    s = _sched(HYBRID, {"r": blocks})
    req = Req("r", 200)
    for group, tokens in stored:
        _store(s, req, group, tokens)
    assert s.lookup(req, 0) == hit
    s.on_alloc(req, blocks, hit)
    return s


def test_hybrid_hit_loads_every_group_into_the_right_blocks() -> None:
    s = _hybrid_hit([11], [20, 21, 22], ((1, 64), (1, 96), (0, 96)), 96)
    plan = s.plan({"r": 100}, {}, set())
    loads = {(op.group, op.block_id, op.key.num_tokens, op.key.kind) for op in plan.loads}
    assert loads == {(1, 20, 64, BlockKind.FULL), (1, 21, 96, BlockKind.PARTIAL),
                     (0, 11, 96, BlockKind.PARTIAL)}
    assert all(op.tier == TIER_CPU and op.slot is not None for op in plan.loads)
    assert s.rt.counters.snapshot()["hit_tokens_cpu"] == 96
    # Hybrid hits are asynchronous for vLLM: the worker reports "r" done once it loaded.
    assert s.load_async and plan.async_reqs == ["r"]
    worker = TieredWorker(s.rt)
    worker.load(plan)
    assert worker.take_finished_recving() == {"r"} and worker.take_finished_recving() == set()


def test_restored_mamba_state_also_lands_in_the_running_block() -> None:
    """vLLM copies state (L-1)//B -> running block before connector loads run: mirror it."""
    s = _hybrid_hit([11, 12], [20, 21, 22], ((1, 64), (1, 128), (0, 128)), 128)
    plan = s.plan({"r": 160}, {}, set())  # this step runs 128..160: running block index 2
    mamba = sorted(op.block_id for op in plan.loads if op.group == 0)
    assert mamba == [11, 12]
    assert s.rt.cpu is not None
    assert s.rt.cpu.stats()["pinned"] == 3  # 2 attention + 1 Mamba entry (pinned twice)


def test_no_mirror_when_the_step_stays_in_the_restored_block() -> None:
    s = _hybrid_hit([11], [20, 21], ((1, 64), (1, 96), (0, 96)), 96)
    plan = s.plan({"r": 128}, {}, set())
    assert [op.block_id for op in plan.loads if op.group == 0] == [11]


def test_stores_follow_block_hash_num_tokens_and_promote_partials() -> None:
    blocks = {"r": [[], [Blk(20, 64), Blk(21, 96), Blk(22, None)]]}
    s = _sched(HYBRID, blocks)
    req = Req("r", 200)
    s.on_alloc(req, blocks["r"], 0)
    plan = s.plan({"r": 96}, {"r": [(0, 7, 96)]}, set())
    saves = [(op.group, op.block_id, op.key.num_tokens, op.key.kind) for op in plan.saves]
    assert saves == [(1, 20, 64, BlockKind.FULL), (1, 21, 96, BlockKind.PARTIAL),
                     (0, 7, 96, BlockKind.PARTIAL)]
    # Not computed yet: nothing; computed later: the FULL block supersedes the PARTIAL.
    blocks["r"][1][1] = Blk(21, 128)
    assert s.plan({"r": 100}, {}, set()).saves == []
    promoted = s.plan({"r": 128}, {}, set()).saves
    assert len(promoted) == 1 and promoted[0].key.kind is BlockKind.FULL
    assert promoted[0].supersedes is not None
    assert promoted[0].supersedes.kind is BlockKind.PARTIAL


def test_store_partial_off_and_gone_requests() -> None:
    blocks = {"r": [[], [Blk(20, 64), Blk(21, 96)]]}
    s = _sched(HYBRID, blocks, store_partial=False)
    req = Req("r", 200)
    s.on_alloc(req, blocks["r"], 0)
    assert s.plan({"r": 96}, {"r": [(0, 7, 96)]}, {"r"}).saves == []
    saves = s.plan({"r": 96}, {"r": [(0, 7, 96)]}, set()).saves
    assert [op.key.kind for op in saves] == [BlockKind.FULL]


def test_tenants_get_their_own_keys() -> None:
    rt = _runtime(LLAMA)
    def fingerprint(tenant: str) -> str:
        return hashlib.blake2b(tenant.encode(), digest_size=16).hexdigest()

    s = TieredScheduler(rt, LLAMA, UNIT, fingerprint, lambda rid: [], lambda bid: Blk(bid))
    a, b = Req("a", 100, cache_salt="alice"), Req("b", 100, cache_salt="bob")
    assert rt.cpu is not None
    rt.cpu.put(s.key(a, s._fingerprint(s.tenant(a)), LLAMA[0], 32), bytes(16))
    assert s.lookup(a, 0) == 32
    assert s.lookup(b, 0) == 0  # same tokens, same hashes, other tenant: a miss
    assert s.tenant(a) == "/alice"


def test_unsupported_groups_never_hit() -> None:
    s = _sched([GroupSpec(0, "SlidingWindowSpec", UNIT)], {})
    assert s.lookup(Req("r", 100), 0) == 0


@pytest.mark.parametrize("bad", [48])
def test_block_size_must_be_a_multiple_of_the_hash_unit(bad: int) -> None:
    with pytest.raises(ValueError, match="multiple"):
        _sched([GroupSpec(0, ATTENTION, bad)], {})
