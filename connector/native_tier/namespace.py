"""The native tier's engine identity: kvtier's one builder, fed with the engine's real config.

Rules this module keeps:

* One builder: the identity is ``connector.identity.engine.identity_from_vllm`` (the same
  fields as kvtier's own connector: model, revision, checkpoint files, ``weights_version``,
  model dtype, KV-cache dtype as configured, quantization, KV scales, architecture, device,
  parallel shape), with this tier's layout as ``kv_layout`` and its chunk size as
  ``block_size``. Nothing is read off vLLM's ``OffloadingConfig`` that the ``VllmConfig``
  says better: the offloading config names only the model path and the KV tensor dtype.
* A secondary tier is handed an ``OffloadingSpec`` (no ``VllmConfig``). The engine's config
  is found once, at construction: vLLM's current config when one is set (``set_current_
  vllm_config``), else the ``vllm_config`` of a caller on the stack (vLLM 0.32 builds the
  tier inside ``OffloadingConnectorScheduler.__init__(spec, vllm_config, ...)``; the engine
  core process sets no current config then, checked on a real engine). A candidate counts
  only when its ``kv_transfer_config.engine_id`` is the spec's ``engine_id``: the config of
  this engine, never another's.
* Not found: :class:`NativeTierIdentityError` at start, naming what was looked for. A tier
  never runs with fields silently left out of its namespace.
"""

from __future__ import annotations

import sys
from typing import Any

from connector.identity.engine import EngineIdentity, identity_from_vllm
from connector.native_tier.config import NativeTierConfigError, NativeTierSettings

#: How many callers up the stack the search looks (vLLM 0.32: the config is 3 frames up).
MAX_STACK_DEPTH = 64


class NativeTierIdentityError(NativeTierConfigError):
    """The engine's ``VllmConfig`` could not be found where the tier is built."""


def native_layout(spec: Any, row_bytes: int) -> str:
    """How this tier lays out a stored chunk row (offloading layout, groups, row bytes)."""
    cfg = spec.config
    par = cfg.parallel
    groups = ";".join(f"g{g.group_id}:t{g.tokens_per_block}:l{len(g.layer_names)}:"
                      f"{','.join(g.layer_names)}" for g in cfg.groups)
    return (f"native-tiering|kv={cfg.model.dtype}|kv_layout={cfg.kv_cache_layout}"
            f"|canonical={cfg.canonical_layout}|replicated={cfg.replicated_layout}"
            f"|agnostic={par.is_parallelism_agnostic}|bpc={cfg.cache.blocks_per_chunk}"
            f"|tph={cfg.cache.tokens_per_hash}|worker_bytes={cfg.worker_kv_bytes_per_block}"
            f"|row={row_bytes}|{groups}|world={par.world_size}")


def chunk_tokens(spec: Any) -> int:
    """Tokens one chunk of the largest group covers (the identity's ``block_size``)."""
    cfg = spec.config
    return cfg.cache.blocks_per_chunk * max(g.tokens_per_block for g in cfg.groups)


def _engine_id(candidate: Any) -> str | None:
    return getattr(getattr(candidate, "kv_transfer_config", None), "engine_id", None)


def find_vllm_config(engine_id: str, max_depth: int = MAX_STACK_DEPTH) -> tuple[Any, str] | None:
    """This engine's ``VllmConfig`` and where it was found (``current`` or ``stack:<fn>``)."""
    from vllm.config import VllmConfig, get_current_vllm_config_or_none

    def ours(candidate: Any) -> bool:
        return isinstance(candidate, VllmConfig) and _engine_id(candidate) == engine_id

    current = get_current_vllm_config_or_none()
    if ours(current):
        return current, "current"
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            break
        local = frame.f_locals
        for candidate in (local.get("vllm_config"),
                          getattr(local.get("self"), "vllm_config", None)):
            if ours(candidate):
                return candidate, f"stack:{frame.f_code.co_name}"
        frame = frame.f_back
    return None


def native_identity(spec: Any, settings: NativeTierSettings, row_bytes: int,
                    vllm_config: Any) -> EngineIdentity:
    """The engine identity this tier's fingerprints are made from."""
    from vllm.platforms import current_platform

    return identity_from_vllm(
        vllm_config, kv_layout=native_layout(spec, row_bytes), model_id=settings.model_id,
        weights_version=settings.weights_version, device=str(current_platform.device_type),
        block_size=chunk_tokens(spec), checkpoint=True)


def identity_for_spec(spec: Any, settings: NativeTierSettings,
                      row_bytes: int) -> tuple[EngineIdentity, str]:
    """The identity of the engine building ``spec``'s tier, and where its config was found;
    :class:`NativeTierIdentityError` when the engine's ``VllmConfig`` is nowhere to be seen."""
    engine_id = spec.config.engine_id
    found = find_vllm_config(engine_id)
    if found is None:
        raise NativeTierIdentityError(
            f"kvtier native Redis tier: cannot find the engine's VllmConfig (engine_id "
            f"{engine_id!r}): neither vLLM's current config nor a 'vllm_config' of a caller "
            f"(vLLM's OffloadingConnectorScheduler) belongs to this engine, so the namespace "
            f"could not include quantization, revision, model dtype and checkpoint. Fix: build "
            f"the tier through vLLM's OffloadingConnector (kv_connector='OffloadingConnector'), "
            f"or inside vllm.config.set_current_vllm_config(config) whose "
            f"kv_transfer_config.engine_id is the OffloadingConfig's engine_id")
    vllm_config, where = found
    return native_identity(spec, settings, row_bytes, vllm_config), where
