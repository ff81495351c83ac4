"""WriteBehind queue logic (pure: an in-memory sink stands in for Redis)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import pytest

from offload_tiers.redis.write_behind import Item, WriteBehind
from tests.tiers.faults import wait_until


def _recording_sink() -> tuple[list[list[str]], Callable[[Sequence[Item]], list[bool]]]:
    """A sink that writes every item and records each batch's keys."""
    batches: list[list[str]] = []

    def sink(batch: Sequence[Item]) -> list[bool]:
        batches.append([i.key for i in batch])
        return [True] * len(batch)
    return batches, sink


def test_bounded_by_count_and_bytes_drops_and_reports() -> None:
    gate = threading.Event()
    written: list[str] = []

    def sink(batch):  # noqa: ANN001, ANN202
        gate.wait(10)
        written.extend(i.key for i in batch)
        return [True] * len(batch)

    wb = WriteBehind(sink, max_items=3, max_bytes=1000, batch_items=1)
    done: dict[str, bool] = {}

    def item(name: str, n: int = 10) -> Item:
        return Item(name, b"x" * n, n, lambda ok, name=name: done.__setitem__(name, ok))

    assert wb.submit(item("a"))
    assert wait_until(lambda: wb.depth == 0, timeout=10)  # the writer took "a", waits on the gate
    assert wb.submit(item("b")) and wb.submit(item("c")) and wb.submit(item("d"))
    assert not wb.submit(item("e"))  # 3 queued: full by count
    assert done["e"] is False and wb.dropped == 1
    gate.set()
    assert wb.flush(10)
    assert written == ["a", "b", "c", "d"] and all(done[k] for k in "abcd")
    gate.clear()
    assert wb.submit(item("f", 600))
    assert wait_until(lambda: wb.depth == 0, timeout=10)  # the writer holds "f"
    assert wb.submit(item("g", 600))  # an empty queue always takes one item
    assert not wb.submit(item("h", 600))  # 600 + 600 > 1000 bytes: dropped
    assert done["h"] is False and wb.dropped == 2
    gate.set()
    assert wb.flush(10) and done["g"]
    wb.close()


def test_failing_sink_reports_false_and_keeps_running() -> None:
    calls = []

    def sink(batch):  # noqa: ANN001, ANN202
        calls.append(len(batch))
        if len(calls) == 1:
            raise RuntimeError("boom")
        return [False] * len(batch)

    wb = WriteBehind(sink, max_items=10, max_bytes=10_000)
    results: list[bool] = []
    wb.submit(Item("a", b"x", 1, results.append))
    assert wb.flush(5)
    wb.submit(Item("b", b"x", 1, results.append))
    assert wb.flush(5)
    assert results == [False, False] and wb.failed == 2 and wb.written == 0
    wb.close()


def test_close_drops_what_it_cannot_write() -> None:
    gate = threading.Event()
    wb = WriteBehind(lambda b: (gate.wait(10), [True] * len(b))[1], max_items=10,
                     max_bytes=10_000, batch_items=1)
    results: list[bool] = []
    for name in "abc":
        wb.submit(Item(name, b"x", 1, results.append))
    wb.close(timeout=0.2)  # the sink is stuck: queued items are dropped, reported False
    assert results.count(False) >= 2
    gate.set()
    assert not wb.submit(Item("z", b"x", 1, results.append))


def test_submit_many_hands_a_steps_items_over_as_one_batch() -> None:
    entered, gate = threading.Event(), threading.Event()
    batches: list[list[str]] = []

    def sink(batch):  # noqa: ANN001, ANN202
        batches.append([i.key for i in batch])
        entered.set()
        gate.wait(10)
        return [True] * len(batch)

    wb = WriteBehind(sink, max_items=4, max_bytes=10_000)
    done: dict[str, bool] = {}

    def item(name: str) -> Item:
        return Item(name, b"x", 1, lambda ok, name=name: done.__setitem__(name, ok))

    assert wb.submit(item("a"))
    assert entered.wait(10)  # the writer holds "a" until the gate opens
    # five at once into a queue of four: the fifth is dropped, reported False at once
    assert wb.submit_many([item(n) for n in "bcdef"]) == [True] * 4 + [False]
    assert done == {"f": False} and wb.dropped == 1 and wb.depth == 4
    gate.set()
    assert wb.flush(10)
    assert batches == [["a"], ["b", "c", "d", "e"]]  # one wake-up took all four
    assert all(done[n] for n in "abcde")
    assert wb.submit_many([]) == []
    wb.close()


def test_a_lingering_writer_takes_later_items_into_the_same_batch() -> None:
    batches, sink = _recording_sink()
    # an hour's linger: only a full batch (3 items), a flush or close ends it
    wb = WriteBehind(sink, max_items=10, max_bytes=10_000, batch_items=3, linger_s=3600)
    for name in "abc":
        assert wb.submit(Item(name, b"x", 1, None))
    assert wb.submit(Item("d", b"x", 1, None))
    assert wb.flush(10)  # "d" alone would linger for an hour: the flush cuts it short
    assert batches == [["a", "b", "c"], ["d"]]
    # woken by "a" (an empty queue), by "c" (a full batch) and by "d": never by "b"
    assert wb.wakeups == 3
    assert wb.submit(Item("e", b"x", 1, None))
    wb.close(timeout=10)  # close flushes first: "e" is written, not dropped
    assert batches[-1] == ["e"] and wb.dropped == 0


def test_a_full_batch_waits_for_its_hand_over_to_settle_and_a_flush_cuts_it_short() -> None:
    """A batch filled by one hand-over (a step's saves) is not written at once: the writer
    waits ``settle_s`` after it (here an hour), so only the flush writes it."""
    batches, sink = _recording_sink()
    wb = WriteBehind(sink, max_items=10, max_bytes=10_000, batch_items=2, linger_s=3600,
                     settle_s=3600)
    assert wb.submit_many([Item(n, b"x", 1, None) for n in "ab"]) == [True, True]
    assert wait_until(lambda: wb.settles == 1, timeout=10)  # woken by the full batch
    assert batches == [] and wb.depth == 2  # settling: nothing taken yet
    assert wb.flush(10)
    assert batches == [["a", "b"]]
    wb.close(timeout=10)


def test_a_burst_is_written_as_paced_batches_and_a_flush_cuts_the_pace_short() -> None:
    """With ``pace_s`` (here an hour) the writer writes one batch of a burst, then waits
    before the next; a flush writes the rest at once."""
    batches, sink = _recording_sink()
    wb = WriteBehind(sink, max_items=100, max_bytes=10_000, batch_items=2, pace_s=3600)
    assert all(wb.submit_many([Item(n, b"x", 1, None) for n in "abcdef"]))
    assert wait_until(lambda: wb.paces == 1, timeout=10)  # spacing the second batch
    assert batches == [["a", "b"]] and wb.depth == 4
    assert wb.flush(10)
    assert batches == [["a", "b"], ["c", "d"], ["e", "f"]]
    wb.close(timeout=10)


def test_a_queue_backing_up_is_written_without_pacing() -> None:
    """At half the queue's bound or more the writer does not wait between batches: pacing
    spreads a burst, it never makes the queue drop saves."""
    batches, sink = _recording_sink()
    wb = WriteBehind(sink, max_items=4, max_bytes=10_000, batch_items=1, pace_s=3600)
    assert all(wb.submit_many([Item(n, b"x", 1, None) for n in "abcd"]))
    # 3 left after "a" and 2 after "b" (>= half of 4): no wait; 1 after "c": paced
    assert wait_until(lambda: wb.paces == 1, timeout=10)
    assert batches == [["a"], ["b"], ["c"]] and wb.depth == 1
    wb.close(timeout=10)


def test_without_settle_a_full_batch_is_written_at_once() -> None:
    written = threading.Event()

    def sink(batch):  # noqa: ANN001, ANN202
        written.set()
        return [True] * len(batch)

    wb = WriteBehind(sink, max_items=10, max_bytes=10_000, batch_items=2, linger_s=3600)
    assert wb.submit_many([Item(n, b"x", 1, None) for n in "ab"]) == [True, True]
    assert written.wait(10) and wb.settles == 0  # no flush asked: the full batch went
    wb.close(timeout=10)


@pytest.mark.parametrize("knob", ["linger_s", "settle_s", "pace_s"])
def test_linger_settle_and_pace_must_not_be_negative(knob: str) -> None:
    with pytest.raises(ValueError, match=knob):
        WriteBehind(lambda b: [True] * len(b), max_items=1, max_bytes=1, **{knob: -1})


def test_the_writer_thread_is_named_at_the_os_level() -> None:
    """``top -H`` and ``/proc`` tell the writer apart from the worker's other threads."""
    seen: list[str] = []

    def sink(batch):  # noqa: ANN001, ANN202
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as comm:
            seen.append(comm.read().strip())
        return [True] * len(batch)

    wb = WriteBehind(sink, max_items=4, max_bytes=1000, name="kvtier-redis-writer")
    assert wb.submit(Item("a", b"x", 1, None))
    assert wb.flush(10)
    wb.close(timeout=10)
    assert seen == ["kvtier-redis-wr"]  # Linux keeps 15 bytes
