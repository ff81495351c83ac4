"""vLLM's prefix-cache block hashes from token ids, without importing vLLM.

Reproduces ``vllm.v1.core.kv_cache_utils.hash_block_tokens`` chained from ``NONE_HASH``
(``hash_fn(seed)``) for the four algorithms of ``--prefix-caching-hash-algo``, and the
64-bit int form vLLM puts on the KV-event wire (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``).
Only our own values are serialised (``pickle.dumps``/``cbor2.dumps``, as vLLM does); nothing
external is ever deserialised. A test proves equality with vLLM's own function.
"""

from __future__ import annotations

import hashlib
import pickle  # noqa: S403  (dumps of our own tuple only: vLLM's hash input format)
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["ALGORITHMS", "DEFAULT_NONE_HASH_SEED", "TokenHasher"]

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_INT_MASK = (1 << 64) - 1


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _cbor(obj: Any) -> bytes:
    try:
        import cbor2
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ValueError("the *_cbor hash algorithms need the 'cbor2' package") from exc
    return cbor2.dumps(obj, canonical=True)


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(_cbor(obj)).digest()


def _xxh(data: bytes) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(data)


def _xxhash(obj: Any) -> bytes:
    return _xxh(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _xxhash_cbor(obj: Any) -> bytes:
    return _xxh(_cbor(obj))


ALGORITHMS: dict[str, Callable[[Any], bytes]] = {
    "sha256": _sha256, "sha256_cbor": _sha256_cbor,
    "xxhash": _xxhash, "xxhash_cbor": _xxhash_cbor,
}


class TokenHasher:
    """Chain hashes of token ids, one per ``hash_block_size`` tokens, as vLLM computes them.

    ``seed`` must equal the engine's ``PYTHONHASHSEED`` when it sets one; otherwise the
    cryptographic algorithms use vLLM's fixed default seed. The xxhash algorithms use a random
    per-process seed in vLLM unless ``PYTHONHASHSEED`` is set, so they require ``seed``.
    """

    __slots__ = ("algo", "hash_block_size", "int_hashes", "_fn", "none_hash")

    def __init__(self, algo: str = "sha256", hash_block_size: int = 16,
                 seed: str | None = None, int_hashes: bool = True) -> None:
        if algo not in ALGORITHMS:
            raise ValueError(f"unknown hash algorithm {algo!r}; use one of {sorted(ALGORITHMS)}")
        if hash_block_size <= 0:
            raise ValueError(f"hash_block_size must be positive, got {hash_block_size}")
        if seed is None and algo.startswith("xxhash"):
            raise ValueError(f"{algo} hashes use a random seed in vLLM unless PYTHONHASHSEED is "
                             "set: configure the same value as 'seed'")
        self.algo = algo
        self.hash_block_size = hash_block_size
        self.int_hashes = int_hashes
        self._fn = ALGORITHMS[algo]
        self.none_hash = self._fn(DEFAULT_NONE_HASH_SEED if seed is None else seed)

    def raw_chain(self, token_ids: Sequence[int],
                  extra_keys: Sequence[tuple[Any, ...] | None] | None = None) -> list[bytes]:
        """Engine-side (bytes) hashes of every full hash block of ``token_ids``."""
        u = self.hash_block_size
        parent = self.none_hash
        out: list[bytes] = []
        for i in range(len(token_ids) // u):
            extra = extra_keys[i] if extra_keys is not None else None
            parent = self._fn((parent, tuple(token_ids[i * u:(i + 1) * u]), extra))
            out.append(parent)
        return out

    def chain(self, token_ids: Sequence[int],
              extra_keys: Sequence[tuple[Any, ...] | None] | None = None) -> list[int | bytes]:
        """Hashes as they appear in KV events (64-bit ints by default)."""
        raw = self.raw_chain(token_ids, extra_keys)
        if not self.int_hashes:
            return list(raw)
        return [int.from_bytes(h, "big") & _INT_MASK for h in raw]
