"""A bounded write-behind queue drained by one background thread.

``submit`` never blocks: when the queue is full (by count or bytes) the item is dropped,
counted, and its ``on_done(False)`` runs at once. The thread hands batches to ``sink``,
which returns one success flag per item, and runs ``tick`` (health probes) between batches.

``linger_s``: once woken by a first item, the thread waits up to that long (or until a
batch is full, a flush asks, or it is closed) before it takes the batch. In vLLM's worker
this keeps the writer's Python work, and its turns at the GIL, out of the tail of the step
that handed the saves over (sampling, the step's output), and several steps' saves share
one batch. A submit wakes the thread only when the queue was empty or a batch is full.

``settle_s``: the thread takes a batch no sooner than that long after the latest hand-over
(at most that much later than the linger alone would): a batch filled by a step's saves is
not written in that step's tail either. Ad hoc, 2026-12-05, llama no-hit requests one at
a time (a prefill filled a batch of 32 every 2-3 requests, in its tail), TTFT median over
128 requests, engines taking turns: 200 ms linger without settle 11.0 and 9.8 ms in two
runs, CPU tier alone 8.9 and 9.2 ms; with a 5 ms settle 8.7 ms (second run). A flush or
close cuts both short.

``pace_s``: after a batch, with more queued (less than half the queue's bound: a queue
backing up is written at full speed), the thread waits that long before the next, so a
burst (a long prompt's saves) is written as several small batches spread over as many
steps instead of one that lands inside a step. In vLLM's worker the writer's Python work
and its GIL hand-offs come out of the forward it overlaps. A trade, measured beside a
thread of small torch calls (``python -m benchmarks.bench_step_gil``, two runs of
2026-12-07): 32 values of 32 KiB as one batch raised the calls' p99 1.66x and 1.27x and
cost them 3.0 and 0.8 ms per burst; as 4 batches of 8, 3 ms apart, 1.42x and 1.09x, but
4.2 and 1.6 ms. A flush or close cuts it short.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from offload_tiers.thread_names import name_current_thread
from offload_tiers.thread_priority import lower_current_thread

log = logging.getLogger(__name__)

DoneCallback = Callable[[bool], None]


@dataclass(slots=True)
class Item:
    key: Any
    payload: Any
    nbytes: int
    on_done: DoneCallback | None
    save_id: int = 0  # carried to the sink (the stored header's save id)


def _notify(item: Item, ok: bool) -> None:
    if item.on_done is not None:
        try:
            item.on_done(ok)
        except Exception:
            log.exception("write-behind on_done callback failed")


class WriteBehind:
    """One thread, one bounded queue; drops rather than stalls."""

    def __init__(self, sink: Callable[[Sequence[Item]], list[bool]], *, max_items: int,
                 max_bytes: int, batch_items: int = 32, batch_bytes: int = 32 << 20,
                 tick: Callable[[], None] | None = None, tick_interval_s: float = 0.1,
                 linger_s: float = 0.0, settle_s: float = 0.0, pace_s: float = 0.0,
                 name: str = "kvtier-write-behind") -> None:
        for knob, value in (("linger_s", linger_s), ("settle_s", settle_s),
                            ("pace_s", pace_s)):
            if value < 0:
                raise ValueError(f"{knob} must be >= 0, got {value}")
        if batch_items < 1:
            raise ValueError(f"batch_items must be >= 1, got {batch_items}")
        self._sink = sink
        self._linger_s = linger_s
        self._settle_s = settle_s
        self._last_submit = 0.0  # time.monotonic() of the latest hand-over
        self.settles = 0  # times the writer waited for a hand-over to settle
        self._pace_s = pace_s
        self._paced_until = 0.0  # time.monotonic() before which the next batch waits
        self.paces = 0  # times the writer spaced a batch from the one before
        self.unwritten_at_close = 0  # queued items close() dropped when its bound passed
        self._flushing = 0  # flush() calls waiting: the writer does not linger meanwhile
        self._tick = tick
        self._tick_interval = tick_interval_s
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._batch_items = batch_items
        self._batch_bytes = batch_bytes
        self._q: deque[Item] = deque()
        self._bytes = 0
        self._busy = 0
        self._cond = threading.Condition()
        self._closed = False
        self.submitted = 0
        self.dropped = 0
        self.written = 0
        self.failed = 0
        self.wakeups = 0  # times a submit woke the thread
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: Item) -> bool:
        return self.submit_many([item])[0]

    def submit_many(self, items: Sequence[Item]) -> list[bool]:
        """Queue ``items`` in order under one lock and wake the thread once (a step's saves
        cost the writer one wake-up, not one per item); per item, False = dropped."""
        accepted: list[bool] = []
        with self._cond:
            was_empty = not self._q
            if self._settle_s:
                self._last_submit = time.monotonic()
            for item in items:
                ok = not (self._closed or len(self._q) >= self.max_items
                          or (self._q and self._bytes + item.nbytes > self.max_bytes))
                if ok:
                    self._q.append(item)
                    self._bytes += item.nbytes
                    self.submitted += 1
                else:
                    self.dropped += 1
                accepted.append(ok)
            # The thread waits idle only on an empty queue, and lingers until a batch is
            # full: any other wake-up would only take the GIL to wait again.
            if any(accepted) and (was_empty or self._full()):
                self._cond.notify()
                self.wakeups += 1
        for item, ok in zip(items, accepted, strict=True):
            if not ok:
                _notify(item, False)
        return accepted

    @property
    def depth(self) -> int:
        return len(self._q)

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far was written or failed; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()  # a lingering writer takes its batch now
            try:
                while self._q or self._busy:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    self._cond.wait(remaining if remaining is not None else 0.1)
                return True
            finally:
                self._flushing -= 1

    def close(self, timeout: float = 5.0) -> int:
        """Write what is queued (up to ``timeout``), drop the rest, stop the thread; the
        number of items not written for want of time (dropped, counted in ``dropped`` and
        ``unwritten_at_close``; a batch still out when the bound passed is not among them:
        its writes end as the server answers)."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            rest = list(self._q)
            self._q.clear()
            self._bytes = 0
            self.dropped += len(rest)
            self.unwritten_at_close += len(rest)
            self._cond.notify_all()
        for item in rest:
            _notify(item, False)
        self._thread.join(timeout)
        return len(rest)

    def _take(self) -> list[Item]:
        batch: list[Item] = []
        size = 0
        while (self._q and len(batch) < self._batch_items
               and (not batch or size < self._batch_bytes)):
            item = self._q.popleft()
            self._bytes -= item.nbytes
            size += item.nbytes
            batch.append(item)
        return batch

    def _full(self) -> bool:
        return len(self._q) >= self._batch_items or self._bytes >= self._batch_bytes

    def _wait_until(self, deadline: float, until_full: bool) -> None:
        """Wait (holding the condition) until ``deadline``; cut short by a flush or close,
        and with ``until_full`` by a full batch."""
        while not (self._closed or self._flushing or (until_full and self._full())):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._cond.wait(remaining)

    def _run(self) -> None:
        name_current_thread()
        lower_current_thread()
        next_tick = 0.0
        while True:
            with self._cond:
                if self._closed:
                    return
                if not self._q:
                    self._cond.wait(self._tick_interval)
                if self._q and time.monotonic() < self._paced_until:
                    self.paces += 1  # the batch before was written just now: spread them
                    self._wait_until(self._paced_until, until_full=False)
                if self._q and self._linger_s:  # gather more saves
                    self._wait_until(time.monotonic() + self._linger_s, until_full=True)
                settled = self._last_submit + self._settle_s
                if self._q and self._settle_s and time.monotonic() < settled:
                    self.settles += 1  # past the tail of the step that handed them over
                    self._wait_until(settled, until_full=False)
                batch = self._take()
                self._busy = len(batch)
            now = time.monotonic()
            if self._tick is not None and now >= next_tick:
                next_tick = now + self._tick_interval
                try:
                    self._tick()
                except Exception:
                    log.exception("write-behind tick failed")
            if batch:
                try:
                    results = self._sink(batch)
                except Exception:
                    log.exception("write-behind sink failed")
                    results = [False] * len(batch)
                for item, ok in zip(batch, results, strict=True):
                    _notify(item, ok)
                ok_count = sum(results)
                with self._cond:
                    self.written += ok_count
                    self.failed += len(batch) - ok_count
                    self._busy = 0
                    backing_up = len(self._q) * 2 >= self.max_items
                    self._paced_until = (time.monotonic() + self._pace_s
                                         if self._pace_s and not backing_up else 0.0)
                    self._cond.notify_all()
            else:
                with self._cond:
                    self._busy = 0
                    self._cond.notify_all()
