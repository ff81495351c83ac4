"""Backfill: CPU-tier entries that never reached Redis, written once it answers again.

A save planned while this engine's Redis is down goes to the CPU tier only, and a write that
fails leaves its entry there too. Without a backfill such an entry reaches Redis only if it is
recomputed after leaving the CPU tier: other engines, and this engine after a restart, miss it.

The scheduler notes each such key here. Once every rank reports Redis up, a step plans at
most one writer batch of them, and the next batch only once every rank answered the last one
(paced by the writers themselves, never by a clock). A key noted in a step is not taken in
that step: its slot is filled after that step's forward, and the workers read it from the
next step on. Each entry is tried once; a failed backfill is counted, not retried.
"""

from __future__ import annotations

from collections import OrderedDict

from offload_tiers.keys import BlockKey

#: Backfill writes out at once, at most (one batch of the Redis writer).
BATCH = 32


class Backfill:
    """The keys to write to Redis later (oldest first, bounded) and the batch that is out."""

    def __init__(self, capacity: int, batch: int = BATCH) -> None:
        if capacity < 1 or batch < 1:
            raise ValueError("capacity and batch must be at least 1")
        self.capacity = capacity
        self.batch = batch
        self.out = 0  # backfill writes planned and not yet answered by every rank
        self._queue: OrderedDict[BlockKey, None] = OrderedDict()
        self._noted_now: list[BlockKey] = []

    def __len__(self) -> int:
        return len(self._queue) + len(self._noted_now)

    def note(self, key: BlockKey) -> None:
        """``key``'s entry is in the CPU tier (or will be, after this step) but not in Redis."""
        self._noted_now.append(key)

    def take(self, redis_up: bool) -> list[BlockKey]:
        """The keys to write in this step: none while Redis is down or a batch is out. Keys
        noted in this step wait for the next one. The caller plans them and says how many
        with :meth:`sent`."""
        taken: list[BlockKey] = []
        if redis_up and not self.out:
            while self._queue and len(taken) < self.batch:
                taken.append(self._queue.popitem(last=False)[0])
        for key in self._noted_now:
            self._queue[key] = None
            self._queue.move_to_end(key)
        self._noted_now.clear()
        while len(self._queue) > self.capacity:  # oldest first: likely evicted already
            self._queue.popitem(last=False)
        return taken

    def clear(self) -> None:
        """Forget every key (the CPU tier was emptied); a batch that is out stays out."""
        self._queue.clear()
        self._noted_now.clear()

    def sent(self, n: int) -> None:
        """``n`` of the taken keys were planned (the others had left the CPU tier)."""
        self.out += n

    def answered(self) -> None:
        """Every rank answered one backfill write (written or not)."""
        self.out = max(self.out - 1, 0)
