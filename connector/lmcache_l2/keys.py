"""LMCache's object key in kvtier's terms (plain kvtier: no LMCache import).

LMCache 0.5.6 names a stored chunk by ``ObjectKey(chunk_hash, model_name, kv_rank,
object_group_id, cache_salt)``. kvtier's Redis tier stores a block under
``{prefix}:{fingerprint}:{group}:{hash hex}`` with a 64-byte header that names the namespace
digest, group, hash, kind and length (:mod:`offload_tiers.codec`). The mapping:

* model, KV rank and ``cache_salt`` make the :class:`~offload_tiers.keys.Namespace`
  (``model``, ``tp_rank`` = LMCache's KV-rank bitmap, ``tenant`` = the salt; ``kv_layout`` says
  the payload is an LMCache chunk object, so no vLLM-connector reader ever serves one), plus
  an optional deployment ``namespace`` string (e.g. a weights version);
* ``object_group_id`` is the group, ``chunk_hash`` the block hash.

A value of another model, KV rank or salt therefore lives under another key name, and where one
turns up under this name anyway (copied, renamed, a prefix shared by mistake) its header's
namespace digest differs: a miss, counted corrupt, never served.

LMCache's key carries no token count, so every value's header says ``num_tokens`` = 1, kind
FULL (the chunk hash alone names the chunk's tokens).

``list_l2_keys`` must give LMCache back its keys, but a fingerprint is a one-way digest: the
adapter keeps, per key prefix, one Redis hash ``{prefix}:lmcache-namespaces`` from fingerprint to
a small JSON object naming model, KV rank and salt. An entry is believed only when those fields
digest back to its fingerprint (JSON only; nothing read from Redis is evaluated).
"""

from __future__ import annotations

import json
import threading
from typing import NamedTuple

from offload_tiers.keys import BlockKey, BlockKind, Namespace

#: The ``kv_layout`` of every namespace this adapter writes: LMCache chunk objects.
LAYOUT = "lmcache-l2-chunk/1"
#: The header's ``num_tokens`` of every value (LMCache's key carries no token count).
NUM_TOKENS = 1
#: The registry hash's name under the key prefix.
REGISTRY_SUFFIX = "lmcache-namespaces"


class ChunkOwner(NamedTuple):
    """What a fingerprint stands for: LMCache's key less the chunk hash and group."""

    model_name: str
    kv_rank: int
    cache_salt: str


class KeyMapper:
    """LMCache key fields to kvtier :class:`BlockKey` (fingerprints cached; thread-safe)."""

    def __init__(self, namespace: str = "") -> None:
        self.namespace = namespace
        self._fps: dict[ChunkOwner, str] = {}
        self._lock = threading.Lock()

    def namespace_of(self, owner: ChunkOwner) -> Namespace:
        """The kvtier namespace of ``owner``'s chunks."""
        dtype = "lmcache" if not self.namespace else f"lmcache+{self.namespace}"
        return Namespace(model=owner.model_name, dtype=dtype, kv_layout=LAYOUT, block_size=0,
                         tp_rank=owner.kv_rank, tp_size=0, tenant=owner.cache_salt)

    def fingerprint(self, owner: ChunkOwner) -> str:
        fp = self._fps.get(owner)
        if fp is None:
            fp = self.namespace_of(owner).fingerprint
            with self._lock:
                self._fps[owner] = fp
        return fp

    def block_key(self, owner: ChunkOwner, object_group_id: int, chunk_hash: bytes) -> BlockKey:
        """The kvtier key of one LMCache chunk; ValueError for one kvtier cannot store."""
        if not chunk_hash:
            raise ValueError("an empty chunk hash names no chunk")
        if not 0 <= object_group_id < 1 << 32:
            raise ValueError(f"object_group_id {object_group_id} out of range")
        return BlockKey(self.fingerprint(owner), object_group_id, bytes(chunk_hash), NUM_TOKENS,
                        BlockKind.FULL)

    def known(self) -> dict[str, ChunkOwner]:
        """The fingerprints computed so far, and whose they are."""
        with self._lock:
            return {fp: owner for owner, fp in self._fps.items()}

    # ------------------------------------------------------------------ registry
    @staticmethod
    def registry_entry(owner: ChunkOwner) -> bytes:
        """The registry's JSON value for ``owner``."""
        return json.dumps({"model": owner.model_name, "kv_rank": owner.kv_rank,
                           "cache_salt": owner.cache_salt}, sort_keys=True).encode()

    def read_registry_entry(self, fingerprint: str, raw: bytes | str) -> ChunkOwner | None:
        """The owner a registry entry names, or None when it is malformed or does not digest
        back to ``fingerprint`` under this adapter's namespace."""
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(data, dict):
            return None
        model, rank, salt = data.get("model"), data.get("kv_rank"), data.get("cache_salt")
        if not (isinstance(model, str) and isinstance(salt, str) and isinstance(rank, int)
                and not isinstance(rank, bool)):
            return None
        owner = ChunkOwner(model, rank, salt)
        return owner if self.fingerprint(owner) == fingerprint else None


def registry_name(prefix: str) -> bytes:
    """The registry hash's Redis key for key prefix ``prefix``."""
    return f"{prefix}:{REGISTRY_SUFFIX}".encode()
