"""HostDirectory over a real /dev/shm segment and pin table: leases, commits, duplicates,
LRU eviction, pins and released clients. One process: the directory is the owner's state."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from offload_tiers.host_tier.directory import HostDirectory, Location
from offload_tiers.host_tier.pins import PinTable
from offload_tiers.shared_segment import SharedSegment, default_path, digest

SLOT = 256


@pytest.fixture
def directory() -> Iterator[HostDirectory]:
    name = f"test-dir-{uuid.uuid4().hex[:12]}"
    segment = SharedSegment.create(default_path(name), 4, SLOT)
    pins = PinTable.create(default_path(f"{name}.pins"), 3, 4)
    try:
        yield HostDirectory(segment, pins)
    finally:
        for table in (segment, pins):
            table.unlink()
            table.close()


def save(directory: HostDirectory, row: int, slot: int, key: bytes, save_id: int,
         payload: bytes | None = None) -> bool:
    """Write ``payload`` into ``slot`` as the client would, then commit it."""
    data = payload if payload is not None else bytes([save_id % 256]) * SLOT
    directory.segment.write(slot, digest(key), save_id, data)
    return directory.commit(row, slot, digest(key), save_id, len(data))


def test_a_committed_save_is_an_entry_readable_at_its_location(
        directory: HostDirectory) -> None:
    row = directory.attach_client()
    assert row is not None
    [slot] = directory.lease(row, 1)
    assert save(directory, row, slot, b"k", 7, b"x" * 100)
    where = directory.entries[digest(b"k")]
    assert where == Location(slot, 7, 100)
    assert directory.segment.read(where.slot, digest(b"k"), where.save_id) == b"x" * 100
    assert directory.drain_events() == [(digest(b"k"), where)]
    assert directory.stats()["bytes_used"] == 100


def test_a_second_save_of_a_key_is_dropped_and_its_slot_freed(
        directory: HostDirectory) -> None:
    a, b = directory.attach_client(), directory.attach_client()
    assert a is not None and b is not None
    [sa], [sb] = directory.lease(a, 1), directory.lease(b, 1)
    assert save(directory, a, sa, b"same", 1)
    assert not save(directory, b, sb, b"same", 2)
    assert len(directory.entries) == 1 and directory.counters.duplicates_dropped == 1
    assert directory.segment.read(sb, digest(b"same"), 2) is None  # never served
    assert directory.stats()["free_slots"] == 3  # all but the one entry: sb is back
    assert sb in directory.lease(b, 3)


def test_commits_of_slots_not_leased_or_not_holding_the_save_are_refused(
        directory: HostDirectory) -> None:
    a, b = directory.attach_client(), directory.attach_client()
    assert a is not None and b is not None
    [sa] = directory.lease(a, 1)
    assert not save(directory, b, sa, b"k", 1)  # a's lease, b's commit
    [sa2] = directory.lease(a, 1)
    directory.segment.write(sa2, digest(b"k"), 5, b"y" * 10)
    assert not directory.commit(a, sa2, digest(b"k"), 6, 10)  # header holds save 5
    assert directory.counters.commits_rejected == 2
    assert directory.entries == {}


def test_eviction_is_least_recently_used_and_announced(directory: HostDirectory) -> None:
    row = directory.attach_client()
    assert row is not None
    slots = directory.lease(row, 4)
    for i, slot in enumerate(slots):
        assert save(directory, row, slot, b"k%d" % i, i + 1)
    directory.touch([digest(b"k0")])  # k1 is now the oldest
    directory.drain_events()
    [again] = directory.lease(row, 1)
    assert again == slots[1]
    assert digest(b"k1") not in directory.entries and digest(b"k0") in directory.entries
    assert directory.drain_events() == [(digest(b"k1"), None)]
    assert directory.segment.read(slots[1], digest(b"k1"), 2) is None


def test_a_pinned_slot_is_not_reused_until_unpinned(directory: HostDirectory) -> None:
    owner, reader = directory.attach_client(), directory.attach_client()
    assert owner is not None and reader is not None
    slots = directory.lease(owner, 4)
    for i, slot in enumerate(slots):
        assert save(directory, owner, slot, b"k%d" % i, i + 1)
    directory.pins.pin(reader, [slots[0]])  # the oldest entry, being loaded
    granted = directory.lease(owner, 1)
    assert granted == [slots[1]]  # slots[0] evicted but drains
    assert directory.counters.evicted_while_pinned == 1
    assert digest(b"k0") not in directory.entries
    assert directory.stats()["draining_slots"] == 1
    assert slots[0] not in directory.lease(owner, 2)  # evicts k2, k3 instead
    directory.pins.unpin(reader, [slots[0]])
    assert directory.lease(owner, 1) == [slots[0]]


def test_a_released_client_loses_its_half_written_leases_and_pins(
        directory: HostDirectory) -> None:
    a, b = directory.attach_client(), directory.attach_client()
    assert a is not None and b is not None
    [slot] = directory.lease(a, 1)
    row_view = directory.segment.begin_write(slot)  # a dies mid-write
    row_view[:4] = list(b"half")
    directory.pins.pin(a, [0, 1])
    directory.release_client(a)
    assert directory.segment.header(slot).seq % 2 == 0  # no longer "being written"
    assert directory.segment.read(slot, digest(b"k"), 1) is None
    assert not directory.pins.counts[a].any()
    assert directory.counters.leases_reclaimed == 1 and directory.counters.pins_reclaimed == 2
    assert not save(directory, a, slot, b"k", 1)  # its late commit is refused
    assert directory.stats()["leased_slots"] == 0


def test_client_rows_run_out_and_come_back(directory: HostDirectory) -> None:
    rows = [directory.attach_client() for _ in range(3)]
    assert None not in rows and directory.attach_client() is None
    directory.release_client(rows[1])
    assert directory.attach_client() == rows[1]


def test_a_replace_commit_takes_the_place_of_another_save(directory: HostDirectory) -> None:
    """Issue 43 item 1: the daemon's restore of the save an engine asked for replaces an
    entry of another save of that digest (a plain commit of it is a dropped duplicate);
    the old slot is invalidated, and drains first while a reader pins it."""
    a, reader = directory.attach_client(), directory.attach_client()
    assert a is not None and reader is not None
    old, dup, new = directory.lease(a, 3)
    assert save(directory, a, old, b"k", 1)
    assert not save(directory, a, dup, b"k", 2)  # a duplicate: dropped
    directory.pins.pin(reader, [old])
    directory.drain_events()
    directory.segment.write(new, digest(b"k"), 2, b"\2" * SLOT)
    assert directory.commit(a, new, digest(b"k"), 2, SLOT, replace=True)
    assert directory.entries[digest(b"k")] == Location(new, 2, SLOT)
    assert directory.counters.replaced == 1
    assert directory.drain_events() == [(digest(b"k"), None),
                                        (digest(b"k"), Location(new, 2, SLOT))]
    assert directory.segment.read(old, digest(b"k"), 1) is None
    assert directory.stats()["draining_slots"] == 1  # pinned: not reused under the reader
    assert directory.stats()["bytes_used"] == SLOT


def test_a_held_entry_is_passed_over_by_eviction(directory: HostDirectory) -> None:
    """Issue 43 item 11: an entry held for the Redis write-behind is never evicted before
    its bytes are read back; the next oldest goes instead, and it can go once let go."""
    row = directory.attach_client()
    assert row is not None
    slots = directory.lease(row, 4)
    for i, slot in enumerate(slots):
        assert save(directory, row, slot, b"k%d" % i, i + 1)
    assert directory.pin_for_copy(digest(b"k0")) and not directory.pin_for_copy(digest(b"absent"))
    assert directory.lease(row, 1) == [slots[1]]  # k0 is the oldest, but held
    assert digest(b"k0") in directory.entries
    directory.unpin_for_copy(digest(b"k0"))
    assert directory.lease(row, 1) == [slots[0]]
