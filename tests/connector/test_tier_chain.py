"""The scheduler's chain of secondary tiers: a tier is a class behind one interface.

A tier of this test's own (a dict of the keys it holds, pure logic) is put first in a real
scheduler's chain, before Redis. The scheduler finds hits in it, holds them, plans their
fetches, counts them, and lets them go, through the interface only: no scheduler code
knows this tier.
"""

from __future__ import annotations

from connector.vllm_connector.config import TieredConfig
from connector.vllm_connector.plan import FetchOp, LoadFrom, WorkerReport
from connector.vllm_connector.scheduler import ATTENTION, GroupSpec, TieredScheduler
from connector.vllm_connector.secondary import Held, HitSource, TierLookup
from offload_tiers.keys import BlockKey
from rigs.sched_doubles import Blk, Req

UNIT = 32
FP = "cd" * 16


class _DictLookup:
    def __init__(self, tier: DictTier) -> None:
        self.tier = tier

    def locate(self, key: BlockKey) -> object | None:
        return self.tier.places.get(key)

    def settle(self, asked: list[BlockKey]) -> dict[BlockKey, object] | None:
        return {}


class DictTier:
    """Keys at made-up places; a hit's key gets a reserved CPU-tier slot to fetch into."""

    source = HitSource.HOST  # its tokens count as the host tier's here
    load_from = LoadFrom.FETCHED_SLOT
    takes_copies = False

    def __init__(self, directory) -> None:
        self.directory = directory
        self.places: dict[BlockKey, object] = {}
        self.held: set[BlockKey] = set()
        self.fetched_jobs: list[tuple[int, bool]] = []

    def lookup(self, req_id: str, dry: bool = False) -> TierLookup:
        return _DictLookup(self)

    def hold(self, key: BlockKey, where: object) -> Held | None:
        slot = self.directory.reserve(key)
        if slot is None:
            return None
        self.held.add(key)
        return Held(slot)

    def let_go(self, key: BlockKey, held: Held) -> None:
        self.held.discard(key)
        self.directory.abort(key)

    def fetch(self, job: int, req_id: str, key: BlockKey, held: Held, where: object
              ) -> FetchOp:
        return FetchOp(job, req_id, held.slot, key, save_id=int(where))  # type: ignore[call-overload]

    def fetched(self, job: int, key: BlockKey, ok: bool) -> None:
        self.held.discard(key)
        self.fetched_jobs.append((job, ok))
        if ok:
            self.directory.commit(key)
        else:
            self.directory.abort(key)

    def has(self, key: BlockKey) -> bool:
        return False

    def begin_step(self) -> bool | None:
        return None

    def set_layout(self, layout: str) -> None:
        pass

    def finished(self, req_id: str) -> None:
        pass

    def refresh_gauges(self) -> None:
        pass

    def close(self) -> None:
        pass


def _scheduler() -> tuple[TieredScheduler, DictTier]:
    s = TieredScheduler(TieredConfig(), [GroupSpec(0, ATTENTION, UNIT)], UNIT, 16, 16, 1,
                        lambda tenant: FP, lambda rid: [[]], lambda bid: Blk(bid))
    tier = DictTier(s.directory)
    s.chain.insert(0, tier)
    return s, tier


def test_a_tier_of_its_own_serves_a_hit_through_the_interface_only() -> None:
    s, tier = _scheduler()
    req = Req("r", 100)
    keys = [s.key(req, FP, s.groups[0], n) for n in (32, 64, 96)]
    tier.places.update({keys[0]: 11, keys[1]: 12})  # two blocks; the third is nowhere
    assert s.lookup(req, 0) == (64, True)  # not the CPU tier's: an asynchronous load
    assert tier.held == {keys[0], keys[1]}
    s.on_alloc(req, [[Blk(5), Blk(6), Blk(7)]], 64)
    plan = s.plan({}, {}, set())
    assert [(op.key, op.save_id) for op in plan.fetches] == [(keys[0], 11), (keys[1], 12)]
    assert [(op.block_id, op.after_fetch, op.source) for op in plan.loads] == \
        [(5, True, LoadFrom.FETCHED_SLOT), (6, True, LoadFrom.FETCHED_SLOT)]
    assert s.hit_tiers("r") == {HitSource.CPU: 0, HitSource.HOST: 64, HitSource.REDIS: 0}
    assert s.counters.snapshot()["hit_tokens_host"] == 0  # counted once the fetches are back
    s.on_report(WorkerReport(fetches={op.job: [1, 1] for op in plan.fetches}))
    assert sorted(ok for _, ok in tier.fetched_jobs) == [True, True]
    snap = s.counters.snapshot()
    assert snap["hit_tokens_host"] == 64 and snap["hit_requests"] == 1
    assert s.directory.contains_many(keys) == [True, True, False]  # fetched into the CPU tier


def test_a_hit_the_tier_cannot_hold_is_let_go_whole_and_a_repeat_lookup_lets_go() -> None:
    s, tier = _scheduler()
    req = Req("r", 100)
    keys = [s.key(req, FP, s.groups[0], n) for n in (32, 64)]
    tier.places.update(dict.fromkeys(keys, 1))
    assert s.lookup(req, 0) == (64, True)
    assert tier.held == set(keys)
    assert s.lookup(req, 0) == (64, True)  # asked again: the first hold was let go
    assert tier.held == set(keys)
    s.finished("r")  # never allocated: everything let go
    assert tier.held == set()
    assert s.directory.stats()["reserved"] == 0
