"""``TieredOffloadingConnector``: kvtier's CPU + Redis tiers inside a vLLM v1 engine.

Load with ``kv_connector="TieredOffloadingConnector"``, ``kv_connector_module_path=
"connector"`` (or nothing once kvtier is installed: the ``vllm.general_plugins`` entry point
registers the name) and ``kv_role="kv_both"``. Settings: :mod:`connector.connector_config`.

This module is the only one of kvtier that imports vLLM. It adapts vLLM's objects to the
scheduler half (:mod:`connector.scheduler_side`) and the worker half
(:mod:`connector.worker_side`), which run in one process and share a :class:`TierRuntime`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connector import connector_stats
from connector.connector_config import ConnectorConfigError, load_config
from connector.connector_metadata import TIER_CPU, TIER_REDIS, StepPlan
from connector.scheduler_side import ATTENTION, MAMBA, GroupSpec, TieredScheduler
from connector.worker_side import MEDIUM_CPU, TierChange, TieredWorker, TierRuntime
from offload_tiers.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.connector")

# Runtimes of the engines in this process, by engine id: the scheduler half finds the tiers
# its worker half created. Kept after shutdown (without tiers) so stats stay readable.
_RUNTIMES: dict[str, TierRuntime] = {}
_RUNTIMES_LOCK = threading.Lock()

NOT_COLOCATED = (
    "TieredOffloadingConnector runs its scheduler and worker halves in one process "
    "(vLLM's UniProcExecutor: tensor_parallel_size=1, pipeline_parallel_size=1, "
    "data_parallel_size=1). Found {detail}. Fix: run one engine per GPU/CPU with "
    "tensor_parallel_size=1, or use another connector for multi-process workers."
)


def runtime_stats(engine_id: str | None = None) -> dict[str, Any]:
    """Cumulative kvtier counters of an engine in this process (the last one by default).

    Keys: ``hit_tokens_cpu``, ``hit_tokens_redis``, ``lookups``, ``bytes_loaded``, ...
    (see :data:`connector.connector_stats.COUNTER_NAMES`), ``redis_available`` and the
    tiers' own stats under ``cpu_tier`` / ``redis_tier``. Empty when no engine ran.
    """
    with _RUNTIMES_LOCK:
        if engine_id is None:
            if not _RUNTIMES:
                return {}
            engine_id = next(reversed(_RUNTIMES))
        runtime = _RUNTIMES.get(engine_id)
    return runtime.stats() if runtime is not None else {}


def engine_ids() -> list[str]:
    """Engine ids with kvtier runtimes in this process, oldest first."""
    with _RUNTIMES_LOCK:
        return list(_RUNTIMES)


class TieredConnectorMetadata(KVConnectorMetadata):
    """One step's plan (keys, slots, block ids) from the scheduler half to the worker."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class TieredConnectorStats(KVConnectorStats):
    """Per-interval counter deltas (see :mod:`connector.connector_stats`)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = connector_stats.aggregate(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if isinstance(v, (int, float))}

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in connector_stats.COUNTER_NAMES)


class TieredPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvtier_*`` counters per engine, fed from the stats deltas."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric],
                 type[PromMetricT]], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name in connector_stats.COUNTER_NAMES:
            metric = self._counter_cls(name=f"vllm:kvtier_{name}",
                                       documentation=f"kvtier connector: {name}",
                                       labelnames=labelnames)
            self._counters[name] = self.make_per_engine(metric)
        gauge = self._gauge_cls(name="vllm:kvtier_redis_available",
                                documentation="1 when kvtier's Redis tier answers",
                                labelnames=labelnames, multiprocess_mode="mostrecent")
        self._available = self.make_per_engine(gauge)

    def make_per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values)
                for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self._counters and value:
                self._counters[name][engine_idx].inc(value)
        if "redis_available" in transfer_stats_data:
            self._available[engine_idx].set(transfer_stats_data["redis_available"])


def _group_specs(kv_cache_config: KVCacheConfig) -> list[GroupSpec]:
    specs = []
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            kind = MAMBA if getattr(spec, "mamba_cache_mode", "none") == "align" \
                else "mamba-" + str(getattr(spec, "mamba_cache_mode", "none"))
        elif isinstance(spec, AttentionSpec) and getattr(spec, "sliding_window", None) is None \
                and getattr(spec, "attention_chunk_size", None) is None \
                and type(spec).__name__ == "FullAttentionSpec":
            kind = ATTENTION
        else:
            kind = type(spec).__name__
        specs.append(GroupSpec(group_id, kind, int(spec.block_size)))
    return specs


class TieredOffloadingConnector(KVConnectorBase_V1, SupportsHMA):
    """CPU + Redis KV offloading that is correct for partial prefix-cache entries."""

    _cache_hit_source = CacheHitSource.HOST

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss, never a lost result

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = load_config(self._kv_transfer_config.kv_connector_extra_config)
        self.engine_id = str(self._kv_transfer_config.engine_id)
        self.groups = _group_specs(kv_cache_config)
        self.worker: TieredWorker | None = None
        self.scheduler: TieredScheduler | None = None
        self._block_pool: Any = None
        self._namespaces: dict[str, str] = {}
        parallel = vllm_config.parallel_config
        if parallel.world_size > 1 or parallel.data_parallel_size > 1:
            raise RuntimeError(NOT_COLOCATED.format(
                detail=f"world_size={parallel.world_size}, "
                       f"data_parallel_size={parallel.data_parallel_size}"))
        if not vllm_config.cache_config.enable_prefix_caching:
            raise ConnectorConfigError(
                "TieredOffloadingConnector needs prefix caching (block hashes). "
                "Fix: pass enable_prefix_caching=True")
        if role == KVConnectorRole.WORKER:
            runtime = TierRuntime(self.config)
            with _RUNTIMES_LOCK:
                _RUNTIMES[self.engine_id] = runtime
            self.runtime = runtime
            self.worker = TieredWorker(runtime)
            log.info("kvtier worker: settings %s", self.config.describe())
            return
        with _RUNTIMES_LOCK:
            runtime_or_none = _RUNTIMES.get(self.engine_id)
        if runtime_or_none is None or runtime_or_none.cpu is None:
            raise RuntimeError(NOT_COLOCATED.format(
                detail="no worker half of this engine in the scheduler's process"))
        self.runtime = runtime_or_none
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            # kvtier is a cache: a block that fails to load is recomputed, never fatal.
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        _, hash_unit = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        self.scheduler = TieredScheduler(
            self.runtime, self.groups, int(hash_unit), self._fingerprint,
            self._blocks_of, self._pool_block)
        log.info("kvtier scheduler: groups %s, hash unit %d, layout %s",
                 [(g.group, g.kind, g.block_size) for g in self.groups], hash_unit,
                 self.runtime.layout.descriptor() if self.runtime.layout else "?")

    # ================================================================ helpers
    def _fingerprint(self, tenant: str) -> str:
        fp = self._namespaces.get(tenant)
        if fp is None:
            model_config = self._vllm_config.model_config
            layout = self.runtime.layout
            assert layout is not None
            fp = Namespace(
                model=self.config.model_id or str(model_config.model),
                dtype=str(model_config.dtype).replace("torch.", ""),
                kv_layout=layout.descriptor(),
                block_size=int(self._vllm_config.cache_config.block_size),
                tp_rank=0, tp_size=1, tenant=tenant,
            ).fingerprint
            self._namespaces[tenant] = fp
        return fp

    def _blocks_of(self, req_id: str) -> Any:
        assert self._kv_cache_manager is not None
        return self._kv_cache_manager.get_blocks(req_id).blocks

    def _pool_block(self, block_id: int) -> Any:
        return self._block_pool.blocks[block_id]

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        groups = [(g.group, g.kind, g.block_size,
                   list(self._kv_cache_config.kv_cache_groups[g.group].layer_names))
                  for g in self.groups]
        layout = self.worker.register(kv_caches, groups, int(self._kv_cache_config.num_blocks))
        log.info("kvtier: %d-byte slots, layout %s", layout.slot_bytes, layout.descriptor())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, TieredConnectorMetadata)
        self.worker.load(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # saves run once per step in wait_for_save, after the forward

    def wait_for_save(self) -> None:
        if self.worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, TieredConnectorMetadata)
        self.worker.save(meta.plan)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose asynchronous (hybrid) loads ran; saves never outlive a step."""
        if self.worker is None:
            return None, None
        return None, self.worker.take_finished_recving() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.worker is None:
            return set()
        errors = self.worker.take_load_errors()
        if errors and len(self.groups) > 1:
            raise RuntimeError("kvtier: a load failed on a multi-group model; vLLM cannot "
                               "recompute single blocks there, so the step is refused")
        return errors

    def shutdown(self) -> None:
        """Either half shutting down ends the engine: close the tiers (stats stay readable)."""
        self.runtime.close()

    # ================================================================ scheduler side
    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._block_pool = gpu_block_pool

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.scheduler is None:
            return 0, False
        hit = self.scheduler.lookup(request, num_computed_tokens)
        return hit, hit > 0 and self.scheduler.load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        if self.scheduler is not None:
            self.scheduler.on_alloc(request, blocks.blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        if self.scheduler is None or num_external_tokens == 0:
            return {}
        tiers = self.scheduler.hit_tiers(request.request_id)
        out: dict[CacheHitSource, int] = {}
        if tiers.get(TIER_CPU):
            out[CacheHitSource.HOST] = tiers[TIER_CPU]
        if tiers.get(TIER_REDIS):
            out[CacheHitSource.EXTERNAL_UNSPECIFIED] = tiers[TIER_REDIS]
        if sum(out.values()) != num_external_tokens:
            return {CacheHitSource.HOST: num_external_tokens}
        return out

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.scheduler is None:
            return TieredConnectorMetadata(StepPlan())
        scheduled = scheduler_output.num_scheduled_tokens
        computed_after: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            computed_after[new.req_id] = new.num_computed_tokens + scheduled.get(new.req_id, 0)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed_after[req_id] = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
        preempted = set(scheduler_output.preempted_req_ids or ())
        for req_id in preempted:
            self.scheduler.preempted(req_id)
        gone = preempted | set(scheduler_output.finished_req_ids or ())
        state = scheduler_output.kv_connector_block_state
        boundary = state.boundary_state_offloads if state is not None else {}
        plan = self.scheduler.plan(computed_after, boundary or {}, gone)
        self.runtime.refresh_redis_gauge()
        return TieredConnectorMetadata(plan)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is not None:
            self.scheduler.finished(request.request_id)
        return False, None

    def request_finished_all_groups(
            self, request: Request,
            block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        # Saves finish inside the step that computed the blocks (wait_for_save), so no
        # block outlives its request on kvtier's account.
        return self.request_finished(request, [])

    def take_events(self) -> Iterable[KVCacheEvent]:
        if self.scheduler is None:
            return ()
        events: list[KVCacheEvent] = []
        outbox = self.runtime.outbox
        while outbox:
            change = outbox.popleft()
            event = self._event(change)
            if event is not None:
                events.append(event)
        self.runtime.counters.add("events_emitted", len(events))
        return events

    def _event(self, change: TierChange) -> KVCacheEvent | None:
        key = change.key
        group = self.groups[key.group] if key.group < len(self.groups) else None
        spec_kind = "mamba" if group is not None and group.kind == MAMBA else "full_attention"
        block_hash = maybe_convert_block_hash(key.block_hash)
        if not change.stored:
            return BlockRemoved(block_hashes=[block_hash], medium=change.medium,
                                group_idx=key.group)
        assert self.scheduler is not None
        info = self.scheduler.event_info.get(key)
        if info is None:
            return None  # nothing reliable to announce (payload description unknown)
        parent = maybe_convert_block_hash(info.parent_hash) if info.parent_hash else None
        return BlockStored(
            block_hashes=[block_hash], parent_block_hash=parent,
            token_ids=list(info.token_ids), block_size=info.block_size, lora_id=None,
            medium=change.medium, lora_name=None, group_idx=key.group,
            kv_cache_spec_kind=spec_kind,
        )

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.scheduler is None:
            return None  # the scheduler half reports for both halves (one process)
        delta = self.runtime.counters.take_delta()
        return TieredConnectorStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return TieredConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return TieredPromMetrics(vllm_config, metric_types, labelnames,
                                 per_engine_labelvalues)

    def reset_cache(self) -> bool | None:
        """Empty the CPU tier (Redis is shared with other engines and is left alone)."""
        cpu = self.runtime.cpu
        if cpu is None:
            return True
        for key in cpu.keys():
            if cpu.remove(key):
                self.runtime.outbox.append(TierChange(key, MEDIUM_CPU, stored=False))
        return True
