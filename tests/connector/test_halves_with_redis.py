"""Scheduler and worker halves together on CPU tensors, with the real Redis.

Two "engines" (two runtimes, one Redis prefix): the first saves blocks, the second restores
them from Redis into different block ids; corrupt and foreign values are misses.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
import torch

from connector.connector_config import TieredConfig
from connector.scheduler_side import ATTENTION, GroupSpec, TieredScheduler
from connector.worker_side import TieredWorker, TierRuntime
from offload_tiers.keys import BlockKind
from tests.support.sched_doubles import Blk, Req

BS = 32
NB = 16
GROUPS = [GroupSpec(0, ATTENTION, BS)]


class Engine:
    """One engine's two halves over a CPU KV tensor ``[blocks, heads, bs, 2*dim]``."""

    def __init__(self, redis_url: str, prefix: str, **cfg: Any) -> None:
        self.kv = torch.zeros(NB, 2, BS, 8)
        self.rt = TierRuntime(TieredConfig(cpu_bytes=1 << 20, redis_url=redis_url,
                                           redis_prefix=prefix, **cfg))
        self.worker = TieredWorker(self.rt)
        self.worker.register({"attn": self.kv}, [(0, ATTENTION, BS, ["attn"])], NB)
        self.blocks: dict[str, list[list[Blk]]] = {}
        self.sched = TieredScheduler(self.rt, GROUPS, BS, lambda t: "cd" * 16,
                                     lambda rid: self.blocks[rid], lambda bid: Blk(bid))

    def step(self, computed_after: dict[str, int]) -> None:
        plan = self.sched.plan(computed_after, {}, set())
        self.worker.load(plan)
        self.worker.save(plan)
        if self.rt.redis is not None:
            self.rt.redis.flush(5)

    def close(self) -> None:
        self.rt.close()


@pytest.fixture
def engines(redis_url: str, key_prefix: str) -> Any:
    made: list[Engine] = []

    def make(**cfg: Any) -> Engine:
        made.append(Engine(redis_url, key_prefix, **cfg))
        return made[-1]

    yield make
    for e in made:
        e.close()


@pytest.mark.parametrize("write_mode", ["through", "back"])
def test_second_engine_restores_from_redis(engines: Any, write_mode: str) -> None:
    first = engines(write_mode=write_mode)
    req = Req("a", 100)
    first.kv[1:4].normal_()
    first.blocks["a"] = [[Blk(1, 32), Blk(2, 64), Blk(3, 96)]]
    first.sched.on_alloc(req, first.blocks["a"], 0)
    first.step({"a": 100})
    assert first.rt.counters.snapshot()["blocks_written_redis"] == 3
    stored = [c for c in first.rt.outbox if c.stored]
    assert {c.medium for c in stored} == {"CPU", "STORAGE"}

    second = engines(write_mode=write_mode)
    again = Req("b", 100)
    assert second.sched.lookup(again, 0) == 96
    second.blocks["b"] = [[Blk(7), Blk(8), Blk(9), Blk(10)]]
    second.sched.on_alloc(again, second.blocks["b"], 96)
    second.step({})
    assert torch.equal(second.kv[7:10], first.kv[1:4])
    snap = second.rt.counters.snapshot()
    assert snap["hit_tokens_redis"] == 96 and snap["blocks_loaded_redis"] == 3
    assert second.rt.cpu is not None and second.rt.cpu.stats()["pinned"] == 0
    assert len(second.rt.cpu) == 3  # promoted into the CPU tier on the way


@pytest.mark.parametrize("damage", ["flip", "foreign", "truncate"])
def test_bad_redis_values_are_misses(engines: Any, redis_url: str, key_prefix: str,
                                     damage: str) -> None:
    first = engines()
    req = Req("a", 100)
    first.kv[1:3].normal_()
    first.blocks["a"] = [[Blk(1, 32), Blk(2, 64)]]
    first.sched.on_alloc(req, first.blocks["a"], 0)
    first.step({"a": 64})
    client = redis.Redis.from_url(redis_url)
    names = sorted(client.scan_iter(match=f"{key_prefix}:*"))
    assert len(names) == 2
    second_block = next(n for n in names if n.endswith(b"h1".hex().encode()))
    first_block = next(n for n in names if n != second_block)
    value = client.get(second_block)
    assert value is not None
    if damage == "flip":
        data = bytearray(value)
        data[-5] ^= 0x01
        client.set(second_block, bytes(data))
    elif damage == "foreign":
        client.set(second_block, client.get(first_block))
    else:
        client.set(second_block, value[: len(value) // 2])
    second = engines()
    # Only the first block is still valid: the hit stops there, nothing wrong is served.
    assert second.sched.lookup(Req("b", 100), 0) == 32


def test_redis_down_serves_cpu_and_counts(engines: Any) -> None:
    e = engines()
    e.rt.redis.close()  # a closed tier behaves as unavailable: every write is dropped
    req = Req("a", 70)
    e.blocks["a"] = [[Blk(1, 32), Blk(2, 64)]]
    e.sched.on_alloc(req, e.blocks["a"], 0)
    e.step({"a": 64})
    snap = e.rt.counters.snapshot()
    assert snap["blocks_saved"] == 2
    assert snap["blocks_written_redis"] == 0
    assert snap["store_drops"] == 2 and snap["redis_write_failures"] == 2


def test_promotion_drops_the_partial_everywhere(engines: Any) -> None:
    e = engines()
    e.sched.groups = [GroupSpec(0, ATTENTION, 64)]
    e.sched.attention = e.sched.groups
    e.sched.hash_unit = 32
    req = Req("a", 200)
    e.blocks["a"] = [[Blk(1, 32)]]
    e.sched.on_alloc(req, e.blocks["a"], 0)
    e.step({"a": 32})
    assert e.rt.cpu is not None
    assert [k.kind for k in e.rt.cpu.keys()] == [BlockKind.PARTIAL]
    e.blocks["a"][0][0] = Blk(1, 64)
    e.step({"a": 64})
    assert [k.kind for k in e.rt.cpu.keys()] == [BlockKind.FULL]
    removed = [c for c in e.rt.outbox if not c.stored]
    assert {c.medium for c in removed} == {"CPU", "STORAGE"}


def test_close_frees_the_slab_and_keeps_stats(engines: Any) -> None:
    e = engines()
    req = Req("a", 70)
    e.blocks["a"] = [[Blk(1, 32), Blk(2, 64)]]
    e.sched.on_alloc(req, e.blocks["a"], 0)
    e.step({"a": 64})
    e.rt.close()
    e.rt.close()  # idempotent
    assert e.rt.cpu is None and e.worker.transfer is None
    stats = e.rt.stats()
    assert stats["blocks_saved"] == 2 and stats["cpu_tier"]["entries"] == 2
    assert e.sched.lookup(Req("b", 70), 0) == 0  # closed: no hits, no crash


def test_one_step_saving_more_blocks_than_cpu_slots_loses_none(redis_url: str,
                                                               key_prefix: str) -> None:
    """A batched prefill saves 20 blocks into a 16-slot CPU tier in one step.

    Reserved slots cannot be evicted before they are committed, so the saves go in chunks.
    Before the fix every block past the 16th reservation was dropped — from Redis too.
    """
    nb, bs = 24, BS
    kv = torch.zeros(nb, 2, bs, 256)  # slot = 2*32*256*4 = 64 KiB: 16 slots in 1 MiB
    kv.normal_()
    rt = TierRuntime(TieredConfig(cpu_bytes=1 << 20, redis_url=redis_url,
                                  redis_prefix=key_prefix))
    try:
        worker = TieredWorker(rt)
        worker.register({"attn": kv}, [(0, ATTENTION, bs, ["attn"])], nb)
        assert rt.cpu is not None and rt.cpu.num_slots == 16
        blocks = {"a": [[Blk(i, (i + 1) * bs) for i in range(20)]]}
        sched = TieredScheduler(rt, GROUPS, bs, lambda t: "cd" * 16,
                                lambda rid: blocks[rid], lambda bid: Blk(bid))
        sched.on_alloc(Req("a", 20 * bs + 5), blocks["a"], 0)
        plan = sched.plan({"a": 20 * bs + 5}, {}, set())
        worker.load(plan)
        worker.save(plan)
        snap = rt.counters.snapshot()
        assert snap["blocks_saved"] == 20 and snap["store_drops"] == 0
        assert snap["blocks_written_redis"] == 20
        stats = rt.cpu.stats()
        assert stats["entries"] == 16 and stats["evictions"] == 4
        assert stats["reserved"] == 0 and stats["pinned"] == 0
    finally:
        rt.close()


def test_restore_into_a_cpu_tier_full_of_pins_takes_what_fits(redis_url: str,
                                                              key_prefix: str) -> None:
    """14 of 16 CPU slots pinned by other requests' loads; a 4-block hit sits in Redis.

    The 2 free slots restore the first 2 blocks (64 tokens). Before the fix the 4 fetched
    values evicted each other, the pins failed on all 3 attempts and the hit was 0.
    """
    from offload_tiers.keys import BlockKey

    nb, bs = 24, BS

    def runtime() -> tuple[TierRuntime, TieredScheduler, dict[str, Any], torch.Tensor]:
        kv = torch.zeros(nb, 2, bs, 256)  # 64 KiB slots: 16 in 1 MiB
        rt = TierRuntime(TieredConfig(cpu_bytes=1 << 20, redis_url=redis_url,
                                      redis_prefix=key_prefix))
        worker = TieredWorker(rt)
        worker.register({"attn": kv}, [(0, ATTENTION, bs, ["attn"])], nb)
        blocks: dict[str, Any] = {}
        sched = TieredScheduler(rt, GROUPS, bs, lambda t: "cd" * 16,
                                lambda rid: blocks[rid], lambda bid: Blk(bid))
        return rt, sched, {"worker": worker, "blocks": blocks}, kv

    first, sched1, parts1, kv1 = runtime()
    second, sched2, _, _ = runtime()
    try:
        kv1.normal_()
        parts1["blocks"]["a"] = [[Blk(i, (i + 1) * bs) for i in range(4)]]
        sched1.on_alloc(Req("a", 4 * bs + 5), parts1["blocks"]["a"], 0)
        plan = sched1.plan({"a": 4 * bs + 5}, {}, set())
        parts1["worker"].save(plan)
        assert first.counters.snapshot()["blocks_written_redis"] == 4
        cpu = second.cpu
        assert cpu is not None and cpu.num_slots == 16
        filler = bytes(cpu.slot_bytes)
        for i in range(14):  # other requests' in-flight loads
            key = BlockKey("ef" * 16, 0, i.to_bytes(8, "big"), bs, BlockKind.FULL)
            assert cpu.put(key, filler) and cpu.acquire(key) is not None
        assert sched2.lookup(Req("b", 4 * bs + 5), 0) == 2 * bs
        stats = cpu.stats()
        assert stats["pinned"] == 14 + 2 and stats["evictions"] == 0
    finally:
        first.close()
        second.close()
