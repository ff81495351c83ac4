"""Per-client pin counters in shared memory: a slot a client is loading is not reused.

One file under ``/dev/shm`` (mode 0600 by default), a ``uint32`` matrix of
``rows x num_slots``: the owner (the daemon) hands each attached client one row; a client
counts its own pins in its row only, so no two processes ever write one counter. The owner
reads a slot's column before it reuses the slot and zeroes a row when its client is gone.

Pins are the fast path, not the guarantee: a client pins and then checks the slot header
while the owner invalidates and then reads the pins, and without fences both may see the
old values. The slot's seqlock and checksum (:mod:`offload_tiers.shared_segment`) turn
that rare race into a failed read, never wrong bytes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import struct
from collections.abc import Callable, Iterable

import numpy as np

from offload_tiers.shared_segment import map_new_file

MAGIC = b"KVTPINS1"
_HEADER = struct.Struct("<8sQQ")  # magic, rows, num_slots
HEADER_BYTES = 64


class PinTable:
    """``rows x num_slots`` pin counters mapped from a shared file."""

    def __init__(self, path: str, mm: mmap.mmap, rows: int, num_slots: int) -> None:
        self.path = path
        self.rows = rows
        self.num_slots = num_slots
        self._mm: mmap.mmap | None = mm
        self.counts = np.ndarray((rows, num_slots), dtype=np.uint32, buffer=mm,
                                 offset=HEADER_BYTES)

    @staticmethod
    def _size(rows: int, num_slots: int) -> int:
        return HEADER_BYTES + rows * num_slots * 4

    @classmethod
    def create(cls, path: str, rows: int, num_slots: int, *, mode: int = 0o600) -> PinTable:
        """A new zeroed table at ``path`` (which must not exist), exactly ``mode``."""
        if rows < 1 or num_slots < 1:
            raise ValueError(f"need rows >= 1 and num_slots >= 1, got {rows} and {num_slots}")
        mm = map_new_file(path, cls._size(rows, num_slots), mode)
        _HEADER.pack_into(mm, 0, MAGIC, rows, num_slots)
        return cls(path, mm, rows, num_slots)

    @classmethod
    def attach(cls, path: str, *,
               check: Callable[[int, str], object] | None = None) -> PinTable:
        """Map an existing table; ``ValueError`` naming the problem for anything else.
        ``check(fd, path)`` vets the opened file before it is read or mapped (raises to
        refuse it): the file checked is the file mapped."""
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            if check is not None:
                check(fd, path)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < HEADER_BYTES:
                raise ValueError(f"{path}: not a kvtier pin table (size {st.st_size})")
            magic, rows, num_slots = _HEADER.unpack(os.pread(fd, _HEADER.size, 0))
            if magic != MAGIC:
                raise ValueError(f"{path}: not a kvtier pin table (magic {magic!r})")
            if rows < 1 or num_slots < 1 or st.st_size != cls._size(rows, num_slots):
                raise ValueError(f"{path}: {st.st_size} bytes do not hold {rows} x "
                                 f"{num_slots} pins")
            mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(path, mm, rows, num_slots)

    def close(self) -> None:
        mm, self._mm = self._mm, None
        if mm is None:
            return
        del self.counts
        with contextlib.suppress(BufferError):
            mm.close()

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    # ------------------------------------------------------------ a client's row
    def pin(self, row: int, slots: Iterable[int]) -> None:
        """Count one pin of each slot in ``row`` (a slot listed twice is pinned twice)."""
        idx = np.fromiter(slots, dtype=np.int64)
        np.add.at(self.counts[row], idx, 1)

    def unpin(self, row: int, slots: Iterable[int]) -> None:
        """Drop one pin of each slot in ``row``; never below zero."""
        counts = self.counts[row]
        for slot in slots:
            if counts[slot]:
                counts[slot] -= 1

    # ------------------------------------------------------------ the owner
    def pinned(self, slot: int) -> bool:
        """Whether any client holds a pin on ``slot``."""
        return bool(self.counts[:, slot].any())

    def clear_row(self, row: int) -> int:
        """Zero ``row`` (its client is gone); the number of pins it held."""
        held = int(self.counts[row].sum())
        self.counts[row] = 0
        return held
