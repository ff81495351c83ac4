"""CpuTier: slots, LRU, pinning, reservations, eviction callbacks, threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from offload_tiers.cpu_tier import CpuTier
from tests.tiers.helpers import key, payload, run_threads

SLOT = 256


def tier(slots: int = 4, **kw) -> CpuTier:  # noqa: ANN003
    return CpuTier(slots * SLOT, SLOT, **kw)


def test_slab_shape_and_plain_memory_without_cuda() -> None:
    t = tier(3)
    assert t.num_slots == 3 and t.slab.shape == (3, SLOT) and t.slab.dtype == np.uint8
    assert t.pinned_memory is False
    with pytest.raises(ValueError):
        CpuTier(10, SLOT)


def test_put_get_round_trip_and_stats() -> None:
    t = tier()
    k = key(0)
    assert t.get(k) is None
    assert t.put(k, payload(k))
    assert t.get(k) == payload(k) and t.contains(k) and len(t) == 1
    short = key(1)
    assert t.put(short, b"abc") and t.get(short) == b"abc"
    s = t.stats()
    assert s["hits"] == 2 and s["misses"] == 1 and s["puts"] == 2 and s["entries"] == 2


def test_oversized_put_is_an_error() -> None:
    with pytest.raises(ValueError):
        tier().put(key(0), b"x" * (SLOT + 1))


def test_lru_eviction_order_and_callback_sees_old_bytes() -> None:
    seen: list[tuple] = []
    t = tier(2, on_evict=lambda k, v: seen.append((k, bytes(v))))
    a, b, c = key(0), key(1), key(2)
    t.put(a, payload(a))
    t.put(b, payload(b))
    assert t.get(a) == payload(a)  # a is now most recent
    t.put(c, payload(c))
    assert seen == [(b, payload(b))]
    assert t.contains(a) and t.contains(c) and not t.contains(b)
    assert t.stats()["evictions"] == 1


def test_pinned_entries_are_never_evicted_and_full_pin_rejects() -> None:
    t = tier(2)
    a, b, c = key(0), key(1), key(2)
    t.put(a, payload(a))
    t.put(b, payload(b))
    sa, sb = t.acquire(a), t.acquire(b)
    assert sa is not None and sb is not None
    assert t.reserve(c) is None and not t.put(c, payload(c))
    assert t.stats()["rejected"] == 2
    t.release(b)
    assert t.put(c, payload(c))
    assert not t.contains(b) and bytes(t.view(sa)) == payload(a)
    t.release(a)
    with pytest.raises(KeyError):
        t.release(a)


def test_acquire_is_refcounted() -> None:
    t = tier(1)
    a, b = key(0), key(1)
    t.put(a, payload(a))
    t.acquire(a)
    t.acquire(a)
    t.release(a)
    assert not t.put(b, payload(b))
    t.release(a)
    assert t.put(b, payload(b))


def test_a_held_entry_keeps_its_lru_place_and_is_passed_over_by_eviction() -> None:
    """``pin_for_copy`` (a copy to Redis) pins without making the entry recently used; ``acquire``
    then ``release`` (a load) does."""
    evicted: list = []
    t = tier(3, on_evict=lambda k, v: evicted.append(k))
    a, b, c, d, e = (key(i) for i in range(5))
    for k in (a, b, c):
        t.put(k, payload(k))
    assert t.pin_for_copy(a) is not None and t.pin_for_copy(key(9)) is None
    assert t.keys() == [a, b, c]  # held: still least recently used
    t.put(d, payload(d))  # a is held: b, the next least recently used, goes
    assert evicted == [b] and t.contains(a)
    t.unpin_for_copy(a)
    assert t.keys() == [a, c, d]  # its place kept after the copy
    t.put(e, payload(e))
    assert evicted == [b, a]
    assert t.stats()["hits"] == 0  # a copy elsewhere is not a read hit
    with pytest.raises(KeyError):
        t.unpin_for_copy(c)


def test_pin_for_copy_and_acquire_together() -> None:
    t = tier(2)
    a, b, c = key(0), key(1), key(2)
    t.put(a, payload(a))
    t.put(b, payload(b))
    t.pin_for_copy(a)
    t.acquire(a)  # a load while its write runs
    t.release(a)  # a load is a use: most recently used, still held
    assert t.keys() == [b, a]
    with pytest.raises(KeyError):
        t.release(a)  # held, not acquired
    t.pin_for_copy(b)
    assert t.reserve(c) is None  # every entry held
    t.unpin_for_copy(a)
    t.unpin_for_copy(b)
    assert t.put(c, payload(c)) and not t.contains(b) and t.contains(a)


def test_remove_while_pinned_for_copy_frees_at_its_unpin() -> None:
    t = tier(1)
    a = key(0)
    t.put(a, payload(a))
    slot = t.pin_for_copy(a)
    assert t.remove(a) and not t.contains(a) and t.keys() == []
    assert t.reserve(key(1)) is None  # its slot is still being copied
    assert slot is not None and bytes(t.view(slot)) == payload(a)
    t.unpin_for_copy(a)
    assert t.stats()["free_slots"] == 1 and t.put(key(1), b"new")


def test_reservation_invisible_until_commit_and_abort_frees() -> None:
    t = tier(1)
    a = key(0)
    slot = t.reserve(a)
    assert slot is not None and not t.contains(a) and t.get(a) is None
    t.view(slot)[:] = payload(a)
    assert t.reserve(a) is None  # being written
    t.commit(a)
    assert t.get(a) == payload(a)
    b = key(1)
    t.reserve(b)  # evicts a
    t.abort(b)
    assert t.stats()["free_slots"] == 1 and len(t) == 0
    with pytest.raises(KeyError):
        t.commit(b)


def test_replace_committed_value() -> None:
    t = tier(2)
    a = key(0)
    t.put(a, b"one")
    t.put(a, b"two!")
    assert t.get(a) == b"two!" and len(t) == 1 and t.stats()["free_slots"] == 1


def test_remove_while_pinned_frees_at_release() -> None:
    t = tier(1)
    a = key(0)
    t.put(a, payload(a))
    slot = t.acquire(a)
    assert t.remove(a) and not t.contains(a)
    assert t.reserve(a) is None  # slot of the removed entry still in use
    assert bytes(t.view(slot)) == payload(a)
    t.release(a)
    assert t.stats()["free_slots"] == 1 and t.put(a, b"new") and t.get(a) == b"new"
    assert not t.remove(key(9))


def test_partial_never_answers_full_and_a_full_entry_replaces_it() -> None:
    t = tier(4)
    partial = key(3, partial=True)
    full = key(3)
    t.put(partial, b"partial")
    assert t.get(full) is None and not t.contains(full)
    assert t.put(full, b"full") and t.remove(partial)  # partial -> full: store, then drop
    assert t.get(full) == b"full" and not t.contains(partial) and len(t) == 1


def test_read_into_and_view_are_zero_copy_of_slab() -> None:
    t = tier(2)
    a = key(0)
    t.put(a, payload(a))
    out = bytearray(SLOT)
    assert t.read_into(a, out) == SLOT and bytes(out) == payload(a)
    slot = t.acquire(a)
    t.slab[slot, 0] ^= 0xFF
    assert t.view(slot)[0] == payload(a)[0] ^ 0xFF
    t.release(a)
    with pytest.raises(ValueError):
        t.read_into(a, bytearray(3))
    assert t.read_into(key(5), out) is None


def test_evict_callback_error_does_not_break_put() -> None:
    def boom(k, v):  # noqa: ANN001
        raise RuntimeError("callback failed")

    t = tier(1, on_evict=boom)
    t.put(key(0), b"a")
    assert t.put(key(1), b"b") and t.stats()["evict_callback_errors"] == 1


def test_concurrent_writers_and_readers_never_see_torn_values() -> None:
    t = tier(8)
    keys = [key(i) for i in range(32)]
    torn: list[str] = []
    hits = [0, 0]
    stop = threading.Event()

    def writer(offset: int) -> None:
        for n in range(400):
            k = keys[(n * 7 + offset) % len(keys)]
            assert t.put(k, payload(k))  # nothing pinned: a put always finds a slot

    def reader(me: int) -> None:
        while not stop.is_set():
            for k in keys:
                got = t.get(k)
                if got is not None:
                    hits[me] += 1
                    if got != payload(k):
                        torn.append(k.name)

    run_threads([lambda i=i: writer(i) for i in range(3)],
                [lambda i=i: reader(i) for i in range(2)], stop=stop)
    assert torn == []
    assert hits[0] > 0 and hits[1] > 0  # both readers really read values
    assert len(t) <= 8 and t.stats()["pinned"] == 0
