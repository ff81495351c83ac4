"""vLLM's KV-event wire format, without importing vLLM.

The structs mirror ``vllm.distributed.kv_events`` field for field (names, order, defaults,
``tag``/``array_like``/``omit_defaults`` settings), so a payload encoded by vLLM decodes here
and the reverse. Two event forms exist on the wire:

* current: events are tagged maps ``{"type": "BlockStored", "block_hashes": [...], ...}``;
* older publishers: events are tagged arrays ``["BlockStored", [...], parent, ...]``.

:func:`decode_batch` accepts both. The daemon's hot path uses :class:`BatchDecoder`, which
decodes ``token_ids`` and ``extra_keys`` as :class:`msgspec.Raw` (it needs only the count of
token ids, read from the msgpack array header) and so never materialises token lists.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "MEDIUMS",
    "AllBlocksCleared",
    "BatchDecoder",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "DecodeError",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
    "normalize_medium",
    "raw_array_len",
]

BlockHash = int | bytes
"""A block hash on the wire: an int by default, bytes with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0."""

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
MEDIUMS: tuple[str, ...] = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)
_MEDIUM_ALIASES = {
    "gpu": MEDIUM_GPU, "cuda": MEDIUM_GPU, "hbm": MEDIUM_GPU, "device": MEDIUM_GPU,
    "cpu": MEDIUM_CPU, "host": MEDIUM_CPU, "dram": MEDIUM_CPU, "local_cpu": MEDIUM_CPU,
    "storage": MEDIUM_STORAGE, "disk": MEDIUM_STORAGE, "remote": MEDIUM_STORAGE,
    "redis": MEDIUM_STORAGE, "local_disk": MEDIUM_STORAGE,
}


class DecodeError(ValueError):
    """A payload that is not a KV-event batch in either wire form."""


def normalize_medium(medium: str | None) -> str:
    """Map a publisher's medium name onto GPU/CPU/STORAGE. ``None`` means GPU (vLLM's default).

    Unknown names are kept upper-cased so that nothing is silently merged into a known tier.
    """
    if medium is None:
        return MEDIUM_GPU
    if medium in MEDIUMS:
        return medium
    return _MEDIUM_ALIASES.get(medium.lower(), medium.upper())


# --------------------------------------------------------------------------------------
# Public structs: identical in shape to vLLM's (current tagged-map form).
# --------------------------------------------------------------------------------------


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged-map events (tag field ``type`` = class name, as vLLM)."""


class BlockStored(KVCacheEvent):
    """Blocks became resident on ``medium``: one hash per block, cumulative prefix chain."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks left ``medium``."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The publisher dropped its whole prefix cache (``reset_prefix_cache``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published step: ``[ts, events, data_parallel_rank]`` on the wire."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# --------------------------------------------------------------------------------------
# Older publishers: tagged arrays; trailing fields optional (omit_defaults).
# --------------------------------------------------------------------------------------


class _LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _LegacyBlockStored(_LegacyEvent, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class _LegacyBlockRemoved(_LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _LegacyAllBlocksCleared(_LegacyEvent, tag="AllBlocksCleared"):
    pass


class _LegacyBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_LegacyBlockStored | _LegacyBlockRemoved | _LegacyAllBlocksCleared]
    data_parallel_rank: int | None = None


# --------------------------------------------------------------------------------------
# Hot-path structs: token_ids / extra_keys left undecoded.
# --------------------------------------------------------------------------------------


_NIL = msgspec.Raw(b"\xc0")


class _FastEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class FastBlockStored(_FastEvent, tag="BlockStored"):
    """``BlockStored`` with ``token_ids`` and ``extra_keys`` kept as raw msgpack."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: msgspec.Raw = _NIL  # raw msgpack (nil when absent)
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class FastBlockRemoved(_FastEvent, tag="BlockRemoved"):
    """Same fields as :class:`BlockRemoved`."""

    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class FastAllBlocksCleared(_FastEvent, tag="AllBlocksCleared"):
    """Same as :class:`AllBlocksCleared`."""


class _FastBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[FastBlockStored | FastBlockRemoved | FastAllBlocksCleared]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_legacy_decoder = msgspec.msgpack.Decoder(_LegacyBatch)
_LEGACY_TO_PUBLIC: dict[type, type] = {
    _LegacyBlockStored: BlockStored,
    _LegacyBlockRemoved: BlockRemoved,
    _LegacyAllBlocksCleared: AllBlocksCleared,
}


def encode_batch(batch: KVEventBatch) -> bytes:
    """Encode exactly as vLLM's publisher does (``msgspec.msgpack.Encoder().encode``)."""
    return _encoder.encode(batch)


def _from_legacy(batch: _LegacyBatch) -> KVEventBatch:
    events: list[KVEvent] = []
    for ev in batch.events:
        cls = _LEGACY_TO_PUBLIC[type(ev)]
        events.append(cls(**{f: getattr(ev, f) for f in ev.__struct_fields__}))
    return KVEventBatch(batch.ts, events, batch.data_parallel_rank)


def decode_batch(payload: bytes | memoryview) -> KVEventBatch:
    """Decode a payload in either wire form into public structs; :class:`DecodeError` if neither."""
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as current_err:
        try:
            return _from_legacy(_legacy_decoder.decode(payload))
        except msgspec.DecodeError:
            raise DecodeError(f"not a KV-event batch: {current_err}") from None


def raw_array_len(raw: msgspec.Raw | bytes | memoryview) -> int:
    """Length of a msgpack array from its header (``token_ids`` without decoding them).

    Raises :class:`DecodeError` when ``raw`` is not an array (``nil`` counts as empty).
    """
    b = memoryview(raw)
    if not b:
        raise DecodeError("empty token_ids")
    h = b[0]
    if 0x90 <= h <= 0x9F:
        return h & 0x0F
    if h == 0xDC and len(b) >= 3:
        return (b[1] << 8) | b[2]
    if h == 0xDD and len(b) >= 5:
        return int.from_bytes(b[1:5], "big")
    if h == 0xC0:
        return 0
    raise DecodeError(f"token_ids is not an array (msgpack type byte 0x{h:02x})")


class _FastLegacyBatchAdapter:
    """Converts a decoded legacy batch into fast structs (rare path)."""

    @staticmethod
    def convert(batch: KVEventBatch) -> _FastBatch:
        events: list[Any] = []
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                events.append(FastBlockStored(
                    ev.block_hashes, ev.parent_block_hash,
                    msgspec.Raw(_encoder.encode(ev.token_ids)), ev.block_size, ev.lora_id,
                    ev.medium, ev.lora_name,
                    msgspec.Raw(_encoder.encode(ev.extra_keys)),
                    ev.group_idx, ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window,
                    ev.locality, ev.ownership, ev.session_id,
                ))
            elif isinstance(ev, BlockRemoved):
                events.append(FastBlockRemoved(
                    ev.block_hashes, ev.medium, ev.group_idx, ev.locality, ev.ownership))
            else:
                events.append(FastAllBlocksCleared())
        return _FastBatch(batch.ts, events, batch.data_parallel_rank)


class BatchDecoder:
    """Decoder for the daemon's hot path: tagged-map events first, array form as fallback.

    Returns a batch whose ``BlockStored`` events are :class:`FastBlockStored`; use
    :func:`raw_array_len` on ``token_ids`` for its length, or :meth:`token_ids` to decode.
    """

    __slots__ = ("_fast", "_tokens")

    def __init__(self) -> None:
        self._fast = msgspec.msgpack.Decoder(_FastBatch)
        self._tokens = msgspec.msgpack.Decoder(list[int])

    def decode(self, payload: bytes | memoryview) -> _FastBatch:
        """Decode one payload; :class:`DecodeError` when it is neither wire form."""
        try:
            return self._fast.decode(payload)
        except msgspec.DecodeError as current_err:
            try:
                legacy = _from_legacy(_legacy_decoder.decode(payload))
            except msgspec.DecodeError:
                raise DecodeError(f"not a KV-event batch: {current_err}") from None
            return _FastLegacyBatchAdapter.convert(legacy)

    def token_ids(self, event: FastBlockStored) -> list[int]:
        """Decode a fast event's ``token_ids`` (for token-id hashing)."""
        try:
            return self._tokens.decode(event.token_ids)
        except msgspec.DecodeError as exc:
            raise DecodeError(f"token_ids: {exc}") from None
