"""The storage namespace of an engine: everything that must match for stored KV to be reused.

Rules this module keeps:

* Both halves of the connector compute the same *base* fingerprint from the engine's
  configuration alone: the scheduler half never sees a KV tensor.
* The base covers the model (path or ``model_id``, revision, architecture dimensions),
  ``weights_version``, the model dtype, the KV-cache dtype *as configured* (``fp8_e4m3`` and
  ``fp8_e5m2`` are both ``uint8`` tensors), quantization, KV-scale settings, the KV-cache
  groups (kind, block size, heads, head size, dtype), the device type, the TP size, the
  tenant, a generation that a connector-cache reset advances, and kvtier's format version.
* Each tensor-parallel rank stores under its own fingerprint, derived from the base, its
  rank and the layout it reads off its real tensors (:func:`rank_fingerprint`), so shards,
  devices and attention-backend layouts never share a value.

Nothing here imports vLLM: the config objects are read by attribute.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from offload_tiers.keys import Namespace

_VOLATILE_HF_KEYS = {"_name_or_path", "transformers_version", "architectures_auto_map",
                     "torch_dtype", "dtype", "_commit_hash", "_attn_implementation_autoset"}


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    """What one engine's KV bytes depend on (tenant and generation are added per key)."""

    model: str
    revision: str
    weights_version: str
    dtype: str
    kv_cache_dtype: str
    quantization: str
    kv_scales: str
    architecture: str
    kv_groups: str
    block_size: int
    tp_size: int
    device: str

    def fingerprint(self, tenant: str, generation: int = 0) -> str:
        """The base fingerprint (32 hex digits) for ``tenant`` at ``generation``."""
        return Namespace(
            model=f"{self.model}@{self.revision}#weights={self.weights_version}#gen={generation}",
            dtype=f"{self.dtype}/kv={self.kv_cache_dtype}/q={self.quantization}/"
                  f"scales={self.kv_scales}",
            kv_layout=f"{self.device}|{self.kv_groups}|arch={self.architecture}",
            block_size=self.block_size, tp_rank=0, tp_size=self.tp_size, tenant=tenant,
        ).fingerprint


def rank_fingerprint(base: str, tp_rank: int, tp_size: int, layout: str) -> str:
    """The fingerprint rank ``tp_rank`` stores under: base + rank + its tensors' layout."""
    return Namespace(model=base, dtype="", kv_layout=layout, block_size=0,
                     tp_rank=tp_rank, tp_size=tp_size).fingerprint


def architecture_digest(hf_config: Any) -> str:
    """A short digest of the model's architecture config (dimensions, layer types, ...)."""
    to_dict = getattr(hf_config, "to_dict", None)
    data = to_dict() if callable(to_dict) else dict(getattr(hf_config, "__dict__", {}))
    stable = {k: v for k, v in data.items() if k not in _VOLATILE_HF_KEYS}
    text = json.dumps(stable, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


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


def identity_from_vllm(vllm_config: Any, kv_cache_config: Any, model_id: str | None,
                       weights_version: str, device: str) -> EngineIdentity:
    """Read an :class:`EngineIdentity` off vLLM's config objects."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    scales = [f"calc={getattr(cache, 'calculate_kv_scales', None)}"]
    attention = getattr(vllm_config, "attention_config", None)
    if attention is not None and hasattr(attention, "calculate_kv_scales"):
        scales.append(f"attn_calc={attention.calculate_kv_scales}")
    return EngineIdentity(
        model=model_id or str(model.model),
        revision=str(getattr(model, "revision", None) or ""),
        weights_version=weights_version,
        dtype=str(model.dtype).replace("torch.", ""),
        kv_cache_dtype=str(getattr(cache, "cache_dtype", "auto")),
        quantization=str(getattr(model, "quantization", None) or ""),
        kv_scales=",".join(scales),
        architecture=architecture_digest(model.hf_config),
        kv_groups=kv_groups_descriptor(kv_cache_config),
        block_size=int(cache.block_size),
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
        device=device,
    )


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
