"""Which keys a store may hold, answered in memory: a bounded, rotating Bloom filter.

A reader asks the filter before it asks the store. "Absent" is answered at once and is
wrong only for a key the filter never learned of (or forgot: it keeps at least the last
``capacity`` keys added), which costs the reader a miss, never a wrong value. "Maybe present"
is wrong with probability at most ``fp_rate`` while each generation holds no more than
``capacity`` keys; the store's own answer then settles it. Keys removed from the store
(eviction, TTL, FLUSHALL, a restart) stay "maybe present": the filter never claims absence
for something it was told of within its window.

Keys are 64-bit digests of the store's key names (:func:`name_digest`), so a filter can be
fed by any process that sees the names. Size: two generations of
``ceil(-capacity * ln(fp_rate / 2) / ln(2)^2)`` bits each; at the defaults (2^20 keys, 1 %),
2 x 1.45 MB (2.9 MB). Not thread-safe: one thread owns a filter.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

__all__ = ["DIGEST_BYTES", "PresenceFilter", "name_digest", "pack_digests", "unpack_digests"]

#: Bytes of one key-name digest (little-endian ``uint64`` when packed).
DIGEST_BYTES = 8


def name_digest(name: bytes) -> int:
    """The 64-bit digest of a key name (the unit of presence)."""
    return int.from_bytes(hashlib.blake2b(name, digest_size=DIGEST_BYTES).digest(), "little")


def pack_digests(digests: list[int]) -> bytes:
    """Digests as a compact byte string (``uint64`` little-endian each)."""
    return np.asarray(digests, dtype="<u8").tobytes()


def unpack_digests(data: bytes) -> np.ndarray:
    """The inverse of :func:`pack_digests`; trailing bytes that are not a whole digest raise."""
    if len(data) % DIGEST_BYTES:
        raise ValueError(f"{len(data)} bytes is not a whole number of {DIGEST_BYTES}-byte "
                         "digests")
    return np.frombuffer(data, dtype="<u8")


class PresenceFilter:
    """A Bloom filter in two generations: the newest keys are always remembered, the oldest
    are forgotten once a generation fills (so memory and the false-positive rate stay bounded
    however many keys pass through)."""

    def __init__(self, capacity: int = 1 << 20, fp_rate: float = 0.01) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if not 0 < fp_rate < 1:
            raise ValueError(f"fp_rate must be within (0, 1), got {fp_rate}")
        self.capacity = capacity
        self.fp_rate = fp_rate
        per_generation = fp_rate / 2  # a key is looked for in both generations
        bits = math.ceil(-capacity * math.log(per_generation) / math.log(2) ** 2)
        self.num_bits = max(64, (bits + 63) // 64 * 64)
        self.num_hashes = max(1, round(self.num_bits / capacity * math.log(2)))
        self._current = np.zeros(self.num_bits // 8, dtype=np.uint8)
        self._previous = np.zeros_like(self._current)
        self._count = 0  # keys added to the current generation
        self.added = 0
        self.rotations = 0

    @property
    def memory_bytes(self) -> int:
        return self._current.nbytes + self._previous.nbytes

    def _positions(self, digests: np.ndarray) -> np.ndarray:
        """Bit positions, one row per digest (double hashing over the digest's halves)."""
        d = np.asarray(digests, dtype=np.uint64).reshape(-1, 1)
        h1 = d & np.uint64(0xFFFFFFFF)
        h2 = (d >> np.uint64(32)) | np.uint64(1)
        steps = np.arange(self.num_hashes, dtype=np.uint64).reshape(1, -1)
        return (h1 + steps * h2) % np.uint64(self.num_bits)

    def add_many(self, digests: np.ndarray | list[int]) -> None:
        """Remember ``digests`` (rotating generations as the current one fills)."""
        arr = np.asarray(digests, dtype=np.uint64).reshape(-1)
        start = 0
        while start < len(arr):
            room = self.capacity - self._count
            if room <= 0:
                self._previous, self._current = self._current, self._previous
                self._current[:] = 0
                self._count = 0
                self.rotations += 1
                continue
            chunk = arr[start:start + room]
            pos = self._positions(chunk).reshape(-1)
            np.bitwise_or.at(self._current, (pos >> np.uint64(3)).astype(np.intp),
                             (np.uint8(1) << (pos & np.uint64(7)).astype(np.uint8)))
            self._count += len(chunk)
            self.added += len(chunk)
            start += len(chunk)

    def add(self, digest: int) -> None:
        self.add_many([digest])

    def may_contain_many(self, digests: np.ndarray | list[int]) -> np.ndarray:
        """One bool per digest: False = certainly never added within the window."""
        arr = np.asarray(digests, dtype=np.uint64).reshape(-1)
        if not len(arr):
            return np.zeros(0, dtype=bool)
        pos = self._positions(arr)
        byte = (pos >> np.uint64(3)).astype(np.intp)
        mask = np.uint8(1) << (pos & np.uint64(7)).astype(np.uint8)
        in_current = ((self._current[byte] & mask) != 0).all(axis=1)
        in_previous = ((self._previous[byte] & mask) != 0).all(axis=1)
        return in_current | in_previous

    def may_contain(self, digest: int) -> bool:
        return bool(self.may_contain_many([digest])[0])

    def stats(self) -> dict[str, int | float]:
        return {"capacity": self.capacity, "fp_rate": self.fp_rate,
                "memory_bytes": self.memory_bytes, "num_hashes": self.num_hashes,
                "added": self.added, "rotations": self.rotations,
                "current_generation": self._count}
