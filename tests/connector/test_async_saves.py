"""Saves off the step (CPU): the worker's step returns before its blocks are copied, and
nothing of the next step can run before they are (``fence``)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from connector.vllm_connector.config import TieredConfig
from connector.vllm_connector.plan import StepPlan
from connector.vllm_connector.remote_store import OwnRedis
from rigs.halves import BS, Halves, as_bytes
from rigs.sched_doubles import Blk, Req


def _gated(e: Halves) -> tuple[threading.Event, threading.Event, list[threading.Thread]]:
    """Rank 0's gathers say ``entered`` and the thread they run on; off the main thread they
    wait for ``gate`` (a copy held mid-flight). On the main thread (a copy inside the step)
    they run at once, so a regression fails the test instead of hanging it."""
    worker = e.ranks[0].worker
    assert worker.transfer is not None
    gather = worker.transfer.gather
    gate, entered = threading.Event(), threading.Event()
    threads: list[threading.Thread] = []

    def held(*args: Any, **kwargs: Any) -> int:
        threads.append(threading.current_thread())
        entered.set()
        if threading.current_thread() is not threading.main_thread():
            gate.wait()
        return gather(*args, **kwargs)

    worker.transfer.gather = held  # type: ignore[method-assign]
    return gate, entered, threads


def test_the_step_returns_before_its_saves_are_copied_and_the_next_one_waits() -> None:
    e = Halves(TieredConfig(cpu_bytes=1 << 20))
    gate, entered, threads = _gated(e)
    try:
        worker = e.ranks[0].worker
        e.fill([1, 2], seed=5)
        e.admit(Req("a", 70), [[Blk(1, BS), Blk(2, 2 * BS)]], 0)
        plan = e.plan({"a": 2 * BS})
        assert len(plan.saves) == 2
        worker.start_step(plan)
        worker.save(plan)  # returns while the copy is held: the step does not wait for it
        entered.wait()
        assert threads[0] is not threading.main_thread()  # copied off the step
        assert not worker.take_report().saves  # nothing copied yet, nothing reported
        assert all(worker.slot_keys[op.slot] is None for op in plan.saves)
        gate.set()
        worker.start_step(StepPlan())  # the next step: its loads run after the copies
        report = worker.take_report()
        assert {job: counts[0] for job, counts in report.saves.items()} == \
            {op.job: 1 for op in plan.saves}
        for op in plan.saves:
            assert worker.slot_keys[op.slot] == op.key
            block = as_bytes(e.ranks[0].kv["attn0"][op.block_id])
            assert bytes(np.asarray(worker.slab[op.slot, :len(block)])) == block
    finally:
        gate.set()  # a failed assertion must not leave the saver held
        e.close()


def test_inside_the_step_when_async_saves_is_off() -> None:
    e = Halves(TieredConfig(cpu_bytes=1 << 20, async_saves=False))
    try:
        worker = e.ranks[0].worker
        e.fill([1], seed=6)
        e.admit(Req("a", 40), [[Blk(1, BS)]], 0)
        plan = e.plan({"a": BS})
        worker.start_step(plan)
        worker.save(plan)
        report = worker.take_report()  # reported at once: the copy ran inside save()
        assert [counts[0] for counts in report.saves.values()] == [1]
        assert worker.slot_keys[plan.saves[0].slot] == plan.saves[0].key
    finally:
        e.close()


def test_a_failed_copy_off_the_step_is_reported_and_untrusted() -> None:
    e = Halves(TieredConfig(cpu_bytes=1 << 20))
    try:
        worker = e.ranks[0].worker
        assert worker.transfer is not None

        def broken(*args: Any, **kwargs: Any) -> int:
            raise RuntimeError("copy failed")

        worker.transfer.gather = broken  # type: ignore[method-assign]
        e.fill([1], seed=7)
        e.admit(Req("a", 40), [[Blk(1, BS)]], 0)
        result = e.step({"a": BS})
        [op] = result.plan.saves
        assert result.report.saves[op.job] == [0, 1, 1]  # not copied: its slot is not trusted
        assert not e.sched.directory.contains(op.key)
        assert worker.slot_keys[op.slot] is None
    finally:
        e.close()


@pytest.mark.parametrize(("mode", "fence_waits_for_redis"), [("back", False), ("through", True)])
def test_the_next_step_waits_for_the_blocks_read_not_for_the_redis_hand_off(
        redis_url: str, key_prefix: str, mode: str, fence_waits_for_redis: bool) -> None:
    """The fence is released once the saver has read its blocks into their slots; the
    hand-off to Redis runs on (slots stay pinned until written). With ``write_mode:
    through`` the fence also waits for the write, as documented."""
    e = Halves(TieredConfig(cpu_bytes=1 << 20, redis_url=redis_url, redis_prefix=key_prefix,
                            write_mode=mode))
    gate, handing = threading.Event(), threading.Event()
    try:
        worker = e.ranks[0].worker
        assert isinstance(worker.redis, OwnRedis)
        hand_off = "put_many" if mode == "through" else "submit_puts"
        real = getattr(worker.redis.tier, hand_off)

        def held(*args: Any, **kwargs: Any) -> Any:
            handing.set()
            if threading.current_thread() is not threading.main_thread():
                gate.wait()
            return real(*args, **kwargs)

        setattr(worker.redis.tier, hand_off, held)
        e.fill([1, 2], seed=8)
        e.admit(Req("a", 70), [[Blk(1, BS), Blk(2, 2 * BS)]], 0)
        plan = e.plan({"a": 2 * BS})
        assert [op.to_redis for op in plan.saves] == [True, True]
        worker.start_step(plan)
        worker.save(plan)
        handing.wait()  # the saver has read its blocks and hands them to Redis
        assert worker._gathered is not None
        assert worker._gathered.is_set() is not fence_waits_for_redis
        gate.set()
        worker.start_step(StepPlan())
        for op in plan.saves:
            block = as_bytes(e.ranks[0].kv["attn0"][op.block_id])
            assert bytes(np.asarray(worker.slab[op.slot, :len(block)])) == block
        assert worker.flush_redis(10.0)
        assert worker.redis.tier.counts()["puts"] == 2
    finally:
        gate.set()
        e.close()


def test_a_step_that_waits_for_the_copies_counts_the_wait_and_one_that_does_not_counts_none(
        ) -> None:
    """``save_fence_waits`` / ``save_fence_wait_us``: the time a step spends on the previous
    step's copies (issue 50's per-step accounting). A fence that finds them done counts
    nothing; one that finds them held counts one wait."""
    from tests.tiers.faults import wait_until

    e = Halves(TieredConfig(cpu_bytes=1 << 20))
    gate, entered, _ = _gated(e)
    try:
        worker = e.ranks[0].worker
        e.fill([1, 2, 3, 4], seed=6)
        e.admit(Req("a", 70), [[Blk(1, BS), Blk(2, 2 * BS)]], 0)
        plan = e.plan({"a": 2 * BS})
        worker.start_step(plan)
        worker.save(plan)
        gate.set()
        gathered = worker._gathered
        assert gathered is not None and gathered.wait(60)  # copied before the fence
        worker.fence()
        counts = worker.counters.snapshot()
        assert counts["save_fence_waits"] == counts["save_fence_wait_us"] == 0

        gate.clear()
        entered.clear()
        other = Req("b", 70)
        other.block_hashes = [b"b0", b"b1"]  # blocks nobody saved yet
        e.admit(other, [[Blk(3, BS), Blk(4, 2 * BS)]], 0)
        plan = e.plan({"b": 2 * BS})
        assert len(plan.saves) == 2
        worker.start_step(plan)
        worker.save(plan)
        assert entered.wait(60)  # the copy is held mid-flight
        fence = threading.Thread(target=worker.fence)
        fence.start()
        assert wait_until(lambda: worker._gathered is None)  # past its check: it waits
        gate.set()
        fence.join(60)
        assert not fence.is_alive()
        counts = worker.counters.snapshot()
        assert counts["save_fence_waits"] == 1 and counts["save_fence_wait_us"] > 0
    finally:
        gate.set()
        e.close()
