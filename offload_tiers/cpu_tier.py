"""The CPU tier: a preallocated slab of fixed-size slots in host memory, with O(1) LRU.

Life of an entry::

    reserve(key) -> slot      # slot is the writer's; invisible to readers
    (write into view(slot) or slab[slot])
    commit(key)               # now visible: contains/acquire/get see it
    acquire(key) -> slot      # pin for an in-flight load (refcounted); never evicted while pinned
    release(key)              # ... and the entry becomes the most recently used
    pin_for_copy(key) -> slot # pin while its bytes are copied elsewhere (a Redis write):
    unpin_for_copy(key)       # never evicted meanwhile, and its place in the LRU order kept
    remove(key)               # gone now; a pinned slot is freed at its last release

``put``/``get`` wrap those for callers that just want bytes in and out. Keys compare by
every field (fingerprint, group, hash, num_tokens, kind), so a PARTIAL entry never answers
a FULL lookup.

A tier built with ``with_slab=False`` is a *slot directory*: the same bookkeeping (slots,
LRU, pins) with no bytes, for a process that decides where blocks go while others hold them
(vLLM's scheduler, whose workers own the slabs). Its byte methods raise ``RuntimeError``.

The slab is a numpy ``uint8`` array of shape ``(num_slots, slot_bytes)`` (a worker can wrap
it with ``torch.from_numpy`` and gather/scatter many slots in one indexed copy). It is
page-locked through torch when torch is importable and CUDA is present, plain numpy memory
otherwise; torch is imported lazily and is never required.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from offload_tiers._types import BytesLike
from offload_tiers.keys import BlockKey
from offload_tiers.prefault import populate_in_background

log = logging.getLogger(__name__)

EvictCallback = Callable[[BlockKey, memoryview], None]


class _Entry:
    __slots__ = ("key", "slot", "nbytes", "committed", "pins", "copy_pins")

    def __init__(self, key: BlockKey, slot: int, nbytes: int) -> None:
        self.key = key
        self.slot = slot
        self.nbytes = nbytes
        self.committed = False
        self.pins = 0  # acquire() and pin_for_copy() together
        self.copy_pins = 0  # pin_for_copy() alone: pins that leave the entry in the LRU order

    @property
    def in_use(self) -> bool:
        """Pinned by a reader (acquire): out of the LRU order until its last release."""
        return self.pins > self.copy_pins


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    rejected: int = 0
    evictions: int = 0
    removals: int = 0
    evict_callback_errors: int = 0


_Ik = tuple  # internal dict key: plain fields hash in C (BlockKey's enum field hashes in Python)


def _ik(key: BlockKey) -> _Ik:
    return (key.fingerprint, key.group, key.block_hash, key.num_tokens, int(key.kind))


def _as_u8(data: BytesLike) -> np.ndarray:
    """A flat uint8 view of ``data`` (no copy when it is contiguous)."""
    if type(data) is np.ndarray and data.dtype == np.uint8 and data.ndim == 1 \
            and data.flags.c_contiguous:
        return data
    try:
        return np.frombuffer(data, dtype=np.uint8)
    except (ValueError, TypeError):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def _cuda_available() -> bool:
    try:
        import torch  # optional, imported lazily
    except Exception:  # torch absent or broken: plain memory
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _allocate(num_slots: int, slot_bytes: int, pin: bool) -> tuple[np.ndarray, object | None]:
    if pin:
        import torch

        tensor = torch.empty((num_slots, slot_bytes), dtype=torch.uint8, pin_memory=True)
        return tensor.numpy(), tensor  # keep the tensor alive: it owns the pinned memory
    slab = np.empty((num_slots, slot_bytes), dtype=np.uint8)
    populate_in_background(slab)  # no page fault on a slot's first write (page-locked: none)
    return slab, None


def allocate_slab(num_slots: int, slot_bytes: int,
                  pin: bool | None = None) -> tuple[np.ndarray, object | None]:
    """A ``(num_slots, slot_bytes)`` uint8 host array (page-locked when CUDA is present and
    ``pin`` is not False) and the object that owns its memory (keep both alive). Pageable
    memory is faulted in by a background thread (:mod:`offload_tiers.prefault`): committed
    from the start, as page-locked memory is."""
    return _allocate(num_slots, slot_bytes, _cuda_available() if pin is None else pin)


class CpuTier:
    """Fixed-size slots in one preallocated host-memory slab; thread-safe; O(1) LRU eviction.

    ``on_evict(key, view)`` runs (under the tier's lock, before the slot is reused) for every
    entry evicted to make room; ``view`` is only valid during the call (copy what you keep;
    do not call back into a *different* tier that may block). It may be set after
    construction via the ``on_evict`` attribute.
    """

    def __init__(self, capacity_bytes: int, slot_bytes: int, *, pin_memory: bool | None = None,
                 on_evict: EvictCallback | None = None, with_slab: bool = True) -> None:
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
        num_slots = capacity_bytes // slot_bytes
        if num_slots < 1:
            raise ValueError(
                f"capacity_bytes={capacity_bytes} holds no slot of {slot_bytes} bytes"
            )
        want_pin = with_slab and (_cuda_available() if pin_memory is None else pin_memory)
        if want_pin and pin_memory and not _cuda_available():
            log.warning("pin_memory requested but torch/CUDA is unavailable; using plain memory")
            want_pin = False
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.has_slab = with_slab
        self.slab, self._owner = _allocate(num_slots if with_slab else 0, slot_bytes, want_pin)
        self.pinned_memory = want_pin
        self.on_evict = on_evict
        self._lock = threading.RLock()
        self._entries: dict[_Ik, _Entry] = {}
        self._doomed: dict[_Ik, _Entry] = {}  # removed while pinned
        # Committed entries no reader pins (held ones included: eviction passes over them),
        # least recently used first.
        self._lru: OrderedDict[_Ik, None] = OrderedDict()
        self._slot_len = [slot_bytes] * num_slots
        self._rows = list(self.slab)  # one view per slot: cheaper than slab[slot, :n] per call
        self._free = list(range(num_slots - 1, -1, -1))
        self._committed = 0
        self._c = _Counters()

    # ---------------------------------------------------------------- write path
    def reserve(self, key: BlockKey, nbytes: int | None = None) -> int | None:
        """A slot to write ``key`` into (evicting LRU unpinned entries), or None.

        None when every slot is pinned or being written, or when ``key`` is being written
        or loaded right now. Reserving a committed, unpinned key replaces it.
        """
        n = self.slot_bytes if nbytes is None else nbytes
        if not 0 <= n <= self.slot_bytes:
            raise ValueError(f"{n} bytes do not fit a slot of {self.slot_bytes}")
        with self._lock:
            return self._reserve(_ik(key), key, n)

    def _reserve(self, ik: _Ik, key: BlockKey, n: int) -> int | None:
        old = self._entries.get(ik)
        if old is not None:
            if not old.committed or old.pins:
                self._c.rejected += 1
                return None
            del self._entries[ik]
            del self._lru[ik]
            self._committed -= 1
            self._free.append(old.slot)
        if ik in self._doomed:
            self._c.rejected += 1
            return None
        slot = self._take_slot()
        if slot is None:
            self._c.rejected += 1
            return None
        self._entries[ik] = _Entry(key, slot, n)
        self._slot_len[slot] = n
        return slot

    def commit(self, key: BlockKey) -> None:
        """Make a reserved entry visible to readers."""
        with self._lock:
            self._commit(_ik(key))

    def _commit(self, ik: _Ik) -> None:
        entry = self._entries.get(ik)
        if entry is None or entry.committed:
            raise KeyError(f"no reservation to commit for block {ik[2].hex()}")
        entry.committed = True
        self._lru[ik] = None
        self._committed += 1
        self._c.puts += 1

    def abort(self, key: BlockKey) -> None:
        """Give back a reserved slot without publishing it."""
        ik = _ik(key)
        with self._lock:
            entry = self._entries.get(ik)
            if entry is None or entry.committed:
                return
            del self._entries[ik]
            self._free.append(entry.slot)

    #: payloads up to this size are copied while holding the lock (one lock round trip);
    #: larger ones are copied outside it (reserve, copy, commit) so readers are not held up.
    SMALL_COPY = 256 * 1024

    def _need_slab(self) -> None:
        if not self.has_slab:
            raise RuntimeError("this CPU tier is a slot directory (with_slab=False): it holds "
                               "no bytes")

    def put(self, key: BlockKey, data: BytesLike) -> bool:
        """Copy ``data`` into a slot and publish it. False when no slot can be had."""
        self._need_slab()
        src = _as_u8(data)
        n = src.nbytes
        if n > self.slot_bytes:
            raise ValueError(f"{n} bytes do not fit a slot of {self.slot_bytes}")
        ik = _ik(key)
        if n <= self.SMALL_COPY:
            with self._lock:
                slot = self._reserve(ik, key, n)
                if slot is None:
                    return False
                try:
                    row = self._rows[slot]
                    if n == self.slot_bytes:
                        row[:] = src
                    else:
                        row[:n] = src
                except BaseException:
                    del self._entries[ik]
                    self._free.append(slot)
                    raise
                self._commit(ik)
                return True
        with self._lock:
            slot = self._reserve(ik, key, n)
        if slot is None:
            return False
        try:
            np.copyto(self.slab[slot, :n], src)
        except BaseException:
            self.abort(key)
            raise
        with self._lock:
            self._commit(ik)
        return True

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        victim = self._lru_unpinned()
        if victim is None:
            return None
        del self._lru[victim]
        entry = self._entries.pop(victim)
        self._committed -= 1
        self._c.evictions += 1
        if self.on_evict is not None:
            try:
                view = self.view(entry.slot) if self.has_slab else memoryview(b"")
                self.on_evict(entry.key, view)
            except Exception:
                self._c.evict_callback_errors += 1
                log.exception("on_evict callback failed for %s", entry.key.name)
        return entry.slot

    def _lru_unpinned(self) -> _Ik | None:
        """The least recently used entry nothing pins (held ones are passed over; they are
        few: the writes in flight)."""
        for ik in self._lru:
            if self._entries[ik].pins == 0:
                return ik
        return None

    # ---------------------------------------------------------------- read path
    def contains(self, key: BlockKey) -> bool:
        """True when a committed entry for exactly this key is present (no LRU touch)."""
        entry = self._entries.get(_ik(key))
        return entry is not None and entry.committed

    def contains_many(self, keys: Iterable[BlockKey]) -> list[bool]:
        with self._lock:
            return [(e := self._entries.get(_ik(k))) is not None and e.committed for k in keys]

    def acquire(self, key: BlockKey) -> int | None:
        """Pin ``key``'s slot for a load (refcounted) and return it; None on a miss."""
        with self._lock:
            return self._acquire(_ik(key))

    def _acquire(self, ik: _Ik) -> int | None:
        entry = self._entries.get(ik)
        if entry is None or not entry.committed:
            self._c.misses += 1
            return None
        if not entry.in_use:
            del self._lru[ik]
        entry.pins += 1
        self._c.hits += 1
        return entry.slot

    def release(self, key: BlockKey) -> None:
        """Unpin one ``acquire``; the entry becomes most recently used."""
        with self._lock:
            self._release(_ik(key))

    def _release(self, ik: _Ik) -> None:
        entry = self._entries.get(ik)
        doomed = False
        if entry is None or not entry.in_use:
            entry = self._doomed.get(ik)
            doomed = True
        if entry is None or not entry.in_use:
            raise KeyError("block is not acquired")
        entry.pins -= 1
        if doomed:
            self._free_if_unpinned(ik, entry)
        elif not entry.in_use:
            self._lru[ik] = None

    def pin_for_copy(self, key: BlockKey) -> int | None:
        """Pin ``key``'s slot while its bytes are copied elsewhere (refcounted), leaving its
        place in the LRU order as it is: a copy to another tier is not a use. Eviction
        passes over it until :meth:`unpin_for_copy`. None on a miss."""
        with self._lock:
            entry = self._entries.get(_ik(key))
            if entry is None or not entry.committed:
                return None
            entry.pins += 1
            entry.copy_pins += 1
            return entry.slot

    def unpin_for_copy(self, key: BlockKey) -> None:
        """End one :meth:`pin_for_copy`; the entry's place in the LRU order is unchanged."""
        ik = _ik(key)
        with self._lock:
            entry, doomed = self._entries.get(ik), False
            if entry is None or entry.copy_pins == 0:
                entry, doomed = self._doomed.get(ik), True
            if entry is None or entry.copy_pins == 0:
                raise KeyError("block is not pinned for a copy")
            entry.pins -= 1
            entry.copy_pins -= 1
            if doomed:
                self._free_if_unpinned(ik, entry)

    def _free_if_unpinned(self, ik: _Ik, entry: _Entry) -> None:
        """A removed entry's slot is free once nothing pins it."""
        if entry.pins == 0:
            del self._doomed[ik]
            self._free.append(entry.slot)

    def view(self, slot: int) -> memoryview:
        """Zero-copy view of a slot's stored bytes (valid while reserved or acquired)."""
        self._need_slab()
        return memoryview(self.slab[slot, : self._slot_len[slot]])

    def get(self, key: BlockKey) -> bytes | None:
        """A copy of ``key``'s bytes, or None."""
        self._need_slab()
        ik = _ik(key)
        with self._lock:
            slot = self._acquire(ik)
            if slot is None:
                return None
            if self._slot_len[slot] <= self.SMALL_COPY:
                try:
                    return self.slab[slot, : self._slot_len[slot]].tobytes()
                finally:
                    self._release(ik)
        try:
            return self.slab[slot, : self._slot_len[slot]].tobytes()
        finally:
            self.release(key)

    def read_into(self, key: BlockKey, out: BytesLike) -> int | None:
        """Copy ``key``'s bytes into ``out`` (no allocation); the byte count, or None."""
        self._need_slab()
        dst = out if isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.ndim == 1 \
            else _as_u8(out)
        ik = _ik(key)
        with self._lock:
            slot = self._acquire(ik)
            if slot is None:
                return None
            n = self._slot_len[slot]
            if n <= self.SMALL_COPY or dst.nbytes < n:
                try:
                    if dst.nbytes < n:
                        raise ValueError(f"output buffer of {dst.nbytes} bytes < {n}")
                    if dst.nbytes == n:
                        dst[:] = self._rows[slot] if n == self.slot_bytes \
                            else self._rows[slot][:n]
                    else:
                        dst[:n] = self._rows[slot][:n]
                    return n
                finally:
                    self._release(ik)
        try:
            np.copyto(dst[:n], self.slab[slot, :n])
            return n
        finally:
            self.release(key)

    # ---------------------------------------------------------------- housekeeping
    def remove(self, key: BlockKey) -> bool:
        """Drop a committed entry now (a pinned slot is freed at its last release)."""
        ik = _ik(key)
        with self._lock:
            entry = self._entries.get(ik)
            if entry is None or not entry.committed:
                return False
            del self._entries[ik]
            self._committed -= 1
            self._c.removals += 1
            if not entry.in_use:
                del self._lru[ik]
            if entry.pins:
                self._doomed[ik] = entry
            else:
                self._free.append(entry.slot)
            return True

    def keys(self) -> list[BlockKey]:
        """Committed keys, least recently used first (those a reader pins first; a
        snapshot)."""
        with self._lock:
            pinned = [e.key for e in self._entries.values() if e.committed and e.in_use]
            return pinned + [self._entries[ik].key for ik in self._lru]

    def __len__(self) -> int:
        return self._committed

    def stats(self) -> dict[str, int | bool]:
        with self._lock:
            pinned = sum(1 for e in self._entries.values() if e.pins) + len(self._doomed)
            return {
                "num_slots": self.num_slots,
                "slot_bytes": self.slot_bytes,
                "entries": self._committed,
                "reserved": len(self._entries) - self._committed,
                "pinned": pinned,
                "free_slots": len(self._free),
                "hits": self._c.hits,
                "misses": self._c.misses,
                "puts": self._c.puts,
                "rejected": self._c.rejected,
                "evictions": self._c.evictions,
                "removals": self._c.removals,
                "evict_callback_errors": self._c.evict_callback_errors,
                "pinned_memory": self.pinned_memory,
            }
