"""The connector's share of the storage namespace (the engine's identity is built by
:mod:`connector.identity.engine`, shared with the native tier).

Rules this module keeps:

* The scheduler half computes the *base* fingerprint from the engine's configuration alone
  (it never sees a KV tensor) and puts it in every key of the plan; the KV-cache groups
  (kind, block size, heads, head size, dtype) are the connector's KV layout in it.
* Each tensor-parallel rank stores under its own fingerprint, derived from the base, its
  rank and the layout it reads off its real tensors (:func:`rank_fingerprint`), so shards,
  devices and attention-backend layouts never share a value.

Nothing here imports vLLM: the config objects are read by attribute.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Generic, TypeVar

from offload_tiers.keys import Namespace


def rank_fingerprint(base: str, tp_rank: int, tp_size: int, layout: str) -> str:
    """The fingerprint rank ``tp_rank`` stores under: base + rank + its tensors' layout."""
    return Namespace(model=base, dtype="", kv_layout=layout, block_size=0,
                     tp_rank=tp_rank, tp_size=tp_size).fingerprint


def kv_groups_descriptor(kv_cache_config: Any) -> str:
    """Kind, block size, heads, head size, dtype and page bytes of every KV-cache group."""
    parts = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        fields = [type(spec).__name__, f"bs={getattr(spec, 'block_size', '?')}"]
        for name in ("num_kv_heads", "head_size", "dtype", "page_size_bytes", "shapes",
                     "dtypes", "mamba_type"):
            value = getattr(spec, name, None)
            if value is not None:
                fields.append(f"{name}={value}")
        fields.append(f"layers={len(group.layer_names)}")
        parts.append(",".join(fields))
    return ";".join(parts)


def expected_slot_bytes(kv_cache_config: Any) -> int:
    """Bytes of the largest group's block over all its layers, as the config states it.

    Both halves size the CPU tier from this, so they agree on the number of slots; the
    worker's slab uses its real layout's slot size.
    """
    best = 0
    for group in kv_cache_config.kv_cache_groups:
        page = int(getattr(group.kv_cache_spec, "page_size_bytes", 0) or 0)
        best = max(best, page * len(group.layer_names))
    return best


def slot_count(cpu_bytes: int, slot_bytes: int) -> int:
    """How many slots a CPU tier of ``cpu_bytes`` holds (both halves call this)."""
    if slot_bytes <= 0:
        raise ValueError(f"slot size must be positive, got {slot_bytes}")
    count = cpu_bytes // slot_bytes
    if count < 1:
        raise ValueError(f"cpu_bytes={cpu_bytes} holds no block of {slot_bytes} bytes. "
                         f"Fix: set cpu_bytes >= {slot_bytes}")
    return count


K = TypeVar("K")
V = TypeVar("V")


class BoundedCache(Generic[K, V]):
    """A small LRU map (per-tenant fingerprints): at most ``max_entries``, oldest out first."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._data: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: K) -> V | None:
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.max_entries:
            self._data.popitem(last=False)

    def clear(self) -> None:
        self._data.clear()
