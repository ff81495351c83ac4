"""A shared-memory slot arena: fixed-size slots in one file under ``/dev/shm``.

The storage under a host-wide CPU tier that many processes map at once and that outlives
them. It knows nothing of keys' meaning, of placement or of vLLM: a slot directory owned by
one process (which slot holds what, which slot a writer may take) lives elsewhere. This
module only makes every read *verifiable*: a reader names the slot and the (key digest,
save id) it expects, and gets the bytes of exactly that save or a miss, never a torn,
stale or reused slot's bytes.

Segment layout (little-endian, one file, ``mmap``'ed ``MAP_SHARED``)::

    [0, 4096)                      segment header (``_SEG``): magic, layout version,
                                   header sizes, num_slots, slot_bytes, slot_stride, size
    slot i at 4096 + i*slot_stride:
        [+0,  +64)                 slot header (``_SLOT_DTYPE``), one cache line:
            +0   seq      u64      seqlock counter: 0 never written, odd being written
            +8   save_id  u64      the writer's unique id for this save
            +16  key      16 B     the caller's key digest (e.g. blake2b-128 of its key)
            +32  length   u64      payload bytes in use (<= slot_bytes)
            +40  checksum u64      xxh3-64 of payload[:length] + key + save_id + length
            +48  flags    u32      1 = holds a committed save, 0 = empty or invalidated
            +52  reserved
        [+64, +64 + slot_bytes)    payload, 64-byte aligned; slot_stride =
                                   64 + slot_bytes rounded up to 64

Write protocol (one writer per slot at a time, which the slot directory guarantees):
``seq`` to odd, payload and fields, checksum, ``seq`` to even. Read protocol: ``seq``
even and non-zero, fields match, copy the payload out, ``seq`` unchanged, checksum of the
*copied* bytes matches. A writer killed mid-write leaves ``seq`` odd (a miss until the
slot is written again or invalidated).

Ordering: x86-64 keeps stores in program order and loads in program order (TSO), and each
field is one aligned 8-byte access, so the seqlock alone is sound there. Python cannot
issue memory fences, so on weakly ordered CPUs (aarch64) a reader might see the new ``seq``
before all new payload bytes; the checksum, computed over the copied bytes, is the
backstop there: a torn read then passes only on a 64-bit hash collision. That holds only
for bytes checked *after* they were copied: a check in place (:meth:`SharedSegment.
verify_many`) followed by a second read of the same memory (a load straight from the
segment) leans on the seqlock alone for the second read, so it is sound only where
:func:`seqlock_sound` says so; elsewhere a reader copies first and checks the copy.

The copy and its check are one pass over memory (:func:`_copy_checksum`): the payload is
copied in cache-sized chunks (``CHUNK_BYTES``), each chunk hashed from the destination
while it is still in cache, and the streamed xxh3-64 equals :func:`_checksum` of the
whole payload (xxh3's streaming form is the one-shot hash of the concatenation).
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import platform
import re
import stat
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from types import TracebackType

import numpy as np
import xxhash

from offload_tiers._types import BytesLike

MAGIC = b"KVTSHSEG"
LAYOUT_VERSION = 2  # 2: xxh3-64 checksums (1: crc32)
SEGMENT_HEADER_BYTES = 4096  # one page: slot 0 starts page-aligned
SLOT_HEADER_BYTES = 64
ALIGN = 64
DIGEST_BYTES = 16
_VALID = 1

#: magic, version, segment header bytes, slot header bytes, alignment, num_slots,
#: slot_bytes, slot_stride, total file size
_SEG = struct.Struct("<8sIIIIQQQQ")

_SLOT_DTYPE = np.dtype({
    "names": ["seq", "save_id", "key", "length", "checksum", "flags"],
    "formats": ["<u8", "<u8", ("u1", DIGEST_BYTES), "<u8", "<u8", "<u4"],
    "offsets": [0, 8, 16, 32, 40, 48],
    "itemsize": SLOT_HEADER_BYTES,
})
_META = struct.Struct("<QQ")  # save_id, length: bound into the checksum with the key
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")
_U64 = 1 << 64

#: Bytes copied, then hashed from the destination while still in cache, per step of a
#: checked read (:func:`_copy_checksum`): a core's L2 here (AMD EPYC, 1 MiB L2, 32 MiB L3).
#: Measured on 2 MiB slots against memcpy of the same bytes, same run: 256 KiB and 512 KiB
#: chunks ~0.8x, 1 MiB and 2 MiB ~0.95x (the hash of a chunk just copied runs at ~58 GB/s,
#: from memory ~29 GB/s; copies below 1 MiB ran slower per byte here: glibc picks its copy
#: loop by size).
CHUNK_BYTES = 1024 * 1024

#: CPUs whose memory model is TSO (loads in order, stores in order): the seqlock is sound.
TSO_MACHINES = frozenset({"x86_64", "amd64", "i386", "i486", "i586", "i686", "x86"})
#: ``1``: trust the seqlock (check in place, load straight from the segment); ``0``: copy
#: first and check the copy. Unset: :data:`TSO_MACHINES` decide (docs/connector.md).
SEQLOCK_ENV = "KVTIER_SEQLOCK_SOUND"


def seqlock_sound() -> bool:
    """Whether a check in place followed by a load straight from the segment is sound here:
    on a TSO CPU (x86-64) the seqlock catches a write that lands between them; on a weakly
    ordered one (aarch64: GH200, Graviton) it cannot be trusted without fences, so a reader
    copies the bytes out first and checks the copy (copy-then-checksum). ``KVTIER_SEQLOCK_SOUND``
    = ``0`` / ``1`` overrides the machine's answer (``0`` is always safe; ``1`` on a weakly
    ordered CPU is not)."""
    forced = os.environ.get(SEQLOCK_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return platform.machine().lower() in TSO_MACHINES


def default_path(name: str) -> str:
    """``/dev/shm/kvtier-<name>``; ``name`` is letters, digits, ``.``, ``_`` and ``-``."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"segment name {name!r} must match {_NAME.pattern}")
    return f"/dev/shm/kvtier-{name}"


def digest(key: bytes) -> bytes:
    """A 16-byte key digest (blake2b-128), for callers without one of their own."""
    return hashlib.blake2b(key, digest_size=DIGEST_BYTES).digest()


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _odd_after(seq: int) -> int:
    """The odd seq a write or invalidation moves ``seq`` to (an orphaned odd one skips on)."""
    return (seq + 1 if seq % 2 == 0 else seq + 2) % _U64


def _even_after(odd: int) -> int:
    """The even seq that publishes; never 0, which means "never written"."""
    return (odd + 1) % _U64 or 2


def _layout(num_slots: int, slot_bytes: int) -> tuple[int, int]:
    """(slot_stride, total file size)."""
    stride = SLOT_HEADER_BYTES + _round_up(slot_bytes, ALIGN)
    return stride, SEGMENT_HEADER_BYTES + num_slots * stride


def _checksum(payload: BytesLike, key: bytes, save_id: int, length: int) -> int:
    """xxh3-64 of the payload, continued over the key, save id and length.

    Not a cryptographic hash: the file is private to its user (0600), so the threat is
    torn, stale or corrupted bytes, not an adversary; a 64-bit hash misses a corruption
    with probability 2**-64. It sits on every save and every load: xxh3 runs ~29 GB/s here
    (zlib's crc32 ~4 GB/s, memcpy ~11 GB/s), so a verified read costs little more than
    the copy (``benchmarks/bench_host_tier.py``). Binding the fields means a payload read
    with another save's fields is caught too.
    """
    h = xxhash.xxh3_64(payload)
    h.update(_tail(key, save_id, length))
    return h.intdigest()


def _tail(key: bytes, save_id: int, length: int) -> bytes:
    """What :func:`_checksum` hashes after the payload: the key, then save id and length."""
    return bytes(key) + _META.pack(save_id, length)


def _copy_chunk(dst: memoryview | np.ndarray, src: memoryview | np.ndarray) -> None:
    """One copy of a checked read: a chunk of one slot (uint8 memoryviews), or the payloads
    of neighbouring slots into neighbouring rows (``[k, n]`` uint8 arrays, the source's rows
    strided over the slot headers). A seam: tests move the source under it."""
    dst[:] = src


def _neighbour_runs(todo: list[int], where: list[int], per: int) -> list[tuple[int, int]]:
    """``(first index, count)`` of each run of indexes in ``todo`` that step by one and
    whose slots ``where`` step by one too, at most ``per`` long."""
    runs: list[tuple[int, int]] = []
    for i in todo:
        if runs:
            first, k = runs[-1]
            if k < per and first + k == i and where[first] + k == where[i]:
                runs[-1] = (first, k + 1)
                continue
        runs.append((i, 1))
    return runs


def _copy_checksum(dst: memoryview, src: memoryview, tail: bytes) -> int:
    """Copy ``src`` into ``dst`` (uint8 memoryviews of one length) and return the xxh3-64 of
    the *copied* bytes followed by ``tail``: :func:`_checksum` of what ``dst`` now holds,
    in one pass over memory. Each ``CHUNK_BYTES`` chunk is hashed from the destination
    right after its copy, while it is still in cache, so the hash covers exactly the bytes
    the caller gets, whatever the source did meanwhile (copy-then-checksum)."""
    n = len(dst)
    if n <= CHUNK_BYTES:
        _copy_chunk(dst, src)
        h = xxhash.xxh3_64(dst)
    else:
        h = xxhash.xxh3_64()
        for start in range(0, n, CHUNK_BYTES):
            chunk = dst[start:start + CHUNK_BYTES]
            _copy_chunk(chunk, src[start:start + CHUNK_BYTES])
            h.update(chunk)
    h.update(tail)
    return h.intdigest()


@dataclass(slots=True)
class ReadCounters:
    """Outcomes of this handle's reads (per process, not shared through the segment)."""

    hits: int = 0
    empty: int = 0  # never written or invalidated
    torn: int = 0  # being written, writer died mid-write, or rewritten during the copy
    key_mismatch: int = 0  # slot reused by another key
    save_mismatch: int = 0  # same key, another save
    length: int = 0  # stored length out of range or not the caller's buffer size
    checksum: int = 0  # bytes do not match the committed checksum

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class SlotHeader:
    """A snapshot of one slot header (unsynchronised: for inspection, not for reads)."""

    seq: int
    save_id: int
    key: bytes
    length: int
    checksum: int
    flags: int


@dataclass(frozen=True, slots=True)
class ReadTicket:
    """What :meth:`SharedSegment.begin_read` saw; :meth:`SharedSegment.end_read` checks it."""

    slot: int
    seq: int
    key: bytes
    save_id: int
    length: int
    checksum: int


class SharedSegment:
    """A mapped shared-memory segment of ``num_slots`` slots of ``slot_bytes`` each.

    Readers are lock-free and may run in any number of processes. Writers must be one per
    slot at a time (the slot directory hands slots out); a write begun in one process and
    never committed leaves the slot a miss until it is written again or invalidated.
    """

    def __init__(self, path: str, mm: mmap.mmap, num_slots: int, slot_bytes: int) -> None:
        self.path = path
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.slot_stride, self.size = _layout(num_slots, slot_bytes)
        self.counters = ReadCounters()
        self._mm: mmap.mmap | None = mm
        hdr = np.ndarray((num_slots,), dtype=_SLOT_DTYPE, buffer=mm,
                         offset=SEGMENT_HEADER_BYTES, strides=(self.slot_stride,))
        self._seq = hdr["seq"]
        self._save = hdr["save_id"]
        self._key = hdr["key"]
        self._len = hdr["length"]
        self._crc = hdr["checksum"]
        self._flags = hdr["flags"]
        #: every slot's payload area: shape (num_slots, slot_bytes), strides
        #: (slot_stride, 1), so slot i's payload starts at byte
        #: ``payload_offset(i)`` of the file, 64-byte aligned; rows are contiguous, the
        #: array as a whole is not. Fancy indexing gathers (``payloads[idx]``) and
        #: scatters (``payloads[idx] = src``) many slots in one call; writes through it
        #: must sit between begin_write and commit_write, reads between begin_read and
        #: end_read. On CUDA a caller can register the whole mapping (``memory()``) as
        #: pinned host memory so device copies go straight to and from it; this module
        #: does not.
        self.payloads = np.ndarray((num_slots, slot_bytes), dtype=np.uint8, buffer=mm,
                                   offset=SEGMENT_HEADER_BYTES + SLOT_HEADER_BYTES,
                                   strides=(self.slot_stride, 1))
        self._rows = list(self.payloads)
        self._views = [memoryview(row) for row in self._rows]  # uint8, one per slot
        self._pending: dict[int, int] = {}  # slot -> odd seq of this handle's open write

    # ---------------------------------------------------------------- open / close
    @classmethod
    def create(cls, path: str, num_slots: int, slot_bytes: int, *,
               mode: int = 0o600) -> SharedSegment:
        """Create a new segment file at ``path`` (which must not exist) and map it.

        The file gets exactly ``mode`` (0600 by default: only this user can attach),
        whatever the umask. Its memory is reserved up front (``posix_fallocate``), so a
        full ``/dev/shm`` fails here with ``OSError`` rather than with SIGBUS later.
        """
        if num_slots < 1 or slot_bytes < 1:
            raise ValueError(f"need num_slots >= 1 and slot_bytes >= 1, got "
                             f"{num_slots} and {slot_bytes}")
        stride, size = _layout(num_slots, slot_bytes)
        mm = map_new_file(path, size, mode)
        # the magic goes in last: an attach racing the creation sees a foreign file
        _SEG.pack_into(mm, 0, b"\0" * 8, LAYOUT_VERSION, SEGMENT_HEADER_BYTES,
                       SLOT_HEADER_BYTES, ALIGN, num_slots, slot_bytes, stride, size)
        mm[0:8] = MAGIC
        return cls(path, mm, num_slots, slot_bytes)

    @classmethod
    def attach(cls, path: str) -> SharedSegment:
        """Map an existing segment; ``ValueError`` naming the problem when it is not one
        this code can read (foreign file, other layout version, truncated file)."""
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{path}: not a regular file")
            if st.st_size < _SEG.size:
                raise ValueError(f"{path}: truncated: {st.st_size} bytes, smaller than the "
                                 f"segment header ({_SEG.size} bytes)")
            raw = os.pread(fd, _SEG.size, 0)
            (magic, version, seg_hdr, slot_hdr, align, num_slots, slot_bytes, stride,
             size) = _SEG.unpack(raw)
            if magic != MAGIC:
                raise ValueError(f"{path}: not a kvtier shared segment (magic {magic!r}, "
                                 f"expected {MAGIC!r})")
            if version != LAYOUT_VERSION:
                raise ValueError(f"{path}: layout version {version}, this kvtier reads "
                                 f"version {LAYOUT_VERSION}")
            if (seg_hdr, slot_hdr, align) != (SEGMENT_HEADER_BYTES, SLOT_HEADER_BYTES, ALIGN):
                raise ValueError(f"{path}: header sizes/alignment {(seg_hdr, slot_hdr, align)}"
                                 f", expected {(SEGMENT_HEADER_BYTES, SLOT_HEADER_BYTES, ALIGN)}")
            if num_slots < 1 or slot_bytes < 1 or (stride, size) != _layout(num_slots,
                                                                             slot_bytes):
                raise ValueError(f"{path}: inconsistent header (num_slots={num_slots}, "
                                 f"slot_bytes={slot_bytes}, stride={stride}, size={size})")
            if st.st_size < size:
                raise ValueError(f"{path}: truncated: {st.st_size} bytes, the layout needs "
                                 f"{size}")
            if st.st_size != size:
                raise ValueError(f"{path}: {st.st_size} bytes, the layout says {size}")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(path, mm, num_slots, slot_bytes)

    def advise_huge_pages(self) -> str:
        """Ask the kernel to back the mapping with transparent huge pages; the kernel's
        setting for shared memory (``shmem_enabled``: ``advise`` or ``always`` honour it,
        ``never`` does not), or why it could not be asked."""
        assert self._mm is not None
        try:
            self._mm.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError) as exc:
            return f"unavailable ({exc})"
        try:
            with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as fh:
                setting = fh.read().split("[", 1)[1].split("]", 1)[0]
        except (OSError, IndexError):
            return "unknown"
        return setting

    def memory(self) -> np.ndarray:
        """The whole mapping as one uint8 array (a view: it keeps the mapping alive), e.g.
        to register it with CUDA as page-locked memory."""
        assert self._mm is not None
        return np.ndarray((self.size,), dtype=np.uint8, buffer=self._mm)

    @property
    def closed(self) -> bool:
        return self._mm is None

    def close(self) -> None:
        """Unmap (idempotent). Views handed out (``payloads``, ``begin_write``'s) keep the
        mapping alive until they are dropped; do not use them after close."""
        mm, self._mm = self._mm, None
        if mm is None:
            return
        del self._seq, self._save, self._key, self._len, self._crc, self._flags
        del self.payloads, self._rows, self._views
        with contextlib.suppress(BufferError):  # outside views still hold it
            mm.close()

    def unlink(self) -> None:
        """Remove the file's name (attached processes keep their mapping); no-op when gone."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def __enter__(self) -> SharedSegment:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ---------------------------------------------------------------- layout
    def header_offset(self, slot: int) -> int:
        """Byte offset of ``slot``'s header in the file."""
        self._check_slot(slot)
        return SEGMENT_HEADER_BYTES + slot * self.slot_stride

    def payload_offset(self, slot: int) -> int:
        """Byte offset of ``slot``'s payload in the file (a multiple of 64)."""
        return self.header_offset(slot) + SLOT_HEADER_BYTES

    def header(self, slot: int) -> SlotHeader:
        self._check_slot(slot)
        return SlotHeader(int(self._seq[slot]), int(self._save[slot]),
                          self._key[slot].tobytes(), int(self._len[slot]),
                          int(self._crc[slot]), int(self._flags[slot]))

    def _check_slot(self, slot: int) -> None:
        if self._mm is None:
            raise ValueError(f"{self.path}: segment is closed")
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")

    # ---------------------------------------------------------------- writer
    def begin_write(self, slot: int) -> np.ndarray:
        """Mark ``slot`` as being written (readers miss it from now on) and return its
        whole payload area (``slot_bytes`` uint8, writable); then ``commit_write``."""
        self._check_slot(slot)
        odd = _odd_after(int(self._seq[slot]))
        self._seq[slot] = odd
        self._pending[slot] = odd
        return self._rows[slot]

    def commit_write(self, slot: int, key_digest: bytes, save_id: int, length: int) -> None:
        """Publish the first ``length`` payload bytes as save ``save_id`` of ``key_digest``."""
        self._check_slot(slot)
        key = _check_digest(key_digest)
        _check_save_id(save_id)
        if not 0 <= length <= self.slot_bytes:
            raise ValueError(f"length {length} out of range [0, {self.slot_bytes}]")
        odd = self._pending.get(slot)
        if odd is None:
            raise RuntimeError(f"slot {slot}: commit_write without begin_write")
        if int(self._seq[slot]) != odd:
            del self._pending[slot]
            raise RuntimeError(f"slot {slot}: another writer took the slot during this write")
        crc = _checksum(self._rows[slot][:length], key, save_id, length)
        self._save[slot] = save_id
        self._key[slot] = np.frombuffer(key, dtype=np.uint8)
        self._len[slot] = length
        self._flags[slot] = _VALID
        self._crc[slot] = crc
        self._seq[slot] = _even_after(odd)
        del self._pending[slot]

    def write(self, slot: int, key_digest: bytes, save_id: int, payload: BytesLike) -> None:
        """One-shot ``begin_write``, copy, ``commit_write``."""
        src = _as_u8(payload)
        if src.nbytes > self.slot_bytes:
            raise ValueError(f"{src.nbytes} bytes do not fit a slot of {self.slot_bytes}")
        _check_digest(key_digest)
        _check_save_id(save_id)
        row = self.begin_write(slot)
        try:
            row[: src.nbytes] = src
        except BaseException:
            self.invalidate(slot)
            raise
        self.commit_write(slot, key_digest, save_id, src.nbytes)

    def invalidate(self, slot: int) -> None:
        """Empty ``slot`` (also ends a write begun and never committed)."""
        self._check_slot(slot)
        odd = _odd_after(int(self._seq[slot]))
        self._seq[slot] = odd
        self._flags[slot] = 0
        self._save[slot] = 0
        self._key[slot] = 0
        self._len[slot] = 0
        self._crc[slot] = 0
        self._seq[slot] = _even_after(odd)
        self._pending.pop(slot, None)

    # ---------------------------------------------------------------- reader
    def begin_read(self, slot: int, key_digest: bytes, save_id: int) -> ReadTicket | None:
        """Check that ``slot`` holds save ``save_id`` of ``key_digest`` right now; None (a
        counted miss) otherwise. Copy ``payloads[slot, :ticket.length]`` out, then call
        ``end_read`` on the copy: only then are the bytes known good."""
        self._check_slot(slot)
        c = self.counters
        seq = int(self._seq[slot])
        if seq % 2:
            c.torn += 1
            return None
        flags = int(self._flags[slot])
        key = self._key[slot].tobytes()
        saved = int(self._save[slot])
        length = int(self._len[slot])
        crc = int(self._crc[slot])
        if int(self._seq[slot]) != seq:
            c.torn += 1
            return None
        if seq == 0 or flags != _VALID:
            c.empty += 1
            return None
        if key != key_digest:
            c.key_mismatch += 1
            return None
        if saved != save_id:
            c.save_mismatch += 1
            return None
        if length > self.slot_bytes:
            c.length += 1
            return None
        return ReadTicket(slot, seq, key, saved, length, crc)

    def end_read(self, ticket: ReadTicket, copied: BytesLike) -> bool:
        """True when ``copied`` (the bytes copied out after ``begin_read``) are exactly
        the save the ticket names: no write touched the slot meanwhile, checksum equal."""
        self._check_slot(ticket.slot)
        c = self.counters
        if int(self._seq[ticket.slot]) != ticket.seq:
            c.torn += 1
            return False
        data = _as_u8(copied)
        if data.nbytes != ticket.length:
            c.length += 1
            return False
        if _checksum(data, ticket.key, ticket.save_id, ticket.length) != ticket.checksum:
            c.checksum += 1
            return False
        c.hits += 1
        return True

    def read_into(self, slot: int, key_digest: bytes, save_id: int, out: BytesLike) -> bool:
        """Copy the save into ``out``, whose size must equal the stored length; False (a
        counted miss, ``out`` contents unspecified) for anything but that exact save."""
        if isinstance(out, np.ndarray) and not out.flags.c_contiguous:
            raise ValueError("out must be a contiguous buffer")
        dst = _as_u8(out)
        if not dst.flags.writeable:
            raise ValueError("out must be writable")
        ticket = self.begin_read(slot, key_digest, save_id)
        if ticket is None:
            return False
        if ticket.length != dst.nbytes:
            self.counters.length += 1
            return False
        got = _copy_checksum(memoryview(dst), self._views[slot][: ticket.length],
                             _tail(ticket.key, ticket.save_id, ticket.length))
        c = self.counters
        if int(self._seq[slot]) != ticket.seq:
            c.torn += 1
            return False
        if got != ticket.checksum:
            c.checksum += 1
            return False
        c.hits += 1
        return True

    def read_many_into(self, slots: Sequence[int], key_digests: Sequence[bytes],
                       save_ids: Sequence[int], outs: Sequence[np.ndarray]) -> list[bool]:
        """:meth:`read_into` for many slots at once (the header checks vectorized): per
        slot, True when its ``out`` (contiguous, writable, exactly the stored length) now
        holds exactly that save. ``outs`` may be one array of rows (2-D: its rows the
        outs). Each slot is copied and checked in one pass, the check over the copied bytes
        (:func:`_copy_checksum`); into one array of rows, slots that lie side by side in the
        segment and in ``outs`` are copied up to ``CHUNK_BYTES`` at a time, then each row
        hashed from the copy. A slot listed twice is read twice."""
        if len(outs) != len(slots):
            raise ValueError("slots, key_digests, save_ids and outs differ in length")
        flat: memoryview | None = None
        if isinstance(outs, np.ndarray):  # one array, its rows the outs: no view per row
            if outs.ndim < 2 or not (outs.flags.c_contiguous and outs.flags.writeable):
                raise ValueError("outs must be a contiguous, writable array of rows")
            sizes = [outs.nbytes // len(outs) if len(outs) else 0] * len(outs)
            flat = memoryview(outs.reshape(-1).view(np.uint8))
        elif not all(o.flags.c_contiguous and o.flags.writeable for o in outs):
            raise ValueError("every out must be a contiguous, writable array")
        else:
            sizes = [o.nbytes for o in outs]
        checked = self._check_headers(slots, key_digests, save_ids, sizes)
        if checked is None:
            return []
        idx, seq, ok, crcs = checked
        sums_ok = [False] * len(sizes)
        views, where, want = self._views, idx.tolist(), crcs.tolist()
        pack, xxh3, copy = _META.pack, xxhash.xxh3_64, _copy_chunk
        full = self.slot_bytes
        todo = np.flatnonzero(ok).tolist()
        per = 1  # rows per copy: neighbouring slots into neighbouring rows, a chunk at most
        rows: np.ndarray | None = None
        if flat is not None and 0 < sizes[0] <= CHUNK_BYTES // 2:
            per = CHUNK_BYTES // sizes[0]
            rows = np.asarray(outs).reshape(len(outs), -1).view(np.uint8)
        for i, k in _neighbour_runs(todo, where, per):
            n = sizes[i]
            if k > 1:  # one copy of k slots (rows skip the headers), then each row's hash
                assert rows is not None and flat is not None
                copy(rows[i:i + k], self.payloads[where[i]:where[i] + k, :n])
                for r in range(i, i + k):
                    h = xxh3(flat[r * n:(r + 1) * n])
                    h.update(key_digests[r])
                    h.update(pack(save_ids[r], n))
                    sums_ok[r] = h.intdigest() == want[r]
                continue
            dst = memoryview(outs[i]).cast("B") if flat is None else flat[i * n:(i + 1) * n]
            src = views[where[i]] if n == full else views[where[i]][:n]
            if n <= CHUNK_BYTES:  # _copy_checksum's one-chunk case, without its calls
                copy(dst, src)
                h = xxh3(dst)
                h.update(key_digests[i])
                h.update(pack(save_ids[i], n))
                sums_ok[i] = h.intdigest() == want[i]
            else:
                sums_ok[i] = _copy_checksum(dst, src, _tail(key_digests[i], save_ids[i],
                                                            n)) == want[i]
        return self._settle(idx, seq, ok, np.array(sums_ok, dtype=bool))

    def verify_many(self, slots: Sequence[int], key_digests: Sequence[bytes],
                    save_ids: Sequence[int], lengths: Sequence[int]) -> list[int | None]:
        """Check, in place, that each slot holds exactly that save of ``lengths[i]`` bytes
        (header, and the checksum of the bytes where they lie): per slot the ``seq`` it was
        checked at, or None (a counted miss). For a reader that then copies straight out
        of ``payloads`` while the slot cannot be reused under it (the slot directory's
        pins): after the copy, :meth:`unchanged` says no write began since the check."""
        checked = self._check_headers(slots, key_digests, save_ids, lengths)
        if checked is None:
            return []
        idx, seq, ok, crcs = checked
        views, where, want = self._views, idx.tolist(), crcs.tolist()
        sums_ok = np.zeros(len(where), dtype=bool)
        for i in np.flatnonzero(ok).tolist():
            n = int(lengths[i])
            sums_ok[i] = _checksum(views[where[i]][:n], key_digests[i], int(save_ids[i]),
                                   n) == want[i]
        good = self._settle(idx, seq, ok, sums_ok)
        return [int(seq[i]) if g else None for i, g in enumerate(good)]

    def unchanged(self, slots: Sequence[int], seqs: Sequence[int]) -> list[bool]:
        """Per slot: no write or invalidation began since :meth:`verify_many` gave ``seq``
        (a False is counted torn)."""
        now = self._seq[np.asarray(slots, dtype=np.int64)]
        same = [int(a) == int(b) for a, b in zip(now, seqs, strict=True)]
        self.counters.torn += same.count(False)
        return same

    def _check_headers(self, slots: Sequence[int], key_digests: Sequence[bytes],
                       save_ids: Sequence[int], lengths: Sequence[int]
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """The vectorized header half of a batched read: (slot indexes, seqs seen, which
        slots hold exactly that save of that length now, their checksums); the misses
        counted. None for an empty batch."""
        n = len(slots)
        if not (n == len(key_digests) == len(save_ids) == len(lengths)):
            raise ValueError("slots, key_digests, save_ids and outs differ in length")
        if n == 0:
            return None
        if self._mm is None:
            raise ValueError(f"{self.path}: segment is closed")
        idx = np.asarray(slots, dtype=np.int64)
        if idx.min() < 0 or idx.max() >= self.num_slots:
            raise IndexError(f"a slot of {slots} is out of range [0, {self.num_slots})")
        if set(map(len, key_digests)) != {DIGEST_BYTES}:
            for k in key_digests:
                _check_digest(k)  # raises, naming the length
        want_keys = np.frombuffer(b"".join(key_digests), dtype=np.uint64).reshape(n, 2)
        want_saves = np.asarray(save_ids, dtype=np.uint64)
        sizes = np.asarray(lengths, dtype=np.uint64)
        seq = self._seq[idx]
        flags = self._flags[idx]
        stored = self._len[idx]
        crcs = self._crc[idx]
        keys_equal = (self._key[idx].view(np.uint64) == want_keys).all(axis=1)
        saves_equal = self._save[idx] == want_saves
        c = self.counters
        torn = seq % 2 == 1
        empty = ~torn & ((seq == 0) | (flags != _VALID))
        rest = ~torn & ~empty
        c.torn += int(np.count_nonzero(torn))
        c.empty += int(np.count_nonzero(empty))
        c.key_mismatch += int(np.count_nonzero(rest & ~keys_equal))
        c.save_mismatch += int(np.count_nonzero(rest & keys_equal & ~saves_equal))
        c.length += int(np.count_nonzero(rest & keys_equal & saves_equal & (stored != sizes)))
        return idx, seq, rest & keys_equal & saves_equal & (stored == sizes), crcs

    def _settle(self, idx: np.ndarray, seq: np.ndarray, ok: np.ndarray,
                sums_ok: np.ndarray) -> list[bool]:
        """Per slot: its header held (``ok``), no write began meanwhile (its seq
        unchanged) and its checksum matched; the misses counted."""
        rewritten = ok & (self._seq[idx] != seq)  # a write touched the slot meanwhile
        held = ok & ~rewritten
        good = held & sums_ok
        c = self.counters
        c.torn += int(np.count_nonzero(rewritten))
        c.checksum += int(np.count_nonzero(held & ~sums_ok))
        c.hits += int(np.count_nonzero(good))
        return good.tolist()

    def read(self, slot: int, key_digest: bytes, save_id: int) -> bytes | None:
        """A copy of the save's bytes, or None (a counted miss)."""
        ticket = self.begin_read(slot, key_digest, save_id)
        if ticket is None:
            return None
        data = self._rows[slot][: ticket.length].tobytes()
        return data if self.end_read(ticket, data) else None


def map_new_file(path: str, size: int, mode: int) -> mmap.mmap:
    """Create ``path`` (which must not exist) with exactly ``mode`` whatever the umask,
    reserve ``size`` bytes of memory for it (a full ``/dev/shm`` fails here with ``OSError``,
    not with SIGBUS later) and map it shared, read-write; the file is removed on failure."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)


def _check_digest(key_digest: bytes) -> bytes:
    key = bytes(key_digest)
    if len(key) != DIGEST_BYTES:
        raise ValueError(f"key digest must be {DIGEST_BYTES} bytes, got {len(key)}")
    return key


def _check_save_id(save_id: int) -> None:
    if not 0 <= save_id < _U64:
        raise ValueError(f"save_id {save_id} is not a uint64")


def _as_u8(data: BytesLike) -> np.ndarray:
    """A flat uint8 view of ``data`` (no copy when it is contiguous; writable if it is)."""
    if isinstance(data, np.ndarray):
        if data.dtype == np.uint8 and data.ndim == 1 and data.flags.c_contiguous:
            return data
        if data.flags.c_contiguous:
            return data.reshape(-1).view(np.uint8)
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)
