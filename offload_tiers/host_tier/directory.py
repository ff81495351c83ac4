"""The owner's bookkeeping of the host tier: which slot holds which key, who may write where.

One process (the daemon) owns a :class:`HostDirectory`; clients never write it. Life of
a slot::

    free -> leased to a client (lease)          the client writes it (SharedSegment
         -> committed entry (commit)            begin_write/commit_write), then says so
         -> evicted: invalidated, then freed    once no client pins it (else draining)

A commit is accepted only for a slot leased to that client whose header holds exactly the
committed save; a second save of a key that already has an entry is dropped (its slot
invalidated and freed): two engines storing one prefix occupy one set of slots. A client
that goes away loses its leases (invalidated: a half-written slot is never served) and
its pins. Every change to the entries is queued in ``events`` for the subscribers'
mirrors, in order.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import asdict, dataclass

from offload_tiers.host_tier.pins import PinTable
from offload_tiers.shared_segment import SharedSegment


@dataclass(frozen=True, slots=True)
class Location:
    """Where a committed save lives: what a reader passes to ``SharedSegment.read_into``."""

    slot: int
    save_id: int
    length: int


@dataclass(slots=True)
class DirectoryCounters:
    leased: int = 0
    lease_shortfall: int = 0  # slots asked for and not granted (all pinned or leased)
    commits: int = 0
    duplicates_dropped: int = 0
    commits_rejected: int = 0  # slot not leased to the client or header not that save
    evictions: int = 0
    touches: int = 0  # entries marked used by a client (a restore): last to be evicted
    evicted_while_pinned: int = 0  # went through draining before reuse
    clients_attached: int = 0
    clients_released: int = 0
    leases_reclaimed: int = 0  # leased slots of a released client
    abandoned_writes: int = 0  # ... of which a write was begun, never committed (discarded)
    pins_reclaimed: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


#: (digest, Location) added, or (digest, None) removed
Event = tuple[bytes, Location | None]


class HostDirectory:
    """Slot directory, leases, pins and LRU eviction over one segment and pin table."""

    def __init__(self, segment: SharedSegment, pins: PinTable) -> None:
        if pins.num_slots != segment.num_slots:
            raise ValueError(f"pin table has {pins.num_slots} slots, segment "
                             f"{segment.num_slots}")
        self.segment = segment
        self.pins = pins
        self.entries: OrderedDict[bytes, Location] = OrderedDict()  # LRU first
        self._free: deque[int] = deque(range(segment.num_slots))
        self._draining: set[int] = set()
        self._leases: dict[int, set[int]] = {}  # client row -> its leased slots
        self._free_rows: list[int] = list(range(pins.rows - 1, -1, -1))
        self.events: list[Event] = []
        self.counters = DirectoryCounters()
        self.bytes_used = 0

    # ------------------------------------------------------------ clients
    def attach_client(self) -> int | None:
        """A pin row for a new client; None when every row is taken."""
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._leases[row] = set()
        self.counters.clients_attached += 1
        return row

    def release_client(self, row: int) -> None:
        """The client is gone: its leased slots are invalidated and freed, its pins dropped."""
        leased = self._leases.pop(row, None)
        if leased is None:
            return
        for slot in leased:
            self.counters.abandoned_writes += self.segment.header(slot).seq % 2
            self.segment.invalidate(slot)
            self._free.append(slot)
        self.counters.leases_reclaimed += len(leased)
        self.counters.pins_reclaimed += self.pins.clear_row(row)
        self.counters.clients_released += 1
        self._free_rows.append(row)

    # ------------------------------------------------------------ writes
    def lease(self, row: int, n: int) -> list[int]:
        """Up to ``n`` slots for ``row`` to write: free ones first, then evicted ones."""
        leased = self._leases[row]
        granted: list[int] = []
        self._reclaim_drained()
        while len(granted) < n:
            slot = self._take_free() if self._free else self._evict_one()
            if slot is None:
                break
            granted.append(slot)
        leased.update(granted)
        self.counters.leased += len(granted)
        self.counters.lease_shortfall += n - len(granted)
        return granted

    def commit(self, row: int, slot: int, digest: bytes, save_id: int, length: int) -> bool:
        """Publish ``row``'s save in its leased ``slot``; False when it was refused or a
        duplicate (the slot is then freed, never served)."""
        leased = self._leases.get(row)
        if leased is None or slot not in leased:
            self.counters.commits_rejected += 1
            return False
        leased.discard(slot)
        head = self.segment.header(slot)
        if head.seq == 0 or head.seq % 2 or head.flags != 1 or head.key != digest \
                or head.save_id != save_id or head.length != length:
            self.segment.invalidate(slot)
            self._free.append(slot)
            self.counters.commits_rejected += 1
            return False
        if digest in self.entries:
            self.segment.invalidate(slot)
            self._free.append(slot)
            self.entries.move_to_end(digest)
            self.counters.duplicates_dropped += 1
            return False
        where = Location(slot, save_id, length)
        self.entries[digest] = where
        self.bytes_used += length
        self.events.append((digest, where))
        self.counters.commits += 1
        return True

    def abandon(self, row: int, slot: int) -> None:
        """``row`` gives its leased ``slot`` back unwritten (or with a write it gave up):
        invalidated and freed, never served."""
        leased = self._leases.get(row)
        if leased is None or slot not in leased:
            return
        leased.discard(slot)
        self.segment.invalidate(slot)
        self._free.append(slot)

    def touch(self, digests: list[bytes]) -> None:
        """Mark entries as just used (LRU)."""
        for digest in digests:
            if digest in self.entries:
                self.entries.move_to_end(digest)
                self.counters.touches += 1

    def drain_events(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    # ------------------------------------------------------------ inside
    def _take_free(self) -> int:
        return self._free.popleft()

    def _evict_one(self) -> int | None:
        """Evict the least recently used entry; its slot if no client pins it (else it
        drains and the next entry is tried)."""
        while self.entries:
            digest, where = self.entries.popitem(last=False)
            self.bytes_used -= where.length
            # invalidate before reading pins: a reader that pins after this sees the
            # header empty; one that pinned before is seen here
            self.segment.invalidate(where.slot)
            self.events.append((digest, None))
            self.counters.evictions += 1
            if self.pins.pinned(where.slot):
                self._draining.add(where.slot)
                self.counters.evicted_while_pinned += 1
                continue
            return where.slot
        return None

    def _reclaim_drained(self) -> None:
        if not self._draining:
            return
        done = [slot for slot in self._draining if not self.pins.pinned(slot)]
        for slot in done:
            self._draining.discard(slot)
            self._free.append(slot)

    def stats(self) -> dict[str, int]:
        return {
            **self.counters.as_dict(),
            "entries": len(self.entries),
            "free_slots": len(self._free),
            "draining_slots": len(self._draining),
            "leased_slots": sum(len(s) for s in self._leases.values()),
            "clients": len(self._leases),
            "num_slots": self.segment.num_slots,
            "slot_bytes": self.segment.slot_bytes,
            "bytes_used": self.bytes_used,
        }
