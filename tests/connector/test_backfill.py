"""The backfill's book-keeping (pure logic): which keys a step may write to Redis, and when."""

from __future__ import annotations

import pytest

from connector.vllm_connector.backfill import Backfill
from offload_tiers.keys import BlockKey, BlockKind


def key(i: int) -> BlockKey:
    return BlockKey("fp", 0, i.to_bytes(8, "big"), 16 * (i + 1), BlockKind.FULL)


def test_a_key_noted_in_a_step_waits_for_the_next_one() -> None:
    b = Backfill(capacity=8)
    b.note(key(1))
    assert b.take(redis_up=True) == []  # its slot is filled after this step's forward
    assert b.take(redis_up=True) == [key(1)]
    assert len(b) == 0


def test_nothing_is_taken_while_redis_is_down_and_nothing_is_lost() -> None:
    b = Backfill(capacity=8)
    for i in range(3):
        b.note(key(i))
    assert b.take(redis_up=False) == [] and b.take(redis_up=False) == []
    assert len(b) == 3
    assert b.take(redis_up=True) == [key(0), key(1), key(2)]


def test_one_batch_out_at_a_time() -> None:
    b = Backfill(capacity=100, batch=4)
    for i in range(10):
        b.note(key(i))
    b.take(redis_up=True)
    first = b.take(redis_up=True)
    assert first == [key(i) for i in range(4)]
    b.sent(4)
    assert b.take(redis_up=True) == []  # the batch is out
    for _ in range(3):
        b.answered()
    assert b.take(redis_up=True) == []  # one write still unanswered
    b.answered()
    assert b.take(redis_up=True) == [key(i) for i in range(4, 8)]


def test_keys_planned_fewer_than_taken_do_not_hold_the_next_batch() -> None:
    b = Backfill(capacity=100, batch=4)
    for i in range(6):
        b.note(key(i))
    b.take(redis_up=True)
    assert len(b.take(redis_up=True)) == 4
    b.sent(0)  # every one had left the CPU tier: nothing is out
    assert b.take(redis_up=True) == [key(4), key(5)]


def test_the_oldest_keys_go_beyond_capacity() -> None:
    b = Backfill(capacity=3)
    for i in range(5):
        b.note(key(i))
    b.take(redis_up=False)
    assert len(b) == 3
    assert b.take(redis_up=True) == [key(2), key(3), key(4)]


def test_a_key_noted_twice_is_taken_once() -> None:
    b = Backfill(capacity=8)
    b.note(key(1))
    b.note(key(2))
    b.note(key(1))
    b.take(redis_up=False)
    assert b.take(redis_up=True) == [key(2), key(1)]


def test_clear_forgets_the_keys_but_not_the_batch_that_is_out() -> None:
    b = Backfill(capacity=8, batch=1)
    b.note(key(1))
    b.note(key(2))
    b.take(redis_up=False)
    assert b.take(redis_up=True) == [key(1)]
    b.sent(1)
    b.note(key(3))
    b.clear()
    assert len(b) == 0
    b.note(key(4))
    assert b.take(redis_up=True) == []  # key(1) is still out
    b.answered()
    assert b.take(redis_up=True) == [key(4)]


@pytest.mark.parametrize(("capacity", "batch"), [(0, 1), (1, 0)])
def test_bad_sizes_are_refused(capacity: int, batch: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Backfill(capacity, batch)
