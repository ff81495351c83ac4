"""``TieredOffloadingConnector``: kvtier's CPU + Redis tiers inside a vLLM v1 engine.

Load with ``kv_connector="TieredOffloadingConnector"``, ``kv_connector_module_path=
"connector"`` (or nothing once kvtier is installed: the ``vllm.general_plugins`` entry point
registers the name) and ``kv_role="kv_both"``. Settings: :mod:`connector.vllm_connector.config`.

This module adapts vLLM's objects to the scheduler half (:mod:`connector.vllm_connector.scheduler`,
vLLM's engine-core process) and the worker half (:mod:`connector.vllm_connector.worker`, one per TP
rank, in vLLM's worker processes). The halves share nothing but vLLM's channels: the step
plan in the connector metadata, and the workers' :class:`WorkerReport`, transfer results and
stats on the way back. It works with vLLM's default executors (multiprocess), the OpenAI
server, tensor parallelism and data parallelism (each DP engine is its own engine).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.platforms import current_platform
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connector.identity.engine import identity_from_vllm
from connector.identity.engine_core import WeightVersionSource
from connector.identity.generation import Generation
from connector.vllm_connector import stats as connector_stats
from connector.vllm_connector import vllm_api
from connector.vllm_connector.bounded_cache import BoundedCache
from connector.vllm_connector.config import (
    ConnectorConfigError,
    check_parallel_shape,
    load_config,
)
from connector.vllm_connector.declared_layout import declared_block_dims, manager_block_views
from connector.vllm_connector.host import HostTierMirror
from connector.vllm_connector.host import connect as host_connect
from connector.vllm_connector.jobs import TierChange
from connector.vllm_connector.namespace import kv_groups_descriptor
from connector.vllm_connector.plan import (
    StepPlan,
    WorkerReport,
    plan_from_wire,
    report_from_wire,
    to_wire,
)
from connector.vllm_connector.presence import presence_source
from connector.vllm_connector.remote_store_factory import open_remote_store
from connector.vllm_connector.scheduler import (
    ATTENTION,
    MAMBA,
    GroupSpec,
    TieredScheduler,
)
from connector.vllm_connector.secondary import HitSource
from connector.vllm_connector.slot_sizing import expected_slot_bytes, slot_count
from connector.vllm_connector.worker import TieredWorker
from offload_tiers.thread_priority import set_background_nice

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.connector")

#: ``ownership`` of kvtier's own KV events ("secondary offloading tier identifier" in
#: vLLM's schema), so consumers tell its CPU/STORAGE announcements from vLLM's.
EVENT_OWNERSHIP = "kvtier"

#: Distinct tenants (cache_salt values) whose fingerprints are kept; more are recomputed.
TENANT_CACHE_MAX = 4096


class TieredConnectorMetadata(KVConnectorMetadata):
    """One step's plan (keys, slots, block ids, job ids) from the scheduler to every worker."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # vLLM pickles this into every step's broadcast to the workers. Most steps' plans are
        # empty; the rest go as msgpack (pickling the dataclasses costs ~60 us each way).
        if not self.plan:
            return _quiet_metadata, (self.plan.layout_known, self.plan.idle)
        return _metadata_from_wire, (to_wire(self.plan),)


def _quiet_metadata(layout_known: bool, idle: bool = False) -> TieredConnectorMetadata:
    """The metadata of a step with nothing to do (see ``__reduce__``)."""
    return TieredConnectorMetadata(StepPlan(layout_known=layout_known, idle=idle))


def _metadata_from_wire(data: bytes) -> TieredConnectorMetadata:
    return TieredConnectorMetadata(plan_from_wire(data))


class TieredWorkerMetadata(KVConnectorWorkerMetadata):
    """One rank's :class:`WorkerReport`; vLLM merges the ranks' with :meth:`aggregate`."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TieredWorkerMetadata)
        self.report.merge(other.report)
        return self

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _worker_metadata_from_wire, (to_wire(self.report),)


def _worker_metadata_from_wire(data: bytes) -> TieredWorkerMetadata:
    return TieredWorkerMetadata(report_from_wire(data))


class TieredHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler half once, at start: its tensors' layout (the
    storage names' rank fingerprints depend on it), before the first request."""

    def __init__(self, layout: str) -> None:
        self.layout = layout


class TieredConnectorStats(KVConnectorStats):
    """Per-interval counter deltas (see :mod:`connector.vllm_connector.stats`)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = connector_stats.aggregate(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if isinstance(v, (int, float))}

    def is_empty(self) -> bool:
        return not self.data


class TieredPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvtier_*`` counters per engine, fed from the stats deltas."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric],
                 type[PromMetricT]], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, help_text in connector_stats.COUNTERS.items():
            metric = self._counter_cls(name=f"vllm:kvtier_{name}", documentation=help_text,
                                       labelnames=labelnames)
            self._counters[name] = self.make_per_engine(metric)
        self._gauges: dict[str, dict[int, Any]] = {}
        for name, help_text in connector_stats.GAUGES.items():
            gauge = self._gauge_cls(name=f"vllm:kvtier_{name}", documentation=help_text,
                                    labelnames=labelnames, multiprocess_mode="mostrecent")
            self._gauges[name] = self.make_per_engine(gauge)

    def make_per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values)
                for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self._counters and value:
                self._counters[name][engine_idx].inc(value)
        for name, per_engine in self._gauges.items():
            if name in transfer_stats_data:
                per_engine[engine_idx].set(transfer_stats_data[name])


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
        set_background_nice(self.config.background_nice)
        self.groups = _group_specs(kv_cache_config)
        self.worker: TieredWorker | None = None
        self._kv_caches: dict[str, torch.Tensor] | None = None
        self.scheduler: TieredScheduler | None = None
        self._block_pool: Any = None
        parallel = vllm_config.parallel_config
        check_parallel_shape(parallel)
        if not vllm_config.cache_config.enable_prefix_caching:
            raise ConnectorConfigError(
                "TieredOffloadingConnector needs prefix caching (block hashes). "
                "Fix: pass enable_prefix_caching=True")
        slot_bytes = expected_slot_bytes(kv_cache_config)
        num_slots = slot_count(self.config.cpu_bytes, slot_bytes)
        self.tp_size = int(parallel.tensor_parallel_size)
        if role == KVConnectorRole.WORKER:
            self._start_worker(num_slots)
        else:
            self._start_scheduler(vllm_config, kv_cache_config, num_slots, slot_bytes)

    def _start_scheduler(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                         num_slots: int, slot_bytes: int) -> None:
        """The scheduler half: the engine's identity, its namespace and the tier chain."""
        parallel = vllm_config.parallel_config
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            # kvtier is a cache: a block that fails to load is recomputed, never fatal.
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        _, hash_unit = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        # Only the scheduler half computes the identity (the checkpoint's files are read
        # once): every key of the plan carries the fingerprint it yields.
        self.identity = identity_from_vllm(
            vllm_config, kv_layout=kv_groups_descriptor(kv_cache_config),
            model_id=self.config.model_id, weights_version=self.config.weights_version,
            device=str(current_platform.device_type),
            checkpoint=self.config.checkpoint_identity)
        events = vllm_config.kv_events_config
        # vLLM publishes the connector's events only where KV events are enabled; else they
        # are not even built (30 BlockStored per 480-token request, on the step's path).
        self._events_on = bool(events is not None and events.enable_kv_cache_events)
        self._weights = WeightVersionSource()
        self._generation = Generation(self._weights.read())
        self._namespaces: BoundedCache[str, str] = BoundedCache(TENANT_CACHE_MAX)
        host = HostTierMirror(host_connect(
            self.config.host_tier_socket, "scheduler", subscribe=True,
            presence=self.config.host_tier_redis and self.config.presence,
            group=self.config.host_tier_group),
            int(parallel.world_size)) \
            if self.config.host_tier_socket else None
        presence = presence_source(self.config, host.client if host is not None else None)
        self.scheduler = TieredScheduler(
            self.config, self.groups, int(hash_unit), num_slots, slot_bytes,
            int(parallel.world_size), self._fingerprint, self._blocks_of, self._pool_block,
            presence=presence, host=host, events=self._events_on)
        log.info("kvtier scheduler: groups %s, hash unit %d, %d CPU-tier slots of %d bytes, "
                 "%d rank(s), settings %s", [(g.group, g.kind, g.block_size) for g in self.groups],
                 hash_unit, num_slots, slot_bytes, parallel.world_size, self.config.describe())
        for warning in self.config.redis_warnings:  # once per engine: the scheduler half
            log.warning("kvtier: %s", warning)
        log.info("kvtier namespace: checkpoint %s; %s", self.identity.checkpoint,
                 "after a connector reset the generation follows vLLM's weight version "
                 "(update_weight_version), else a random nonce" if self._weights.found else
                 "vLLM's weight version is not visible here: after a connector reset this "
                 "engine shares nothing with other engines until it restarts")

    def _start_worker(self, num_slots: int) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = int(get_tensor_model_parallel_rank())
        host = host_connect(self.config.host_tier_socket, f"worker rank {rank}",
                            subscribe=False, group=self.config.host_tier_group) \
            if self.config.host_tier_socket else None
        self.worker = TieredWorker(self.config, rank, self.tp_size, num_slots,
                                   open_remote_store(self.config, host), host)

    # ================================================================ helpers
    def _fingerprint(self, tenant: str) -> str:
        fp = self._namespaces.get(tenant)
        if fp is None:
            fp = self.identity.fingerprint(tenant, self._generation.name)
            self._namespaces.put(tenant, fp)
        return fp

    def _follow_weight_version(self) -> None:
        """A weight version named since the last move moves the namespace (no reset needed).
        Called by every scheduler-side entry that looks up or stores under the namespace,
        before it does: vLLM asks for a step's hits (``get_num_new_matched_tokens``) before it
        builds the step's plan. One attribute read and a comparison."""
        if self._generation.observe(self._weights.read()):
            self._namespaces.clear()
            log.info("kvtier: vLLM weight version changed; namespace generation %s",
                     self._generation.name)

    def _blocks_of(self, req_id: str) -> Any:
        assert self._kv_cache_manager is not None
        return self._kv_cache_manager.get_blocks(req_id).blocks

    def _pool_block(self, block_id: int) -> Any:
        return self._block_pool.blocks[block_id]

    # ================================================================ worker side
    def _block_views(self, kv_caches: dict[str, torch.Tensor]
                     ) -> tuple[dict[str, Any], dict[str, list[int]]]:
        """vLLM's tensors as manager-block views, and where each one's block dimension is,
        as vLLM's allocator declares it (never a guess from sizes: a dimension may equal
        num_blocks by chance). Taken again at every (re)registration: a view taken before a
        sleep may name memory vLLM no longer uses."""
        views = manager_block_views(self._kv_cache_config, kv_caches)
        return views, declared_block_dims(self._vllm_config, self._kv_cache_config, views)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        groups = [(g.group, g.kind, g.block_size,
                   list(self._kv_cache_config.kv_cache_groups[g.group].layer_names))
                  for g in self.groups]
        self._kv_caches = kv_caches  # vLLM's own tensors: views are re-taken from them
        views, dims = self._block_views(kv_caches)
        layout = self.worker.register(views, groups, int(self._kv_cache_config.num_blocks),
                                      dims)
        parallel = self._vllm_config.parallel_config
        self.worker.adopt_spare_cores(int(parallel.tensor_parallel_size)
                                      * int(parallel.pipeline_parallel_size)
                                      * int(parallel.data_parallel_size))
        log.info("kvtier worker (TP rank %d/%d): %d slots of %d bytes, layout %s",
                 self.worker.tp_rank, self.tp_size, self.worker.num_slots, layout.slot_bytes,
                 layout.descriptor())

    # Sleep mode (vLLM >= 0.33: LLM.sleep / wake_up, RLHF weight updates). vLLM first pauses
    # and, by default, resets the connector's cache (reset_cache: CPU tier emptied, new
    # namespace generation), then calls these on every worker; it has drained its own
    # transfers, not kvtier's threads, which the worker handles (TieredWorker.unregister).
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """Yes: across a sleep no view of the KV memory is kept (taken again from vLLM's
        tensors at wake-up), saves in flight finish reading their blocks before the memory
        goes, and loads that end meanwhile are written after wake-up. The CPU tier is host
        memory (page-locked where CUDA is) and stays registered."""
        return True

    def unregister_kv_caches(self) -> None:
        """Before sleep: no KV block is read or written until :meth:`restore_kv_caches`."""
        if self.worker is not None:
            self.worker.unregister()

    def restore_kv_caches(self) -> None:
        """After wake-up: views of the KV tensors taken afresh, waiting loads written."""
        if self.worker is not None and self._kv_caches is not None:
            self.worker.restore(*self._block_views(self._kv_caches))

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM >= 0.34: the workers copy blocks in their own process (torch / NumPy), never
        register the KV cache for RDMA nor export it, so any allocation works (the
        extensible KV cache included)."""
        return vllm_api.IN_PROCESS

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        """No (vLLM >= 0.34, EAGLE's lookahead hashing): kvtier's keys, its partial entries
        and the token ids its KV events announce take a block's hash to cover exactly
        ``block_hash_num_tokens`` tokens of the prompt; a lookahead hash covers more. vLLM
        then hashes as without speculation."""
        return False

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """This rank's layout, for the scheduler half (vLLM collects it after
        ``register_kv_caches`` and hands it to ``set_xfer_handshake_metadata``)."""
        if self.worker is None or self.worker.layout is None:
            return None
        return TieredHandshake(self.worker.layout.descriptor())

    def _plan(self) -> StepPlan | None:
        if self.worker is None or not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        assert isinstance(meta, TieredConnectorMetadata)
        return meta.plan

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """The first call of every step, before any KV block can be written: the last
        step's saves finish copying (the saver thread); in a step with a forward, Redis
        fetches leave the compute cores (affinity.SpareCores.forward_starts)."""
        if self.worker is not None:
            self.worker.fence()
            if isinstance(kv_connector_metadata, TieredConnectorMetadata) \
                    and not kv_connector_metadata.plan.idle:
                self.worker.forward_starts()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._plan()
        if plan is not None:
            assert self.worker is not None
            self.worker.start_step(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # saves run once per step in wait_for_save, after the forward

    def wait_for_save(self) -> None:
        plan = self._plan()
        if plan is not None:
            assert self.worker is not None
            self.worker.save(plan)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Asynchronous loads that finished (failed ones also in ``failed_recving``)."""
        if self.worker is None:
            return KVConnectorTransferResults()
        done, failed, sent = self.worker.take_transfer_results()
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=done,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of failed synchronous loads (single-group models; hybrid loads are
        asynchronous and fail through ``failed_recving``)."""
        return self.worker.take_load_errors() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.worker is None:
            return None
        report = self.worker.take_report()
        return TieredWorkerMetadata(report) if report else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()

    # ================================================================ scheduler side
    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._block_pool = gpu_block_pool

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]
                                    ) -> None:
        """Rank 0's layout before the first request (else it comes with the first report)."""
        rank0 = metadata.get(0)
        if self.scheduler is not None and isinstance(rank0, TieredHandshake):
            self.scheduler.on_report(WorkerReport(rank0_layout=rank0.layout))

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.scheduler is None:
            return 0, False
        self._follow_weight_version()
        return self.scheduler.lookup(request, num_computed_tokens)

    def may_load_async(self, request: Request) -> bool:
        """vLLM >= 0.34 (``--max-num-inflight-kv-loads``): whether a lookup may answer with an
        asynchronous load, asked when the request enters the waiting queues. True only when
        a hit beyond vLLM's own cache may exist and would load asynchronously: in the host
        tier, in Redis by the presence summary (every miss while it is off or not synced),
        or any hit on a hybrid model; CPU-tier hits of attention-only models load in the
        step. Books only: no probe, nothing held."""
        if self.scheduler is None:
            return False
        self._follow_weight_version()
        local = vllm_api.local_hit_tokens(self._kv_cache_manager, request)
        return self.scheduler.may_load_async(request, local)

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
        if tiers.get(HitSource.CPU) or tiers.get(HitSource.HOST):
            out[CacheHitSource.HOST] = tiers.get(HitSource.CPU, 0) + tiers.get(HitSource.HOST, 0)
        if tiers.get(HitSource.REDIS):
            out[CacheHitSource.EXTERNAL_UNSPECIFIED] = tiers[HitSource.REDIS]
        if sum(out.values()) != num_external_tokens:
            return {CacheHitSource.HOST: num_external_tokens}
        return out

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.scheduler is None:
            return TieredConnectorMetadata(StepPlan())
        self._follow_weight_version()
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
        plan.idle = scheduler_output.total_num_scheduled_tokens == 0
        return TieredConnectorMetadata(plan)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if self.scheduler is not None and isinstance(meta, TieredWorkerMetadata):
            self.scheduler.on_report(meta.report)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is not None:
            self.scheduler.finished(request.request_id)
        return False, None

    def register_finished_partial_tail(self, request: Request,
                                       block_ids: tuple[list[int], ...],
                                       partial_tail_offloads: list[tuple[int, int, int]]
                                       ) -> bool:
        """Keep a finishing request's Mamba partial tail: saved in the next step, its blocks
        held by vLLM until the workers report them copied."""
        if self.scheduler is None:
            return False
        self._follow_weight_version()
        return self.scheduler.register_tail(request, partial_tail_offloads)

    def request_finished_all_groups(
            self, request: Request,
            block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        # A save copies its block inside the step that computed it (wait_for_save), so no
        # block outlives its request on kvtier's account.
        return self.request_finished(request, [])

    def take_events(self) -> Iterable[KVCacheEvent]:
        if self.scheduler is None:
            return ()
        outbox = self.scheduler.outbox
        if not outbox:
            return ()
        if not self._events_on:
            outbox.clear()
            return ()
        events: list[KVCacheEvent] = []
        while outbox:
            event = self._event(outbox.popleft())
            if event is not None:
                events.append(event)
        self.scheduler.counters.add("events_emitted", len(events))
        return events

    def _event(self, change: TierChange) -> KVCacheEvent | None:
        key = change.key
        group = self.groups[key.group] if key.group < len(self.groups) else None
        spec_kind = "mamba" if group is not None and group.kind == MAMBA else "full_attention"
        block_hash = maybe_convert_block_hash(key.block_hash)
        if not change.stored:
            return BlockRemoved(block_hashes=[block_hash], medium=change.medium,
                                group_idx=key.group, ownership=EVENT_OWNERSHIP)
        assert self.scheduler is not None
        info = self.scheduler.event_info.get(key)
        if info is None:
            return None  # nothing reliable to announce (payload description unknown)
        parent = maybe_convert_block_hash(info.parent_hash) if info.parent_hash else None
        return BlockStored(
            block_hashes=[block_hash], parent_block_hash=parent,
            token_ids=list(info.token_ids), block_size=info.block_size, lora_id=None,
            medium=change.medium, lora_name=None, group_idx=key.group,
            kv_cache_spec_kind=spec_kind, ownership=EVENT_OWNERSHIP,
        )

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        half = self.scheduler if self.scheduler is not None else self.worker
        if half is None:
            return None
        if self.scheduler is not None:
            self.scheduler.refresh_gauges()
        delta = half.counters.take_delta()
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
        """Connector-cache reset (e.g. after a weight update): empty the CPU tier and move to
        a new namespace generation — vLLM's weight version when the user named new weights
        since the last move (a version change followed, or a reset), else a random nonce no
        other engine can hold — so no entry stored before, in the CPU tier or in Redis, is
        ever served again. Redis values of older generations are left to expire (TTL) or to
        the janitor; other engines sharing Redis are not affected."""
        if self.scheduler is None:
            return True
        self.scheduler.reset()
        self._generation.reset(self._weights.read())
        self._namespaces.clear()
        log.info("kvtier: connector cache reset; namespace generation %s",
                 self._generation.name)
        return True
