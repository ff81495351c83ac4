"""Block keys: what a stored KV block is, and the namespace it belongs to.

Every fact about a block travels with it: (namespace, group, hash, num_tokens, kind).
``num_tokens`` is the cumulative prefix length the hash covers, the same quantity as
vLLM's ``KVCacheBlock.block_hash_num_tokens``. Fullness is decided from it and the
block's end position, never from the presence of a hash.
"""

from __future__ import annotations

import enum
import hashlib
import re
from dataclasses import dataclass

FORMAT_VERSION = 1


class BlockKind(enum.IntEnum):
    """How much of its physical block a stored entry covers."""

    FULL = 1
    PARTIAL = 2
    PLACEHOLDER = 3  # announced without a payload description (e.g. Mamba chunk offload)


def kind_for(num_tokens: int | None, block_index: int, block_size: int) -> BlockKind | None:
    """Classify block ``block_index`` (0-based) of a request whose hash covers ``num_tokens``.

    ``None`` when the block carries no hash at all. FULL when the hash covers the block's
    whole end position ``(block_index + 1) * block_size``; PARTIAL when it covers less.
    """
    if num_tokens is None:
        return None
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    end = (block_index + 1) * block_size
    if num_tokens > end or num_tokens <= block_index * block_size:
        raise ValueError(
            f"num_tokens={num_tokens} does not end inside block {block_index} "
            f"of size {block_size} (tokens {block_index * block_size + 1}..{end})"
        )
    return BlockKind.FULL if num_tokens == end else BlockKind.PARTIAL


def is_full_block(num_tokens: int | None, block_index: int, block_size: int) -> bool:
    """True only when the hash covers the whole block (the fix ``kvtier audit`` suggests)."""
    return kind_for(num_tokens, block_index, block_size) is BlockKind.FULL


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that must match for one engine's KV bytes to be valid in another.

    Two namespaces with any field different never share a stored block: the tenant
    (vLLM's ``cache_salt``) keeps tenants of one model apart, the rest keeps models,
    dtypes, layouts and tensor-parallel shards apart.
    """

    model: str
    dtype: str
    kv_layout: str
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    tenant: str = ""
    format_version: int = FORMAT_VERSION

    @property
    def digest(self) -> bytes:
        """16-byte digest of every field; stored in each value's header."""
        canonical = "\x1f".join(
            str(v)
            for v in (self.model, self.dtype, self.kv_layout, self.block_size,
                      self.tp_rank, self.tp_size, self.tenant, self.format_version)
        )
        return hashlib.blake2b(canonical.encode(), digest_size=16).digest()

    @property
    def fingerprint(self) -> str:
        """Readable-length hex form used in key names."""
        return self.digest.hex()


@dataclass(frozen=True, slots=True)
class BlockKey:
    """One stored entry: a (group, hash) in a namespace, with what the hash covers."""

    fingerprint: str
    group: int
    block_hash: bytes
    num_tokens: int
    kind: BlockKind

    def __post_init__(self) -> None:
        if self.kind is BlockKind.PLACEHOLDER:
            raise ValueError("a placeholder announcement has no payload and cannot be stored")
        if self.num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {self.num_tokens}")

    @property
    def name(self) -> str:
        """The scoped part of the storage key: ``{fingerprint}:{group}:{hash}``
        (:func:`parse_key_name` reads it back)."""
        return f"{self.fingerprint}:{self.group}:{self.block_hash.hex()}"


@dataclass(frozen=True, slots=True)
class KeyName:
    """What a :attr:`BlockKey.name` says: namespace digest, group and block hash (the kind
    and ``num_tokens`` live in the value's header)."""

    digest: bytes
    group: int
    block_hash: bytes


_FP = re.compile(rb"[0-9a-fA-F]{32}")
_GROUP = re.compile(rb"0|[1-9][0-9]{0,9}")
_HASH = re.compile(rb"(?:[0-9a-f]{2})+")  # BlockKey.name writes bytes.hex(): lower case


def parse_key_name(name: bytes) -> KeyName | None:
    """The inverse of :attr:`BlockKey.name`; None when no :class:`BlockKey` has this name."""
    parts = name.split(b":")
    if len(parts) != 3:
        return None
    fp, group, block_hash = parts
    if not (_FP.fullmatch(fp) and _GROUP.fullmatch(group) and _HASH.fullmatch(block_hash)):
        return None
    g = int(group)
    if g >= 1 << 32:
        return None
    return KeyName(bytes.fromhex(fp.decode()), g, bytes.fromhex(block_hash.decode()))
