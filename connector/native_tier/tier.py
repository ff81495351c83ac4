"""kvtier's Redis tier as a secondary tier of vLLM's native multi-tier offloading.

Load it with ``"spec_name": "TieringOffloadingSpec"`` and ``"secondary_tiers": [{"type":
"KvtierRedisTier", "module_path": "connector.native_tier.tier", "redis_url": "redis://..."}]``.

Rules this module keeps (vLLM's ``tiering/base.py`` contract, kvtier's storage rules):

* Every scheduler-side method only keeps books: no Redis round trip on the calling thread.
  Stores go to the Redis tier's write-behind thread (``submit_put`` with ``on_done``, no
  copy: the framework pins the primary chunk until the job is reported); loads run on this
  tier's own I/O threads with ``get_many_into``, straight into the primary tier's rows,
  validated there. Results are picked up by ``get_finished_jobs``.
* One Redis key per chunk, with kvtier's self-checking header: the namespace fingerprint
  covers the model (name or ``model_id``, the digest of a local checkpoint's
  ``config.json``), ``weights_version``, the KV-cache dtype, the offloading layout (groups
  and their layers, chunk size, row bytes, canonical/direct, replicated) and the parallel
  shape (TP/PP/CP sizes, world size, rank). A chunk row holds every TP rank's share.
  A corrupt, foreign or truncated value is a miss; a failed load reports the keys that did
  load (``successful_keys``) and the rest become misses.
* A chunk key carries what its hash covers: ``num_tokens`` is the end position vLLM records
  for the key in the request (``ReqContext.get_offload_key_position``), the kind is FULL
  when that ends a whole chunk, else PARTIAL. A key without a recorded position is a miss.
* Look-ups answer from what this tier knows (chunks it stored or loaded in this process,
  bounded LRU) and otherwise from an asynchronous existence check (``exists_many``):
  "retry later", never a wait. While Redis is unavailable every look-up is a miss.
* Redis faults never raise: reads miss, writes are counted drops (``RedisTier``).
* Logs and errors carry the redacted URL only.

This module imports vLLM (it is loaded by vLLM); ``offload_tiers`` stays vLLM-free.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import (
    JobId,
    JobResult,
    ScheduleEndContext,
    SecondaryTierManager,
    TransferJob,
)

from connector.native_tier.config import NativeTierSettings, load_native_settings
from offload_tiers.keys import BlockKey, BlockKind, Namespace
from offload_tiers.redis.tier import RedisTier

log = logging.getLogger(__name__)

OWNERSHIP = "kvtier-redis"
METRIC_PREFIX = "vllm:kvtier_native_"

#: Counters this tier exports (``vllm:kvtier_native_<name>``).
COUNTERS = {
    "stored_chunks": "Chunks written to Redis by cascade jobs.",
    "store_failures": "Chunks a cascade job could not write (Redis refused or timed out).",
    "store_drops": "Chunks dropped before any write (queue full or Redis unavailable).",
    "store_skipped_present": "Chunks a cascade job skipped because this tier holds them.",
    "loaded_chunks": "Chunks promoted from Redis into the primary tier, validated.",
    "load_misses": "Chunks a promotion could not load (absent, bad value or Redis fault).",
    "lookup_known_hits": "Look-ups answered from chunks this tier stored or loaded.",
    "lookup_checked_hits": "Look-ups answered by the asynchronous existence check: present.",
    "lookup_misses": "Look-ups answered as a miss.",
    "lookup_retries": "Look-ups answered 'retry later' (existence check in flight).",
    "lookup_unavailable": "Look-ups answered as a miss because Redis is unavailable.",
    "unpositioned_keys": "Keys without a recorded token position (treated as misses).",
    "corrupt_values": "Values refused by the header/checksum check (corrupt or foreign).",
    "redis_unavailable_events": "Times Redis became unavailable.",
    "redis_recoveries": "Times Redis answered again after being unavailable.",
}
GAUGES = {
    "redis_available": "1 while Redis answers, else 0.",
    "inflight_jobs": "Load and store jobs submitted and not yet reported.",
}


def namespace_for(spec: OffloadingSpec, settings: NativeTierSettings, row_bytes: int) -> Namespace:
    """Everything that must match for a stored chunk row to be valid in another engine."""
    cfg = spec.config
    par = cfg.parallel
    groups = ";".join(f"g{g.group_id}:t{g.tokens_per_block}:l{len(g.layer_names)}:"
                      f"{','.join(g.layer_names)}" for g in cfg.groups)
    layout = (f"native-tiering|kv_layout={cfg.kv_cache_layout}|canonical={cfg.canonical_layout}"
              f"|replicated={cfg.replicated_layout}|agnostic={par.is_parallelism_agnostic}"
              f"|bpc={cfg.cache.blocks_per_chunk}|tph={cfg.cache.tokens_per_hash}"
              f"|worker_bytes={cfg.worker_kv_bytes_per_block}|row={row_bytes}|{groups}")
    parallel = (f"world={par.world_size}|pp={par.pp_size}|pcp={par.pcp_size}"
                f"|dcp={par.dcp_size}")
    return Namespace(
        model=f"{settings.model_id or cfg.model.name}#weights={settings.weights_version}"
              f"#arch={_architecture(cfg.model.name)}",
        dtype=f"kv={cfg.model.dtype}",
        kv_layout=f"{layout}|{parallel}",
        block_size=cfg.cache.blocks_per_chunk * max(g.tokens_per_block for g in cfg.groups),
        tp_rank=par.rank, tp_size=par.tp_size,
    )


def _architecture(model: str) -> str:
    """A digest of the model's ``config.json`` when ``model`` is a local checkpoint, else
    ``hub`` (the name then identifies it; ``weights_version`` tells revisions apart)."""
    from connector.vllm_connector.namespace import architecture_digest

    path = Path(model) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return "hub"
    return architecture_digest(SimpleNamespace(to_dict=lambda: data))


class _ExistenceChecks(AsyncLookupManager):
    """vLLM's asynchronous look-up bookkeeping, answered by ``RedisTier.exists_many``."""

    def __init__(self, tier: KvtierRedisTier) -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        block_keys = [self._tier.block_key(k, req_context) for k in keys]
        ask = [bk for bk in block_keys if bk is not None]
        found = iter(self._tier.redis.exists_many(ask))
        return [bk is not None and next(found) for bk in block_keys]


@dataclass(slots=True)
class _Job:
    """One submitted transfer: what the scheduler thread needs to report it."""

    job_id: JobId
    keys: list[OffloadKey]
    is_load: bool
    started: float = field(default_factory=time.monotonic)
    oks: list[bool] = field(default_factory=list)
    pending: int = 0
    future: Future | None = None


class KvtierRedisTier(SecondaryTierManager):
    """kvtier's Redis tier behind vLLM's ``SecondaryTierManager`` interface."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview,
                 tier_type: str, backpressure_detector: BackpressureDetector | None = None,
                 **settings: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.settings = load_native_settings(settings, tier_type)
        self.locality = Locality(self.settings.locality) if self.settings.locality else None
        self._rows = np.asarray(primary_kv_view).view(np.uint8)
        self.namespace = namespace_for(offloading_spec, self.settings, self.block_size_bytes)
        self._fp = self.namespace.fingerprint
        bpc = offloading_spec.config.cache.blocks_per_chunk
        self._chunk_tokens = {g.group_id: g.tokens_per_block * bpc
                              for g in offloading_spec.config.groups}
        s = self.settings
        self.redis = RedisTier.from_url(
            s.redis_url, prefix=s.redis_prefix, ttl_s=s.redis_ttl_s,
            redis_timeout_s=s.redis_timeout_s, ssl_ca_certs=s.redis_ssl_ca_certs,
            write_queue_max=s.write_queue_max,
            write_queue_max_bytes=max(s.write_queue_max * self.block_size_bytes, 1 << 20),
            **({"password": s.redis_password()} if s.redis_password_env else {}))
        if not self.redis.available:
            log.warning("kvtier native tier: Redis at %s is not answering (%s); look-ups miss "
                        "and stores drop until it does", self.redis.target.redacted,
                        self.redis.last_error)
        self._events_on = s.kv_events and offloading_spec.kv_events_config.enable_kv_cache_events
        self._events: list[OffloadingEvent] = []
        self._known: OrderedDict[OffloadKey, None] = OrderedDict()
        self._jobs: dict[JobId, _Job] = {}
        self._done: deque[JobId] = deque()  # appended by I/O threads, drained by the scheduler
        self._cond = threading.Condition()
        self._io = ThreadPoolExecutor(max_workers=s.io_threads,
                                      thread_name_prefix="kvtier-native-io")
        self._checks = _ExistenceChecks(self)
        self._stats = OffloadingConnectorStats()
        self._redis_seen: dict[str, int] = {}
        self._closed = False
        log.info("kvtier native tier %s: Redis %s, prefix %s, namespace %s, row %d bytes",
                 tier_type, self.redis.target.redacted, s.redis_prefix, self._fp,
                 self.block_size_bytes)

    # ------------------------------------------------------------------ keys
    def block_key(self, key: OffloadKey, req_context: ReqContext) -> BlockKey | None:
        """kvtier's key for a chunk key of this request; None without a recorded position."""
        end = req_context.get_offload_key_position(key)
        if not end or end <= 0:
            return None
        group = get_offload_group_idx(key)
        per_chunk = self._chunk_tokens.get(group)
        kind = BlockKind.FULL if per_chunk and end % per_chunk == 0 else BlockKind.PARTIAL
        return BlockKey(self._fp, group, get_offload_block_hash(key), end, kind)

    def _count(self, name: str, n: int = 1) -> None:
        if n:
            self._stats.increase_counter(METRIC_PREFIX + name, n)

    def _remember(self, keys: Iterable[OffloadKey]) -> None:
        if self.settings.known_keys <= 0:
            return
        for key in keys:
            self._known[key] = None
            self._known.move_to_end(key)
        while len(self._known) > self.settings.known_keys:
            self._known.popitem(last=False)

    # ------------------------------------------------------------------ look-ups
    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if req_context.get_offload_key_position(key) is None:
            self._count("unpositioned_keys")
            self._count("lookup_misses")
            return LookupResult.MISS
        if not self.redis.available:
            self._count("lookup_unavailable")
            return LookupResult.MISS
        if key in self._known:
            self._known.move_to_end(key)
            self._count("lookup_known_hits")
            return LookupResult.HIT
        found = self._checks.lookup(key, req_context)
        if found is None:
            self._count("lookup_retries")
            return LookupResult.RETRY
        self._count("lookup_checked_hits" if found else "lookup_misses")
        return LookupResult.HIT if found else LookupResult.MISS

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._checks.flush()

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        self._checks.cleanup(req_context.req_id)

    # ------------------------------------------------------------------ transfers
    def _row(self, chunk_id: int) -> np.ndarray:
        return self._rows[int(chunk_id)]

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        job = _Job(job_metadata.job_id, keys, is_load=False, oks=[False] * len(keys))
        todo = []
        for i, (key, cid) in enumerate(zip(keys, job_metadata.chunk_ids, strict=True)):
            if key in self._known:
                job.oks[i] = True
                self._count("store_skipped_present")
                continue
            bk = self.block_key(key, job_metadata.req_context)
            if bk is None:
                self._count("unpositioned_keys")
                continue
            todo.append((i, bk, cid))
        job.pending = len(todo)
        self._jobs[job.job_id] = job
        if not todo:
            self._finish(job.job_id)
            return
        for i, bk, cid in todo:
            # The framework pins the chunk until this job is reported: the row is not copied.
            self.redis.submit_put(bk, memoryview(self._row(cid)),
                                  on_done=self._on_stored(job, i))

    def _on_stored(self, job: _Job, i: int):
        def done(ok: bool) -> None:  # Redis writer thread (or at once, on a drop)
            with self._cond:
                job.oks[i] = ok
                job.pending -= 1
                last = job.pending == 0
            if last:
                self._finish(job.job_id)
        return done

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        job = _Job(job_metadata.job_id, keys, is_load=True, oks=[False] * len(keys))
        block_keys = [self.block_key(k, job_metadata.req_context) for k in keys]
        chunk_ids = [int(c) for c in job_metadata.chunk_ids]
        self._jobs[job.job_id] = job
        with self._cond:
            job.future = self._io.submit(self._load, job, block_keys, chunk_ids)

    def _load(self, job: _Job, block_keys: list[BlockKey | None], chunk_ids: list[int]) -> None:
        """I/O thread: each value received straight into its primary row, validated there."""
        idx = [i for i, bk in enumerate(block_keys) if bk is not None]
        try:
            oks = self.redis.get_many_into([block_keys[i] for i in idx],
                                           [self._row(chunk_ids[i]) for i in idx])
            for i, ok in zip(idx, oks, strict=True):
                job.oks[i] = ok
        except Exception:  # a programming error; Redis trouble never raises
            log.exception("kvtier native tier: load job %d failed", job.job_id)
        self._finish(job.job_id)

    def _finish(self, job_id: JobId) -> None:
        with self._cond:
            self._done.append(job_id)
            self._cond.notify_all()

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        while True:
            with self._cond:
                if not self._done:
                    break
                job = self._jobs.pop(self._done.popleft())
            results.append(self._report(job))
        self._follow_redis()
        return results

    def _report(self, job: _Job) -> JobResult:
        good = [k for k, ok in zip(job.keys, job.oks, strict=True) if ok]
        bad = [k for k, ok in zip(job.keys, job.oks, strict=True) if not ok]
        nbytes = len(good) * self.block_size_bytes
        self._remember(good)
        if job.is_load:
            self._count("loaded_chunks", len(good))
            self._count("load_misses", len(bad))
            for key in bad:
                self._known.pop(key, None)
            self._checks.mark_miss(bad)
            if bad and self._events_on:
                self._events.append(self._event(bad, removed=True))
        else:
            self._count("stored_chunks", len(good))
            if good and self._events_on:
                self._events.append(self._event(good, removed=False))
        success = not bad
        partial = tuple(good) if job.is_load and good and bad else None
        return JobResult(job_id=job.job_id, success=success, successful_keys=partial,
                         transfer_time=time.monotonic() - job.started,
                         transfer_bytes=nbytes or None)

    def _event(self, keys: list[OffloadKey], *, removed: bool) -> OffloadingEvent:
        return OffloadingEvent(keys=keys, medium=Medium.STORAGE, removed=removed,
                               locality=self.locality, ownership=OWNERSHIP)

    def _follow_redis(self) -> None:
        """Mirror the Redis tier's counters (drops, faults, bad values) into this tier's."""
        st = self.redis.stats()
        for name, ours in (("corrupt", "corrupt_values"), ("put_failures", "store_failures"),
                           ("dropped_unavailable", "store_drops"), ("dropped", "store_drops"),
                           ("unavailable_events", "redis_unavailable_events"),
                           ("recoveries", "redis_recoveries")):
            seen = self._redis_seen.get(name, 0)
            if st[name] > seen:
                self._count(ours, st[name] - seen)
                self._redis_seen[name] = st[name]

    @override
    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ stats
    @classmethod
    @override
    def build_metric_definitions(cls, extra_config: dict[str, Any]
                                 ) -> dict[str, OffloadingMetricMetadata]:
        out: dict[str, OffloadingMetricMetadata] = {
            METRIC_PREFIX + name: OffloadingCounterMetadata(documentation=doc)
            for name, doc in COUNTERS.items()}
        out.update({METRIC_PREFIX + name: OffloadingGaugeMetadata(documentation=doc)
                    for name, doc in GAUGES.items()})
        return out

    @override
    def get_stats(self) -> OffloadingConnectorStats | None:
        self._follow_redis()
        self._stats.set_gauge(METRIC_PREFIX + "redis_available", int(self.redis.available))
        self._stats.set_gauge(METRIC_PREFIX + "inflight_jobs", len(self._jobs))
        stats, self._stats = self._stats, OffloadingConnectorStats()
        return stats

    def counters(self) -> dict[str, Any]:
        """What this tier counted since the last ``get_stats`` (for tests and debugging)."""
        self._follow_redis()
        values = self._stats.data["data"]
        return {name[len(METRIC_PREFIX):]: sum(v.values()) for name, v in values.items()}

    # ------------------------------------------------------------------ drain, shutdown
    @override
    def drain_jobs(self) -> None:
        """Wait until every submitted job has finished and its result is queued for
        ``get_finished_jobs``. Nothing is aborted mid-copy. Bounded: each Redis exchange ends
        within ``redis_timeout_s``, and once Redis has failed later ones return at once."""
        self.redis.flush(timeout=None)
        with self._cond:
            self._cond.wait_for(lambda: len(self._done) >= len(self._jobs))

    @override
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.drain_jobs()
        self._checks.shutdown()
        self._io.shutdown(wait=True)
        self.redis.close(timeout=2.0)
        self._rows = None  # release the primary region's buffer (it is unmapped next)


__all__ = ["KvtierRedisTier", "NativeTierSettings", "namespace_for"]
