"""Which keys a store may hold, answered in memory: a bounded, rotating Bloom filter.

A reader asks the filter before it asks the store. "Absent" is answered at once and is
wrong only for a key the filter never learned of (or forgot: it keeps at least the last
``capacity`` keys added), which costs the reader a miss, never a wrong value. "Maybe present"
is wrong with probability at most ``fp_rate`` while each generation holds no more than
``capacity`` keys; the store's own answer then settles it. Keys removed from the store
(eviction, TTL, FLUSHALL, a restart) stay "maybe present": the filter never claims absence
for something it was told of within its window.

Keys are 64-bit digests of the store's key names (:func:`name_digest`), so a filter can be
fed by any process that sees the names. Size: two generations of the fewest 64-byte blocks
that keep ``capacity`` keys at ``fp_rate / 2`` (:func:`blocks_for`); at the defaults (2^20
keys, 1 %), 2 x 1.52 MB (3.0 MB). Not thread-safe: one thread owns a filter.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

__all__ = ["DIGEST_BYTES", "PresenceFilter", "block_false_positive_rate", "blocks_for",
           "name_digest", "pack_digests", "unpack_digests"]

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


#: Bits of one filter block: one cache line, 8 words of 64 bits, one bit of a key in each.
BLOCK_BITS = 512
_WORDS = BLOCK_BITS // 64
#: Odd multipliers that derive a key's bit in each word from its digest's low half.
_SALTS = np.array([0x47B6137B, 0x44974D91, 0x8824AD5B, 0xA2B7289D,
                   0x705495C7, 0x2DF1424B, 0x9EFC4947, 0x5C6BFB31], dtype=np.uint64)
_LOW32 = np.uint64(0xFFFFFFFF)
#: (shift, salt) per word: where each word's bit sits in a block read as one 512-bit integer.
_WORD_SALTS = tuple((64 * i, int(s)) for i, s in enumerate(_SALTS))


def block_false_positive_rate(keys_per_block: float) -> float:
    """The chance that a key never added reads "maybe" in a split-block filter whose blocks
    hold ``keys_per_block`` keys on average (Poisson over blocks; one bit per 64-bit word)."""
    lam = keys_per_block
    p, rate, i = math.exp(-lam), 0.0, 0
    while i < lam + 20 * math.sqrt(lam) + 50:
        rate += p * (1 - (1 - 1 / 64) ** i) ** _WORDS
        i += 1
        p *= lam / i
    return rate


def blocks_for(capacity: int, fp_rate: float) -> int:
    """The fewest blocks that keep ``capacity`` keys at or under ``fp_rate``."""
    lo, hi = 1, max(1, capacity)
    while block_false_positive_rate(capacity / hi) > fp_rate:
        hi *= 2
    while lo < hi:
        mid = (lo + hi) // 2
        if block_false_positive_rate(capacity / mid) <= fp_rate:
            hi = mid
        else:
            lo = mid + 1
    return lo


class PresenceFilter:
    """A split-block Bloom filter in two generations: the newest keys are always
    remembered, the oldest are forgotten once a generation fills (so memory and the
    false-positive rate stay bounded however many keys pass through).

    A key's 8 bits lie in one 64-byte block (one bit in each of its 8 words), so adding or
    asking costs one cache line per generation, not 8 scattered ones: the filter is read
    on the scheduler's look-up path, where scattered reads over megabytes cost ~5 us a key.
    """

    def __init__(self, capacity: int = 1 << 20, fp_rate: float = 0.01) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if not 0 < fp_rate < 1:
            raise ValueError(f"fp_rate must be within (0, 1), got {fp_rate}")
        self.capacity = capacity
        self.fp_rate = fp_rate
        # a key is looked for in both generations
        self.num_blocks = blocks_for(capacity, fp_rate / 2)
        self.num_bits = self.num_blocks * BLOCK_BITS
        self.num_hashes = _WORDS
        # Written once here, so every page is resident before the first look-up (a lazily
        # mapped page faults on its first read or write, on the look-up's path).
        self._current = np.empty(self.num_blocks * _WORDS, dtype="<u8")
        self._current.fill(0)
        self._previous = self._current.copy()
        self._bytes = (memoryview(self._current).cast("B"), memoryview(self._previous).cast("B"))
        self._count = 0  # keys added to the current generation
        self.added = 0
        self.rotations = 0

    @property
    def memory_bytes(self) -> int:
        return self._current.nbytes + self._previous.nbytes

    def _words_and_masks(self, digests: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per digest: the indexes of its block's 8 words and the bit it sets in each."""
        d = np.asarray(digests, dtype=np.uint64).reshape(-1, 1)
        block = ((d >> np.uint64(32)) * np.uint64(self.num_blocks)) >> np.uint64(32)
        words = (block * np.uint64(_WORDS) + np.arange(_WORDS, dtype=np.uint64)).astype(np.intp)
        bits = (((d & _LOW32) * _SALTS) & _LOW32) >> np.uint64(26)
        return words, np.left_shift(np.uint64(1), bits)

    def add_many(self, digests: np.ndarray | list[int]) -> None:
        """Remember ``digests`` (rotating generations as the current one fills)."""
        arr = np.asarray(digests, dtype=np.uint64).reshape(-1)
        start = 0
        while start < len(arr):
            room = self.capacity - self._count
            if room <= 0:
                self._previous, self._current = self._current, self._previous
                self._bytes = self._bytes[::-1]
                self._current[:] = 0
                self._count = 0
                self.rotations += 1
                continue
            chunk = arr[start:start + room]
            words, masks = self._words_and_masks(chunk)
            np.bitwise_or.at(self._current, words.reshape(-1), masks.reshape(-1))
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
        words, masks = self._words_and_masks(arr)
        in_current = ((self._current[words] & masks) == masks).all(axis=1)
        in_previous = ((self._previous[words] & masks) == masks).all(axis=1)
        return in_current | in_previous

    def may_contain(self, digest: int) -> bool:
        """One digest, in plain integers (a look-up that asks one key at a time pays no
        array set-up): the same answer as :meth:`may_contain_many`."""
        start = (((digest >> 32) * self.num_blocks) >> 32) * (BLOCK_BITS // 8)
        low = digest & 0xFFFFFFFF
        mask = 0
        for shift, salt in _WORD_SALTS:
            mask |= 1 << (shift + (((low * salt) & 0xFFFFFFFF) >> 26))
        end = start + BLOCK_BITS // 8
        return any(int.from_bytes(block[start:end], "little") & mask == mask
                   for block in self._bytes)

    def stats(self) -> dict[str, int | float]:
        return {"capacity": self.capacity, "fp_rate": self.fp_rate,
                "memory_bytes": self.memory_bytes, "num_hashes": self.num_hashes,
                "added": self.added, "rotations": self.rotations,
                "current_generation": self._count}
