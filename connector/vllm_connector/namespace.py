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

from typing import Any

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
