"""One engine's identity: everything its KV bytes depend on, read off vLLM's config objects.

Rules this module keeps:

* One builder for the connector and the native tier: the model (path or ``model_id``,
  revision, architecture config, checkpoint files), ``weights_version``, the model dtype, the
  KV-cache dtype *as configured* (``fp8_e4m3`` and ``fp8_e5m2`` are both ``uint8`` tensors),
  quantization, KV-scale settings, the caller's KV layout, the parallel shape, the device
  type; the tenant and the generation are added per fingerprint.
* Nothing here imports vLLM: the config objects are read by attribute.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from connector.identity.checkpoint import checkpoint_identity
from offload_tiers.keys import Namespace

_VOLATILE_HF_KEYS = {"_name_or_path", "transformers_version", "architectures_auto_map",
                     "torch_dtype", "dtype", "_commit_hash", "_attn_implementation_autoset"}


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    """What one engine's KV bytes depend on (tenant and generation are added per key)."""

    model: str
    revision: str
    weights_version: str
    checkpoint: str
    dtype: str
    kv_cache_dtype: str
    quantization: str
    kv_scales: str
    architecture: str
    kv_layout: str
    block_size: int
    parallel: str
    tp_size: int
    device: str

    def fingerprint(self, tenant: str, generation: str = "0", tp_rank: int = 0) -> str:
        """The fingerprint (32 hex digits) for ``tenant`` at ``generation``."""
        return Namespace(
            model=f"{self.model}@{self.revision}#weights={self.weights_version}"
                  f"#ckpt={self.checkpoint}#gen={generation}",
            dtype=f"{self.dtype}/kv={self.kv_cache_dtype}/q={self.quantization}/"
                  f"scales={self.kv_scales}",
            kv_layout=f"{self.device}|{self.kv_layout}|arch={self.architecture}|{self.parallel}",
            block_size=self.block_size, tp_rank=tp_rank, tp_size=self.tp_size, tenant=tenant,
        ).fingerprint


def architecture_digest(hf_config: Any) -> str:
    """A short digest of the model's architecture config (dimensions, layer types, ...)."""
    to_dict = getattr(hf_config, "to_dict", None)
    data = to_dict() if callable(to_dict) else dict(getattr(hf_config, "__dict__", {}))
    stable = {k: v for k, v in data.items() if k not in _VOLATILE_HF_KEYS}
    text = json.dumps(stable, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def kv_scales_descriptor(vllm_config: Any) -> str:
    """The KV-scale settings (computed scales make stored KV depend on the batch seen)."""
    cache = vllm_config.cache_config
    scales = [f"calc={getattr(cache, 'calculate_kv_scales', None)}"]
    attention = getattr(vllm_config, "attention_config", None)
    if attention is not None and hasattr(attention, "calculate_kv_scales"):
        scales.append(f"attn_calc={attention.calculate_kv_scales}")
    return ",".join(scales)


def parallel_descriptor(parallel: Any) -> str:
    """The parallel shape KV shards depend on (TP, PP, prefill/decode context parallel)."""
    names = ("tensor_parallel_size", "pipeline_parallel_size",
             "prefill_context_parallel_size", "decode_context_parallel_size")
    return "|".join(f"{n.split('_')[0]}={getattr(parallel, n, 1)}" for n in names)


def identity_from_vllm(vllm_config: Any, *, kv_layout: str, model_id: str | None,
                       weights_version: str, device: str, block_size: int | None = None,
                       checkpoint: bool = True) -> EngineIdentity:
    """Read an :class:`EngineIdentity` off vLLM's config objects (``kv_layout``: the
    caller's description of how its KV is laid out; ``checkpoint``: include the checkpoint
    files' identity)."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    revision = str(getattr(model, "revision", None) or "")
    parallel = vllm_config.parallel_config
    return EngineIdentity(
        model=model_id or str(model.model),
        revision=revision,
        weights_version=weights_version,
        checkpoint=checkpoint_identity(str(model.model), revision) if checkpoint else "off",
        dtype=str(model.dtype).replace("torch.", ""),
        kv_cache_dtype=str(getattr(cache, "cache_dtype", "auto")),
        quantization=str(getattr(model, "quantization", None) or ""),
        kv_scales=kv_scales_descriptor(vllm_config),
        architecture=architecture_digest(model.hf_config),
        kv_layout=kv_layout,
        block_size=int(block_size if block_size is not None else cache.block_size),
        parallel=parallel_descriptor(parallel),
        tp_size=int(parallel.tensor_parallel_size),
        device=device,
    )
