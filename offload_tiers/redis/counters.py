"""A Redis tier's event counts: one lock, and a serial that moves with the events.

Both layers of the tier count here (:mod:`~offload_tiers.redis.channel`: outages, recoveries,
skipped commands; :mod:`~offload_tiers.redis.tier`: reads, writes, bad values), so a caller
reads one snapshot of them all. The serial moves by every increment of an *event* count, so
a caller mirroring the counts reads them only when it moved.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

__all__ = ["Counters"]


class Counters:
    """Named counts, starting at 0; ``serial`` = the sum of the ``events`` counts so far."""

    __slots__ = ("_n", "_events", "_lock", "serial")

    def __init__(self, names: Sequence[str], events: Sequence[str]) -> None:
        self._n = dict.fromkeys(names, 0)
        self._events = frozenset(events)
        self._lock = threading.Lock()
        self.serial = 0

    def add(self, **deltas: int) -> None:
        """Add each delta to its count (a name not given at construction is a KeyError)."""
        with self._lock:
            for name, n in deltas.items():
                self._n[name] += n
                if name in self._events:
                    self.serial += n

    def snapshot(self) -> dict[str, int]:
        """Every count, in the order the names were given."""
        with self._lock:
            return dict(self._n)
