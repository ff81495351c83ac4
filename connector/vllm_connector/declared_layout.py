"""What vLLM declares about where blocks live in each layer's KV tensors (worker side).

:mod:`connector.vllm_connector.layout` must know each tensor's block dimension; guessing it
from sizes refuses legitimate engines (``num_blocks`` equal to the block size, a head count
or 2). vLLM states it; this module reads the statement, per layer, in this order:

1. **Standardized layouts** (vLLM >= 0.32, RFC #42082): a spec with ``has_layer_views`` is
   allocated by ``vllm.v1.worker.utils.allocate_kv_cache`` ->
   ``vllm.v1.kv_cache_interface.create_kv_cache_views`` as one logical ``[B, H, N, C]`` view
   per layer (Mamba included: ``[B, 1, 1, page_bytes]``); the physical order
   (``KVCacheLayout``, e.g. ``LHBNC``) only changes strides. Block dimension: 0, as vLLM's
   own offloading connector assumes (``CanonicalKVCacheTensor``: "num_blocks is always the
   leading logical dimension"). With kernel-block splitting dimension 0 counts kernel blocks
   (``num_blocks * ratio``); :func:`manager_block_views` regroups it as vLLM's
   ``group_kernel_blocks`` does. A spec without layer views gets the raw backing buffer and
   lays it out itself: no declaration.
2. **Legacy Mamba** (a spec with ``shapes``): tensor ``i`` is ``[num_blocks, *shapes[i]]``.
3. **Legacy attention**: the layer's backend (``static_forward_context[layer]``) answers
   ``get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)``; vLLM hands the
   tensor over in that logical order (its stride order only permutes memory). Asked with a
   sentinel ``num_blocks`` no other dimension can equal, the sentinel's position is the
   block dimension.

A layer with no readable declaration is left out: the layout falls back to strides. Only
duck-typed attributes are read, so this module imports neither vLLM nor torch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

SENTINEL_BLOCKS = 1_000_003
"""A prime larger than any other KV dimension: where it lands is the block dimension."""


def _tensors(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _layer_specs(kv_cache_config: Any) -> Iterator[tuple[str, Any]]:
    """``(layer, spec)`` of every layer of every KV-cache group, per-layer specs resolved."""
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        for layer in group.layer_names:
            yield layer, (per_layer.get(layer, spec) if isinstance(per_layer, dict) else spec)


def declared_block_dims(vllm_config: Any, kv_cache_config: Any,
                        kv_caches: dict[str, Any]) -> dict[str, list[int]]:
    """Layer -> block dimension of each of its tensors, for every layer vLLM declares.

    ``kv_caches``: the tensors as they will be registered (after :func:`manager_block_views`).
    """
    forward = getattr(getattr(vllm_config, "compilation_config", None),
                      "static_forward_context", None) or {}
    cache_dtype = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"))
    out: dict[str, list[int]] = {}
    for layer, spec in _layer_specs(kv_cache_config):
        if layer not in kv_caches or layer in out:
            continue
        dims = _declared(layer, spec, forward.get(layer), _tensors(kv_caches[layer]),
                         cache_dtype)
        if dims is not None:
            out[layer] = dims
    return out


def _declared(layer: str, spec: Any, module: Any, tensors: list[Any],
              cache_dtype: str) -> list[int] | None:
    views = getattr(spec, "has_layer_views", None)
    if views is not None:
        return [0] * len(tensors) if views else None  # rule 1
    shapes = getattr(spec, "shapes", None)
    if shapes is not None:  # rule 2
        if len(shapes) == len(tensors) and all(
                tuple(t.shape[1:]) == tuple(s) for t, s in zip(tensors, shapes, strict=True)):
            return [0] * len(tensors)
        log.warning("kvtier: layer %s: Mamba state shapes %s do not match its tensors %s; "
                    "reading the block dimension from strides", layer, shapes,
                    [tuple(t.shape) for t in tensors])
        return None
    return _backend_dims(layer, spec, module, tensors, cache_dtype)  # rule 3


def _backend_shape(backend: Any, spec: Any, cache_dtype: str) -> tuple[int, ...] | None:
    get_shape = getattr(backend, "get_kv_cache_shape", None)
    if get_shape is None:
        return None
    args = (SENTINEL_BLOCKS, int(spec.block_size), int(spec.num_kv_heads), int(spec.head_size))
    try:
        try:
            shape = get_shape(*args, cache_dtype_str=cache_dtype)
        except TypeError:  # older signature without cache_dtype_str
            shape = get_shape(*args)
        return tuple(int(s) for s in shape)
    except Exception:  # a backend that rejects the sentinel declares nothing we can read
        log.debug("kvtier: %s.get_kv_cache_shape rejected the sentinel", backend, exc_info=True)
        return None


def _backend_dims(layer: str, spec: Any, module: Any, tensors: list[Any],
                  cache_dtype: str) -> list[int] | None:
    if module is None or len(tensors) != 1 or not hasattr(spec, "num_kv_heads"):
        return None
    get_backend = getattr(module, "get_attn_backend", None)
    backend = get_backend() if callable(get_backend) else getattr(module, "attn_backend", None)
    shape = None if backend is None else _backend_shape(backend, spec, cache_dtype)
    if shape is None:
        return None
    positions = [d for d, size in enumerate(shape) if size == SENTINEL_BLOCKS]
    if len(positions) != 1 or len(shape) != tensors[0].dim():
        log.warning("kvtier: layer %s: backend %s declares KV shape %s for a tensor of shape "
                    "%s; reading the block dimension from strides", layer,
                    getattr(backend, "__name__", backend), shape, tuple(tensors[0].shape))
        return None
    return positions


def manager_block_views(kv_cache_config: Any, kv_caches: dict[str, Any]) -> dict[str, Any]:
    """``kv_caches`` with kernel-block views regrouped into manager blocks (dimension 0).

    Under kernel-block splitting (rule 1) a layer's view has ``num_blocks * ratio`` kernel
    blocks in dimension 0; block ``b`` is kernel blocks ``b*ratio .. b*ratio+ratio-1``.
    The regrouped ``[num_blocks, ratio, H, N, C]`` view shares the tensor's memory.
    Other layers are returned as they are.
    """
    num_blocks = int(kv_cache_config.num_blocks)
    out = dict(kv_caches)
    for layer, spec in _layer_specs(kv_cache_config):
        value = out.get(layer)
        if value is None or getattr(spec, "has_layer_views", None) is not True:
            continue
        tensors = _tensors(value)
        if all(t.shape[0] == num_blocks or t.shape[0] % num_blocks for t in tensors):
            continue
        grouped = [t if t.shape[0] == num_blocks or t.shape[0] % num_blocks
                   else t.unflatten(0, (num_blocks, -1)) for t in tensors]
        out[layer] = grouped if isinstance(value, (list, tuple)) else grouped[0]
    return out
