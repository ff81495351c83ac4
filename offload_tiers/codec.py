"""The stored value format: one fixed 64-byte header followed by the raw payload bytes.

Header (little-endian)::

    magic       4s   b"KVTB"
    version     u16  VALUE_VERSION
    kind        u8   BlockKind (FULL / PARTIAL)
    reserved    u8   0
    digest      16s  Namespace.digest (bytes.fromhex(BlockKey.fingerprint))
    group       u32  KV-cache group index
    num_tokens  u64  cumulative tokens the block hash covers
    hash_tag    u64  xxh3_64 of the block hash (catches a value stored under another key)
    length      u64  payload length in bytes
    checksum    u64  xxh3_64 of the payload
    save_id     u32  the writer's save id (0: none given; see :func:`new_save_id`)

Every header field is checked against what the reader asked for, and the checksum
against the payload, so a value from another namespace, another block, another kind,
another format version, a truncated value or a flipped byte is a :class:`CorruptValue`,
never a payload. Nothing is unpickled or evaluated.

The save id is not a corruption check: a writer picks one per save (every tensor-parallel
rank writing its shard of one save uses the same), and a reader that asks for a save id
gets :class:`StaleSave` for a valid value of another save — only after every corruption
check passed, so a corrupt value is always :class:`CorruptValue` and a stale one never is.
"""

from __future__ import annotations

import operator
import random
import struct
from typing import NamedTuple

import xxhash

from offload_tiers._types import BytesLike as Buffer
from offload_tiers.keys import BlockKey, BlockKind

MAGIC = b"KVTB"
VALUE_VERSION = 2  # 2: the last u32 is the save id (1: reserved, 0)
HEADER = struct.Struct("<4sHBB16sIQQQQI")
HEADER_SIZE = HEADER.size  # 64
MAX_PAYLOAD = 1 << 34  # 16 GiB: anything larger in a header is absurd, not a block
MAX_SAVE_ID = (1 << 32) - 1

assert HEADER_SIZE == 64


#: Why a header was refused (``CorruptValue.code``), in the order the checks run.
HEADER_PROBLEMS = ("truncated", "bad_magic", "bad_version", "bad_kind", "fingerprint_mismatch",
                   "group_mismatch", "hash_mismatch", "bad_num_tokens", "bad_length")
#: The kinds a stored value may have.
STORED_KINDS = frozenset({int(BlockKind.FULL), int(BlockKind.PARTIAL)})


class CorruptValue(ValueError):
    """A stored value that must not be served; ``reason`` says why (no payload bytes in it),
    ``code`` names the check that refused it (a :data:`HEADER_PROBLEMS` entry, or
    ``"bad_checksum"``)."""

    def __init__(self, reason: str, code: str = "corrupt") -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code


class StaleSave(ValueError):
    """A valid value written by another save than the one asked for (not corrupt: never
    delete it or count it as such). ``stored`` / ``expected``: the two save ids."""

    def __init__(self, stored: int, expected: int) -> None:
        super().__init__(f"value is from save {stored:#010x}, not {expected:#010x}")
        self.stored = stored
        self.expected = expected


class HeaderFields(NamedTuple):
    """A header's fields as stored, not yet judged against any key."""

    magic: bytes
    version: int
    kind: int
    digest: bytes
    group: int
    num_tokens: int
    hash_tag: int
    length: int
    checksum: int
    save_id: int


def new_save_id() -> int:
    """A random nonzero 32-bit save id (0 means "none given").

    It tells one save of a key from another (uniqueness, not secrecy: whoever can write the
    Redis can write any value), so it comes from :mod:`random` (seeded from the OS at start
    and again in a forked child), not from a system call per save as ``secrets`` would make
    one on the scheduler's step."""
    while True:
        save_id = random.getrandbits(32)
        if save_id:
            return save_id


def parse_header(header: Buffer) -> HeaderFields:
    """Unpack the first 64 bytes of a stored value (no key needed; nothing is validated).

    Raises :class:`CorruptValue` when fewer than ``HEADER_SIZE`` bytes are given.
    """
    hv = memoryview(header)
    if hv.nbytes < HEADER_SIZE:
        raise CorruptValue(f"truncated header ({hv.nbytes} < {HEADER_SIZE} bytes)", "truncated")
    (magic, version, kind, _r1, digest, group, num_tokens, tag, length, csum,
     save_id) = HEADER.unpack_from(hv, 0)
    return HeaderFields(magic, version, kind, digest, group, num_tokens, tag, length, csum,
                        save_id)


def check_fields(header: Buffer, *, digest: bytes, group: int, block_hash: bytes,
                 kind: int | None = None, num_tokens: int | None = None,
                 total_len: int | None = None, save_id: int | None = None) -> HeaderFields:
    """The header's fields, once every one agrees with what is known of the key; else
    :class:`CorruptValue` (its ``code`` names the first check that failed), or — when every
    field is valid but ``save_id`` is given and differs from the stored one —
    :class:`StaleSave`.

    ``kind`` / ``num_tokens``: the requested ones; None accepts any stored kind and any
    ``num_tokens`` but 0 (what a writer may have stored under a key name). ``total_len``: the
    stored value's full length when known (then truncation and trailing bytes are caught
    here, without reading the payload).
    """
    if total_len is not None and total_len < HEADER_SIZE:
        raise CorruptValue(f"truncated header ({total_len} < {HEADER_SIZE} bytes)", "truncated")
    f = parse_header(header)
    if f.magic != MAGIC:
        raise CorruptValue("bad magic (not a kvtier value)", "bad_magic")
    if f.version != VALUE_VERSION:
        raise CorruptValue(f"unsupported value format version {f.version}", "bad_version")
    if kind is None:
        if f.kind not in STORED_KINDS:
            raise CorruptValue(f"kind {f.kind} is neither FULL nor PARTIAL", "bad_kind")
    elif f.kind != kind:
        raise CorruptValue(f"kind {f.kind} does not match requested {BlockKind(kind).name}",
                           "bad_kind")
    if f.digest != digest:
        raise CorruptValue("foreign namespace fingerprint", "fingerprint_mismatch")
    if f.group != group:
        raise CorruptValue(f"group {f.group} does not match requested {group}", "group_mismatch")
    if f.hash_tag != hash_tag(block_hash):
        raise CorruptValue("block hash does not match", "hash_mismatch")
    if num_tokens is None:
        if f.num_tokens == 0:
            raise CorruptValue("num_tokens 0", "bad_num_tokens")
    elif f.num_tokens != num_tokens:
        raise CorruptValue(f"num_tokens {f.num_tokens} does not match requested {num_tokens}",
                           "bad_num_tokens")
    if f.length > MAX_PAYLOAD:
        raise CorruptValue(f"absurd payload length {f.length}", "bad_length")
    if total_len is not None and total_len != HEADER_SIZE + f.length:
        raise CorruptValue(f"value is {total_len} bytes, header says {HEADER_SIZE + f.length} "
                           "(truncated or padded)", "bad_length")
    check_save_id(f, save_id)
    return f


def check_save_id(fields: HeaderFields, save_id: int | None) -> None:
    """:class:`StaleSave` when ``save_id`` is given and is not the stored one."""
    if save_id is not None and fields.save_id != save_id:
        raise StaleSave(fields.save_id, save_id)


def validate_save_id(save_id: int) -> None:
    """Raise ValueError when ``save_id`` does not fit the header's u32."""
    try:
        value = operator.index(save_id)
    except TypeError:
        raise ValueError(f"save_id must be an integer, got {save_id!r}") from None
    if not 0 <= value <= MAX_SAVE_ID:
        raise ValueError(f"save_id {save_id!r} out of range (0 to 2**32 - 1)")


def namespace_digest(key: BlockKey) -> bytes:
    """The 16-byte namespace digest a key's fingerprint encodes."""
    try:
        digest = bytes.fromhex(key.fingerprint)
    except ValueError as exc:
        raise ValueError(f"fingerprint is not hex: {key.fingerprint!r}") from exc
    if len(digest) != 16:
        raise ValueError(f"fingerprint must encode 16 bytes, got {len(digest)}")
    return digest


def hash_tag(block_hash: bytes) -> int:
    return xxhash.xxh3_64_intdigest(block_hash)


def checksum(payload: Buffer) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def encode_header(key: BlockKey, payload: Buffer, *, digest: bytes | None = None,
                  payload_checksum: int | None = None, validated: bool = False,
                  save_id: int = 0) -> bytes:
    """The 64-byte header for ``payload`` stored under ``key`` by save ``save_id``
    (``validated``: the caller already ran :func:`validate_key` on it)."""
    validate_save_id(save_id)
    if not validated:
        validate_key(key)
    length = memoryview(payload).nbytes
    return HEADER.pack(
        MAGIC, VALUE_VERSION, int(key.kind), 0,
        digest if digest is not None else namespace_digest(key),
        key.group, key.num_tokens, hash_tag(key.block_hash), length,
        payload_checksum if payload_checksum is not None else checksum(payload), save_id,
    )


def validate_key(key: BlockKey) -> None:
    """Raise ValueError when ``key`` cannot be stored (before any bytes are sent)."""
    if int(key.kind) not in STORED_KINDS:
        raise ValueError(f"cannot store a {key.kind.name} entry")
    namespace_digest(key)
    if not 0 <= key.group < 1 << 32:
        raise ValueError(f"group {key.group} out of range")
    if not 0 < key.num_tokens < 1 << 64:
        raise ValueError(f"num_tokens {key.num_tokens} out of range")


def encode(key: BlockKey, payload: Buffer, *, save_id: int = 0) -> list[Buffer]:
    """``[header, payload]`` as two buffers (send them back to back; no payload copy)."""
    view = memoryview(payload).cast("B") if not isinstance(payload, bytes) else payload
    return [encode_header(key, view, save_id=save_id), view]


def encode_bytes(key: BlockKey, payload: Buffer, *, save_id: int = 0) -> bytes:
    """Header and payload joined into one ``bytes`` (one copy)."""
    return b"".join(encode(key, payload, save_id=save_id))


def check_header(key: BlockKey, header: Buffer, *, total_len: int | None = None,
                 digest: bytes | None = None, save_id: int | None = None) -> tuple[int, int]:
    """Validate a header against ``key``; return ``(payload_length, checksum)``.

    ``total_len`` is the stored value's full length when known (then truncation and
    trailing bytes are caught here, without reading the payload). ``save_id``: the save
    the reader wants (a valid value of another one is :class:`StaleSave`).
    """
    f = check_fields(header, digest=digest if digest is not None else namespace_digest(key),
                     group=key.group, block_hash=key.block_hash, kind=int(key.kind),
                     num_tokens=key.num_tokens, total_len=total_len, save_id=save_id)
    return f.length, f.checksum


def decode(key: BlockKey, value: Buffer, *, digest: bytes | None = None,
           save_id: int | None = None) -> memoryview:
    """The payload of ``value`` (a zero-copy view), or :class:`CorruptValue`; with
    ``save_id``, :class:`StaleSave` for a valid value of another save (checked last)."""
    view = memoryview(value).cast("B") if not isinstance(value, bytes) else memoryview(value)
    length, csum = check_header(key, view, total_len=view.nbytes, digest=digest)
    payload = view[HEADER_SIZE:HEADER_SIZE + length]
    if checksum(payload) != csum:
        raise CorruptValue("payload checksum mismatch", "bad_checksum")
    if save_id is not None:
        check_save_id(parse_header(view), save_id)
    return payload
