"""The CPU tier: a preallocated slab of fixed-size slots in host memory, with O(1) LRU.

Life of an entry::

    reserve(key) -> slot      # slot is the writer's; invisible to readers
    (write into view(slot) or slab[slot])
    commit(key)               # now visible: contains/acquire/get see it
    acquire(key) -> slot      # pin for an in-flight load (refcounted); never evicted while pinned
    release(key)
    remove(key)               # gone now; a pinned slot is freed at its last release

``put``/``get`` wrap those for callers that just want bytes in and out. Keys compare by
every field (fingerprint, group, hash, num_tokens, kind), so a PARTIAL entry never answers
a FULL lookup. Promotion partial→full is ``promote(partial_key, full_key, data)``: store
the FULL entry, then drop the PARTIAL one.

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

log = logging.getLogger(__name__)

EvictCallback = Callable[[BlockKey, memoryview], None]


@dataclass(slots=True)
class _Entry:
    slot: int
    nbytes: int
    committed: bool = False
    pins: int = 0


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    rejected: int = 0
    evictions: int = 0
    removals: int = 0
    evict_callback_errors: int = 0


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
    return np.empty((num_slots, slot_bytes), dtype=np.uint8), None


class CpuTier:
    """Fixed-size slots in one preallocated host-memory slab; thread-safe; O(1) LRU eviction.

    ``on_evict(key, view)`` runs (under the tier's lock, before the slot is reused) for every
    entry evicted to make room; ``view`` is only valid during the call (copy what you keep;
    do not call back into a *different* tier that may block). It may be set after
    construction via the ``on_evict`` attribute.
    """

    def __init__(self, capacity_bytes: int, slot_bytes: int, *, pin_memory: bool | None = None,
                 on_evict: EvictCallback | None = None) -> None:
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
        num_slots = capacity_bytes // slot_bytes
        if num_slots < 1:
            raise ValueError(
                f"capacity_bytes={capacity_bytes} holds no slot of {slot_bytes} bytes"
            )
        want_pin = _cuda_available() if pin_memory is None else pin_memory
        if want_pin and pin_memory and not _cuda_available():
            log.warning("pin_memory requested but torch/CUDA is unavailable; using plain memory")
            want_pin = False
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.slab, self._owner = _allocate(num_slots, slot_bytes, want_pin)
        self.pinned_memory = want_pin
        self.on_evict = on_evict
        self._lock = threading.RLock()
        self._entries: dict[BlockKey, _Entry] = {}
        self._doomed: dict[BlockKey, _Entry] = {}  # removed while pinned
        self._lru: OrderedDict[BlockKey, None] = OrderedDict()  # committed and unpinned
        self._slot_len = [slot_bytes] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))
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
            old = self._entries.get(key)
            if old is not None:
                if not old.committed or old.pins:
                    self._c.rejected += 1
                    return None
                del self._entries[key]
                self._lru.pop(key, None)
                self._free.append(old.slot)
            if key in self._doomed:
                self._c.rejected += 1
                return None
            slot = self._take_slot()
            if slot is None:
                self._c.rejected += 1
                return None
            self._entries[key] = _Entry(slot, n)
            self._slot_len[slot] = n
            return slot

    def commit(self, key: BlockKey) -> None:
        """Make a reserved entry visible to readers."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.committed:
                raise KeyError(f"no reservation to commit for {key.name}")
            entry.committed = True
            self._lru[key] = None
            self._c.puts += 1

    def abort(self, key: BlockKey) -> None:
        """Give back a reserved slot without publishing it."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.committed:
                return
            del self._entries[key]
            self._free.append(entry.slot)

    def put(self, key: BlockKey, data: BytesLike) -> bool:
        """Copy ``data`` into a slot and publish it. False when no slot can be had."""
        src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) \
            else data.reshape(-1).view(np.uint8)
        slot = self.reserve(key, src.nbytes)
        if slot is None:
            return False
        try:
            np.copyto(self.slab[slot, :src.nbytes], src)
        except BaseException:
            self.abort(key)
            raise
        self.commit(key)
        return True

    def promote(self, partial_key: BlockKey, full_key: BlockKey, data: BytesLike) -> bool:
        """Store the FULL entry that supersedes a PARTIAL one, then drop the PARTIAL."""
        if not self.put(full_key, data):
            return False
        self.remove(partial_key)
        return True

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        victim, _ = self._lru.popitem(last=False)
        entry = self._entries.pop(victim)
        self._c.evictions += 1
        if self.on_evict is not None:
            try:
                self.on_evict(victim, self.view(entry.slot))
            except Exception:
                self._c.evict_callback_errors += 1
                log.exception("on_evict callback failed for %s", victim.name)
        return entry.slot

    # ---------------------------------------------------------------- read path
    def contains(self, key: BlockKey) -> bool:
        """True when a committed entry for exactly this key is present (no LRU touch)."""
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and entry.committed

    def acquire(self, key: BlockKey) -> int | None:
        """Pin ``key``'s slot for a load (refcounted) and return it; None on a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not entry.committed:
                self._c.misses += 1
                return None
            entry.pins += 1
            if entry.pins == 1:
                self._lru.pop(key, None)
            self._c.hits += 1
            return entry.slot

    def release(self, key: BlockKey) -> None:
        """Unpin one ``acquire``; the entry becomes most recently used."""
        with self._lock:
            entry = self._entries.get(key)
            doomed = False
            if entry is None or entry.pins == 0:
                entry = self._doomed.get(key)
                doomed = True
            if entry is None or entry.pins == 0:
                raise KeyError(f"{key.name} is not acquired")
            entry.pins -= 1
            if entry.pins == 0:
                if doomed:
                    del self._doomed[key]
                    self._free.append(entry.slot)
                else:
                    self._lru[key] = None

    def view(self, slot: int) -> memoryview:
        """Zero-copy view of a slot's stored bytes (valid while reserved or acquired)."""
        return memoryview(self.slab[slot, : self._slot_len[slot]])

    def get(self, key: BlockKey) -> bytes | None:
        """A copy of ``key``'s bytes, or None."""
        slot = self.acquire(key)
        if slot is None:
            return None
        try:
            return bytes(self.view(slot))
        finally:
            self.release(key)

    def read_into(self, key: BlockKey, out: BytesLike) -> int | None:
        """Copy ``key``'s bytes into ``out`` (no allocation); the byte count, or None."""
        slot = self.acquire(key)
        if slot is None:
            return None
        try:
            n = self._slot_len[slot]
            dst = np.frombuffer(out, dtype=np.uint8) if not isinstance(out, np.ndarray) \
                else out.reshape(-1).view(np.uint8)
            if dst.nbytes < n:
                raise ValueError(f"output buffer of {dst.nbytes} bytes < {n}")
            np.copyto(dst[:n], self.slab[slot, :n])
            return n
        finally:
            self.release(key)

    # ---------------------------------------------------------------- housekeeping
    def remove(self, key: BlockKey) -> bool:
        """Drop a committed entry now (a pinned slot is freed at its last release)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not entry.committed:
                return False
            del self._entries[key]
            self._c.removals += 1
            if entry.pins:
                self._doomed[key] = entry
            else:
                self._lru.pop(key, None)
                self._free.append(entry.slot)
            return True

    def keys(self) -> list[BlockKey]:
        """Committed keys, least recently used first (a snapshot)."""
        with self._lock:
            pinned = [k for k, e in self._entries.items() if e.committed and e.pins]
            return pinned + list(self._lru)

    def contains_many(self, keys: Iterable[BlockKey]) -> list[bool]:
        with self._lock:
            return [(e := self._entries.get(k)) is not None and e.committed for k in keys]

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if e.committed)

    def stats(self) -> dict[str, int | bool]:
        with self._lock:
            committed = sum(1 for e in self._entries.values() if e.committed)
            pinned = sum(1 for e in self._entries.values() if e.pins) + len(self._doomed)
            return {
                "num_slots": self.num_slots,
                "slot_bytes": self.slot_bytes,
                "entries": committed,
                "reserved": len(self._entries) - committed,
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
