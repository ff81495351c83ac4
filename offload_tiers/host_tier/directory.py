"""The owner's bookkeeping of the host tier: which slot holds which key, who may write where.

One process (the daemon) owns a :class:`HostDirectory`; clients never write it. Life of
a slot::

    free -> leased to a client (lease)          the client writes it (SharedSegment
         -> committed entry (commit)            begin_write/commit_write), then says so
         -> evicted: invalidated, then freed    once no client pins it (else draining)

A commit is accepted only for a slot leased to that client whose header holds exactly the
committed save; a second save of a key that already has an entry is dropped (its slot
invalidated and freed): two engines storing one prefix occupy one set of slots. The one
exception is a ``replace`` commit (the daemon's restore of the exact save an engine asked
for): it takes the place of an entry of another save. A client that goes away loses its
leases (invalidated: a half-written slot is never served) and its pins. An entry that is
*held* (its bytes not yet read back for the Redis write-behind) is passed over by
eviction. Every change to the entries is queued in ``events`` for the subscribers'
mirrors, in order.

Save ids are the engines': every TP rank's shard of one save carries the same id, so a
reader assembles a hit only from shards of one save (``Location.save_id`` equal).
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
    replaced: int = 0  # entries of another save replaced by the save a restore asked for

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
        self._held: dict[bytes, int] = {}  # digest -> pins for a copy (eviction passes over it)
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

    def leased_to(self, row: int) -> list[int]:
        """The slots leased to ``row`` and not yet committed or given back."""
        return sorted(self._leases.get(row, ()))

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

    def commit(self, row: int, slot: int, digest: bytes, save_id: int, length: int, *,
               replace: bool = False) -> bool:
        """Publish ``row``'s save in its leased ``slot``; False when it was refused or a
        duplicate (the slot is then freed, never served). ``replace``: an entry of another
        save of ``digest`` gives way to this one (unless held)."""
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
        held = self.entries.get(digest)
        if held is not None and replace and held.save_id != save_id \
                and not self._held.get(digest):
            del self.entries[digest]
            if self._drop(digest, held):
                self._free.append(held.slot)
            self.counters.replaced += 1
            held = None
        if held is not None:
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

    def pin_for_copy(self, digest: bytes) -> bool:
        """Keep ``digest``'s entry from eviction until :meth:`unpin_for_copy` (its bytes are still
        to be read, e.g. for the Redis write-behind); False when there is no entry."""
        if digest not in self.entries:
            return False
        self._held[digest] = self._held.get(digest, 0) + 1
        return True

    def unpin_for_copy(self, digest: bytes) -> None:
        count = self._held.get(digest, 0)
        if count <= 1:
            self._held.pop(digest, None)
        else:
            self._held[digest] = count - 1

    def drain_events(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    # ------------------------------------------------------------ inside
    def _take_free(self) -> int:
        return self._free.popleft()

    def _evict_one(self) -> int | None:
        """Evict the least recently used entry; its slot if no client pins it (else it
        drains and the next entry is tried)."""
        while True:
            digest = next((d for d in self.entries if d not in self._held), None)
            if digest is None:
                return None
            where = self.entries.pop(digest)
            self.counters.evictions += 1
            if self._drop(digest, where):
                return where.slot

    def _drop(self, digest: bytes, where: Location) -> bool:
        """Take a removed entry's slot out of service: True when it is free to reuse now,
        False when a reader pins it (it drains first)."""
        self.bytes_used -= where.length
        # invalidate before reading pins: a reader that pins after this sees the header
        # empty; one that pinned before is seen here
        self.segment.invalidate(where.slot)
        self.events.append((digest, None))
        if self.pins.pinned(where.slot):
            self._draining.add(where.slot)
            self.counters.evicted_while_pinned += 1
            return False
        return True

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
            "held_entries": len(self._held),
            "leased_slots": sum(len(s) for s in self._leases.values()),
            "clients": len(self._leases),
            "num_slots": self.segment.num_slots,
            "slot_bytes": self.segment.slot_bytes,
            "bytes_used": self.bytes_used,
        }
