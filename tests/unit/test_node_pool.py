"""NodePool: the Redis Cluster fan-out's threads (pure logic, real threads)."""

from __future__ import annotations

import threading

import pytest

from offload_tiers.redis.node_pool import NodePool


def test_map_runs_items_at_once_and_keeps_their_order() -> None:
    pool = NodePool(3)
    try:
        barrier = threading.Barrier(3)  # only passes if three items run at the same time

        def job(i: int) -> int:
            barrier.wait(timeout=60)
            return i * i

        assert pool.map(job, [1, 2, 3]) == [1, 4, 9]
    finally:
        pool.close()


def test_an_exception_reaches_the_caller_after_every_item_finished() -> None:
    pool = NodePool(2)
    done: list[int] = []

    def job(i: int) -> int:
        if i == 0:
            raise KeyError("node 0")
        done.append(i)
        return i

    try:
        with pytest.raises(KeyError, match="node 0"):
            pool.map(job, [0, 1, 2])
        assert sorted(done) == [1, 2]
    finally:
        pool.close()


def test_a_closed_pool_runs_items_in_the_caller() -> None:
    pool = NodePool(1)
    pool.close()
    caller = threading.current_thread()
    assert pool.map(lambda i: (i, threading.current_thread() is caller), [5]) == [(5, True)]
