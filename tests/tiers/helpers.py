"""Small builders shared by the tier tests (pure data, no servers)."""

from __future__ import annotations

import hashlib

from offload_tiers.keys import BlockKey, BlockKind, Namespace

NS_A = Namespace(model="llama-a", dtype="float32", kv_layout="nhd", block_size=16)
NS_B = Namespace(model="llama-b", dtype="float32", kv_layout="nhd", block_size=16)
NS_A_TENANT2 = Namespace(model="llama-a", dtype="float32", kv_layout="nhd", block_size=16,
                         tenant="tenant-2")


def key(i: int, *, ns: Namespace = NS_A, group: int = 0, partial: bool = False,
        block_size: int = 16, hash_salt: str = "") -> BlockKey:
    """Block ``i`` of a chain: FULL covers (i+1)*block_size tokens, PARTIAL a bit less."""
    h = hashlib.blake2b(f"{hash_salt}{i}".encode(), digest_size=8).digest()
    end = (i + 1) * block_size
    if partial:
        return BlockKey(ns.fingerprint, group, h + b"p", end - block_size // 2, BlockKind.PARTIAL)
    return BlockKey(ns.fingerprint, group, h, end, BlockKind.FULL)


def payload(k: BlockKey, size: int = 256, version: int = 0) -> bytes:
    """Deterministic bytes derived from every field of the key (content addressing)."""
    seed = f"{k.fingerprint}:{k.group}:{k.block_hash.hex()}:{k.num_tokens}:{k.kind}:{version}"
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.blake2b(f"{seed}:{counter}".encode()).digest()
        counter += 1
    return bytes(out[:size])
