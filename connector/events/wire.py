"""vLLM's KV-event wire format, without importing vLLM.

The structs mirror ``vllm.distributed.kv_events`` field for field (names, order, defaults,
``tag``/``array_like``/``omit_defaults`` settings), so a payload encoded by vLLM decodes here
and the reverse. Two event forms exist on the wire:

* current: events are tagged maps ``{"type": "BlockStored", "block_hashes": [...], ...}``;
* older publishers: events are tagged arrays ``["BlockStored", [...], parent, ...]`` whose
  trailing fields may be missing.

One decode pass reads both: maps decode straight into the structs, arrays decode as lists
and are converted field by field (:class:`BatchDecoder`). The daemon's decoder reads
``BlockStored`` maps as :class:`RawBlockStored`, which keeps ``token_ids`` and ``extra_keys``
as :class:`msgspec.Raw` (it needs only the count of token ids, read from the msgpack array
header by :func:`raw_array_len`) and so never materialises token lists.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BatchDecoder",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "DecodeError",
    "KVEvent",
    "KVEventBatch",
    "Medium",
    "RawBlockStored",
    "decode_batch",
    "encode_batch",
    "normalize_medium",
    "raw_array_len",
]

BlockHash = int | bytes
"""A block hash on the wire: an int by default, bytes with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0."""


class Medium(enum.StrEnum):
    """Where an announced block lives: vLLM's ``MEDIUM_GPU``/``MEDIUM_CPU``/``MEDIUM_STORAGE``."""

    GPU = "GPU"
    CPU = "CPU"
    STORAGE = "STORAGE"


_MEDIUM_ALIASES: dict[str, Medium] = {
    "gpu": Medium.GPU, "cuda": Medium.GPU, "hbm": Medium.GPU, "device": Medium.GPU,
    "cpu": Medium.CPU, "host": Medium.CPU, "dram": Medium.CPU, "local_cpu": Medium.CPU,
    "storage": Medium.STORAGE, "disk": Medium.STORAGE, "remote": Medium.STORAGE,
    "redis": Medium.STORAGE, "local_disk": Medium.STORAGE,
}


class DecodeError(ValueError):
    """A payload that is not a KV-event batch in either wire form."""


def normalize_medium(medium: str | None) -> Medium | str:
    """Map a publisher's medium name onto a :class:`Medium`. ``None`` means GPU (vLLM's default).

    Unknown names are kept upper-cased so that nothing is silently merged into a known tier.
    """
    if medium is None:
        return Medium.GPU
    known = _MEDIUM_ALIASES.get(medium.lower())
    return known if known is not None else medium.upper()


# --------------------------------------------------------------------------------------
# The structs: identical in shape to vLLM's (tagged-map form).
# --------------------------------------------------------------------------------------


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events (tag field ``type`` = class name, as vLLM)."""


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
    # vLLM #44488 (and #58121 on top, for partial entries): the span between the last
    # announced block and this event's first, when blocks in between were not announced
    # (null or masked blocks; fine-grained boundaries a partial entry skips). The parent's
    # position is the skipped parent's plus len(skipped_token_ids); None: no skipped span.
    skipped_parent_block_hash: BlockHash | None = None
    skipped_token_ids: list[int] | None = None
    skipped_extra_keys: list[tuple[Any, ...] | None] | None = None


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
# The daemon's decode types: the same structs, token ids left raw, tolerant of the
# fields older publishers omit.
# --------------------------------------------------------------------------------------

_NIL = msgspec.Raw(b"\xc0")


class RawBlockStored(BlockStored, tag="BlockStored"):
    """:class:`BlockStored` with ``token_ids``, ``extra_keys``, ``skipped_token_ids`` and
    ``skipped_extra_keys`` kept as raw msgpack (nil when absent); ``lora_id``, ``medium`` and
    ``lora_name`` may be absent."""

    token_ids: msgspec.Raw  # type: ignore[assignment]
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: msgspec.Raw = _NIL  # type: ignore[assignment]
    skipped_token_ids: msgspec.Raw = _NIL  # type: ignore[assignment]
    skipped_extra_keys: msgspec.Raw = _NIL  # type: ignore[assignment]


class _OptionalMediumBlockRemoved(BlockRemoved, tag="BlockRemoved"):
    """:class:`BlockRemoved` whose ``medium`` may be absent."""

    medium: str | None = None


class _Batch(KVEventBatch):
    """Decode target of :func:`decode_batch`: map events become structs, array events lists."""

    events: list[KVEvent | list[Any]]  # type: ignore[assignment]


class _RawBatch(KVEventBatch):
    """Decode target of the daemon's :class:`BatchDecoder`."""

    events: list[  # type: ignore[assignment]
        RawBlockStored | _OptionalMediumBlockRemoved | AllBlocksCleared | list[Any]]


# Array form: the event's tag, then its fields in order. Fields after the first
# ``required`` ones may be missing: they take the struct's default, or None where vLLM's
# struct has none (older publishers omit ``lora_id``, ``medium``, ``lora_name``).
_ARRAY_FORM: dict[str, tuple[type[KVCacheEvent], int]] = {
    "BlockStored": (BlockStored, 4),
    "BlockRemoved": (BlockRemoved, 1),
    "AllBlocksCleared": (AllBlocksCleared, 0),
}


# Array-form fields stop at vLLM 0.32's last (``session_id``): what later versions append there
# (0.33's ``lookahead_token_ids``) is not the skipped span, which only map events carry.
_POSITIONAL: dict[type[KVCacheEvent], int] = {
    BlockStored: BlockStored.__struct_fields__.index("session_id") + 1}


def _from_array(event: list[Any]) -> KVCacheEvent:
    """One array-form event as its struct (types checked as the map form's are)."""
    form = _ARRAY_FORM.get(event[0]) if event and type(event[0]) is str else None
    if form is None:
        raise DecodeError(f"not a KV event: {event[:1]!r}")
    cls, required = form
    fields = cls.__struct_fields__[:_POSITIONAL.get(cls, len(cls.__struct_fields__))]
    values = event[1:len(fields) + 1]
    if len(values) < required:
        raise DecodeError(f"{event[0]} with {len(values)} fields, needs {required}")
    n_without_default = len(cls.__struct_fields__) - len(cls.__struct_defaults__)
    obj = dict.fromkeys(fields[len(values):n_without_default])  # absent: None
    obj.update(zip(fields, values, strict=False))  # values may be shorter
    try:
        return msgspec.convert(obj, cls)
    except msgspec.ValidationError as exc:
        raise DecodeError(f"not a KV event: {exc}") from None


class BatchDecoder:
    """Decodes a payload in either wire form into a :class:`KVEventBatch`.

    With ``raw_tokens`` (the daemon's hot path) ``BlockStored`` maps become
    :class:`RawBlockStored`: use :func:`raw_array_len` on ``token_ids`` for its length.
    Array-form events (older publishers) always become the plain structs.
    """

    __slots__ = ("_decoder",)

    def __init__(self, raw_tokens: bool = True) -> None:
        self._decoder = msgspec.msgpack.Decoder(_RawBatch if raw_tokens else _Batch)

    def decode(self, payload: bytes | memoryview) -> KVEventBatch:
        """Decode one payload; :class:`DecodeError` when it is neither wire form."""
        try:
            batch = self._decoder.decode(payload)
        except msgspec.DecodeError as exc:
            raise DecodeError(f"not a KV-event batch: {exc}") from None
        events = batch.events
        if list in map(type, events):  # array form: every event of the batch is an array
            if not all(type(e) is list for e in events):
                raise DecodeError("not a KV-event batch: map and array events mixed")
            batch.events = [_from_array(e) for e in events]
        return batch


_encoder = msgspec.msgpack.Encoder()
_decoder = BatchDecoder(raw_tokens=False)


def encode_batch(batch: KVEventBatch) -> bytes:
    """Encode exactly as vLLM's publisher does (``msgspec.msgpack.Encoder().encode``)."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes | memoryview) -> KVEventBatch:
    """Decode a payload in either wire form into a :class:`KVEventBatch` of the plain structs;
    :class:`DecodeError` if neither."""
    b = _decoder.decode(payload)
    return KVEventBatch(b.ts, b.events, b.data_parallel_rank)


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
