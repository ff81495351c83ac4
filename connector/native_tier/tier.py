"""kvtier's Redis tier as a secondary tier of vLLM's native multi-tier offloading.

Load it with ``"spec_name": "TieringOffloadingSpec"`` and ``"secondary_tiers": [{"type":
"KvtierRedisTier", "module_path": "connector.native_tier.tier", "redis_url": "redis://..."}]``.

Rules this module keeps (vLLM's ``tiering/base.py`` contract, kvtier's storage rules):

* Every scheduler-side method only keeps books: no Redis round trip on the calling thread.
  Stores go to the Redis tier's write-behind thread (``submit_puts`` with ``on_done``, no
  copy: the framework pins the primary chunk until the job is reported); loads run on this
  tier's own I/O threads with ``get_many_into``, straight into the primary tier's rows,
  validated there. Results are picked up by ``get_finished_jobs``.
* One Redis key per chunk, with kvtier's self-checking header. The namespace fingerprint is
  kvtier's one engine identity (``connector.identity.engine.identity_from_vllm``), read off
  the engine's real ``VllmConfig`` (found at construction: vLLM's current config, else the
  ``vllm_config`` of the ``OffloadingConnectorScheduler`` on the call stack, matched by
  ``engine_id``; not found = a start-up error, never a partial identity): model (name or
  ``model_id``), revision, the checkpoint's files, ``weights_version``, model dtype, KV-cache
  dtype, quantization, KV scales, architecture, device and parallel shape, plus this tier's
  layout (offloading layout, groups and their layers, chunk size, row bytes) and the
  generation. A chunk row holds every TP rank's share. A corrupt, foreign or truncated value
  is a miss (and ``RedisTier`` deletes a value proven corrupt, while unchanged); a failed
  load reports the keys that did load (``successful_keys``) and the rest become misses.
* The generation (``connector.identity.generation``) starts at ``"0"``. vLLM does not
  reset secondary tiers on a connector-cache reset, but its ``TieringOffloadingManager.
  reset_cache`` calls every secondary tier's ``drain_jobs()``, and nothing else in vLLM does
  (0.32, 0.33, 0.34: ``vllm_api.RESET_CALLER``, checked on the installed tree by a test):
  there the tier moves to a new generation (the named weight version, else a nonce); nothing
  of kvtier's calls it, so no drain moves the namespace without a reset. A
  weight version named between steps moves it too: it is followed before every look-up
  and store (one attribute read), so a step's first look-up after an update already uses
  the new generation, and again at ``on_schedule_end``. After a move the
  tier forgets what it knew and every look-up, load and store uses the new fingerprint.
* A chunk key carries what its hash covers: ``num_tokens`` is the end position vLLM records
  for the key in the request (``ReqContext.get_offload_key_position``), the kind is FULL
  when that ends a whole chunk, else PARTIAL. A key without a recorded position is a miss.
* Look-ups answer from what this tier knows (chunks it stored or loaded in this process,
  bounded LRU) and otherwise from an asynchronous existence check (``exists_many``):
  "retry later", never a wait. While Redis is unavailable every look-up is a miss.
* A load is reported only once its I/O thread is done with the primary rows, so a failed
  promotion never defers its chunks' release (vLLM 0.34's ``JobResult.deferred_release``
  stays None, and a drain has no event to set). Version differences: ``vllm_api``.
* Redis faults never raise: reads miss, writes are counted drops (``RedisTier``).
  ``submit_store`` / ``submit_load`` never raise either: any exception while a job is
  prepared or submitted makes it a reported failed job (counted ``job_errors``, logged once
  per kind), so ``drain_jobs`` and ``shutdown`` always return.
* Every cache is bounded: ``_known`` (``known_keys``, LRU); jobs live until reported.
* Logs and errors carry the redacted URL only; so does ``config_info`` (vLLM >= 0.33's
  ``vllm:kv_offload_config_info`` labels: this tier's settings), without even the user name.
* Not serviced from vLLM 0.33's tier-poll thread (``tolerates_off_thread_polling`` False):
  this tier answers no counterpart between steps. Its methods would be safe there (every
  one runs under the tiering manager's lock; the I/O threads touch only jobs, under
  ``_cond``), which matters when another tier's ``ParentManager`` fan-out reaches
  ``lookup`` from that thread.

This module imports vLLM (it is loaded by vLLM); ``offload_tiers`` stays vLLM-free.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

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

from connector.identity.engine_core import WeightVersionSource
from connector.identity.generation import Generation
from connector.native_tier.config import NativeTierSettings, load_native_settings
from connector.native_tier.namespace import identity_for_spec
from offload_tiers.keys import BlockKey, BlockKind
from offload_tiers.redis.settings import SHORT_WRITE_LINGER_S
from offload_tiers.redis.tier import RedisTier

log = logging.getLogger(__name__)

OWNERSHIP = "kvtier-redis"
METRIC_PREFIX = "vllm:kvtier_native_"
TENANT = ""  # vLLM folds cache_salt into the block hashes the native keys are made of

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
    "corrupt_deleted": "Values proven corrupt that were deleted from Redis (while unchanged).",
    "job_errors": "Load or store jobs failed by an unexpected error while being prepared, "
                  "submitted or run (reported failed; see the log).",
    "generation_moves": "Namespace generation moves (connector-cache reset or new weight "
                        "version): what was stored before is no longer served here.",
    "redis_unavailable_events": "Times Redis became unavailable.",
    "redis_recoveries": "Times Redis answered again after being unavailable.",
}
GAUGES = {
    "redis_available": "1 while Redis answers, else 0.",
    "inflight_jobs": "Load and store jobs submitted and not yet reported.",
}
#: The labels this tier fills on vLLM's ``vllm:kv_offload_config_info`` (vLLM >= 0.33; vLLM
#: adds ``tier``). Settings fixed for the process lifetime (the fingerprint moves with the
#: generation, so it is not one); no credentials.
CONFIG_INFO_KEYS = (
    "kvtier_redis_url", "kvtier_redis_cluster", "kvtier_redis_tls", "kvtier_redis_prefix",
    "kvtier_redis_ttl_s", "kvtier_redis_timeout_s", "kvtier_io_threads", "kvtier_known_keys",
    "kvtier_write_queue_max", "kvtier_kv_events", "kvtier_locality",
)


def _url_label(redacted: str) -> str:
    """A redacted URL without its user part and query (``redis://h:6379/0``): a label."""
    parts = urlsplit(redacted)
    return urlunsplit((parts.scheme, parts.netloc.rsplit("@", 1)[-1], parts.path, "", ""))


#: RedisTier counters mirrored into this tier's (RedisTier name, ours).
_MIRRORED = (("corrupt", "corrupt_values"), ("corrupt_deleted", "corrupt_deleted"),
             ("put_failures", "store_failures"), ("dropped_unavailable", "store_drops"),
             ("dropped", "store_drops"), ("unavailable_events", "redis_unavailable_events"),
             ("recoveries", "redis_recoveries"))


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
    epoch: int  # the generation move count at submission: results of older ones are not kept
    started: float = field(default_factory=time.monotonic)
    oks: list[bool] = field(default_factory=list)
    pending: int = 0  # holders: the submitting call, each queued write, the I/O thread
    error: bool = False  # an unexpected exception failed it (counted when reported)
    future: Future | None = None


class KvtierRedisTier(SecondaryTierManager):
    """kvtier's Redis tier behind vLLM's ``SecondaryTierManager`` interface."""

    medium: ClassVar[Medium] = Medium.STORAGE
    # vLLM >= 0.33: opting in would service this tier from the tiering manager's tier-poll
    # thread (get_finished_jobs and serve_external_requests every millisecond, under the
    # manager lock). It is for tiers answering a counterpart between steps; this one serves
    # no external requests, so polling would only add lock traffic (vLLM's fs/obj tiers also
    # leave it off). Safe if it were on: see the module docstring.
    tolerates_off_thread_polling: ClassVar[bool] = False

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview,
                 tier_type: str, backpressure_detector: BackpressureDetector | None = None,
                 **settings: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.settings = s = load_native_settings(settings, tier_type)
        self.locality = Locality(s.locality) if s.locality else None
        # Raises before any buffer, thread or connection is taken when the engine's config
        # is unseen (vLLM then unmaps the primary region).
        self.identity, config_source = identity_for_spec(offloading_spec, s,
                                                         self.block_size_bytes)
        self._rows = np.asarray(primary_kv_view).view(np.uint8)
        self._tp_rank = int(offloading_spec.config.parallel.rank)
        self._weights = WeightVersionSource()  # the EngineCore building us, when on the stack
        self.generation = Generation(self._weights.read())
        self._epoch = 0
        self._fp = self._fingerprint()
        bpc = offloading_spec.config.cache.blocks_per_chunk
        self._chunk_tokens = {g.group_id: g.tokens_per_block * bpc
                              for g in offloading_spec.config.groups}
        self._scrubber = s.client_factory()
        self.redis = RedisTier.from_settings(
            s, write_queue_max=s.write_queue_max,
            write_queue_max_bytes=max(s.write_queue_max * self.block_size_bytes, 1 << 20),
            # vLLM's CPU blocks stay held while their store job runs; delete_corrupt:
            # RedisTier's default (on), never turned off here
            write_linger_s=SHORT_WRITE_LINGER_S)
        if self._tp_rank == 0:  # once per engine
            for warning in s.redis_warnings:
                log.warning("kvtier native tier: %s", warning)
        if not self.redis.available:
            log.warning("kvtier native tier: Redis at %s is not answering (%s); look-ups miss "
                        "and stores drop until it does", self.redis.target.redacted,
                        self.redis.last_error)
        self._events_on = s.kv_events and offloading_spec.kv_events_config.enable_kv_cache_events
        self._events: list[OffloadingEvent] = []
        self._known: OrderedDict[OffloadKey, None] = OrderedDict()  # bounded: known_keys
        self._jobs: dict[JobId, _Job] = {}
        self._done: deque[JobId] = deque()  # appended by I/O threads, drained by the scheduler
        self._cond = threading.Condition()
        self._io = ThreadPoolExecutor(max_workers=s.io_threads,
                                      thread_name_prefix="kvtier-native-io")
        self._checks = _ExistenceChecks(self)
        self._stats = OffloadingConnectorStats()
        self._redis_seen: dict[str, int] = {}
        self._errors_logged: set[tuple[str, str]] = set()  # bounded: stages x exception types
        self._closed = False
        target = self.redis.target
        self._config_info: dict[str, str | int | float | bool] = dict(zip(CONFIG_INFO_KEYS, (
            _url_label(target.redacted), target.cluster, target.tls, s.redis_prefix,
            "None" if s.redis_ttl_s is None else s.redis_ttl_s, s.redis_timeout_s,
            s.io_threads, s.known_keys, s.write_queue_max, bool(self._events_on),
            s.locality or "None"), strict=True))
        log.info("kvtier native tier %s: Redis %s, prefix %s, fingerprint %s, row %d bytes, "
                 "checkpoint %s, engine config from %s; connector-cache resets: seen through "
                 "drain_jobs (vLLM's reset_cache); weight version: %s",
                 tier_type, self.redis.target.redacted, s.redis_prefix, self._fp,
                 self.block_size_bytes, self.identity.checkpoint, config_source,
                 "followed (EngineCore found)" if self._weights.found else
                 "not visible (EngineCore not on the stack): each reset draws a nonce")

    # ------------------------------------------------------------------ keys, generation
    def _fingerprint(self) -> str:
        return self.identity.fingerprint(TENANT, self.generation.name, self._tp_rank)

    @property
    def fingerprint(self) -> str:
        """The namespace fingerprint new look-ups, loads and stores use."""
        return self._fp

    def block_key(self, key: OffloadKey, req_context: ReqContext) -> BlockKey | None:
        """kvtier's key for a chunk key of this request; None without a recorded position."""
        end = req_context.get_offload_key_position(key)
        if not end or end <= 0:
            return None
        group = get_offload_group_idx(key)
        per_chunk = self._chunk_tokens.get(group)
        kind = BlockKind.FULL if per_chunk and end % per_chunk == 0 else BlockKind.PARTIAL
        return BlockKey(self._fp, group, get_offload_block_hash(key), end, kind)

    def _moved(self, why: str) -> None:
        """The generation moved: new fingerprint, nothing known, fresh existence checks."""
        self._epoch += 1
        self._fp = self._fingerprint()
        self._known.clear()
        old, self._checks = self._checks, _ExistenceChecks(self)
        # The old checker's thread may be inside one bounded exists_many: stop it off-thread.
        threading.Thread(target=old.shutdown, name="kvtier-native-checks-stop",
                         daemon=True).start()
        self._count("generation_moves")
        log.info("kvtier native tier %s: %s; namespace generation %s, fingerprint %s",
                 self.tier_type, why, self.generation.name, self._fp)

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

    def _follow_weights(self) -> None:
        """Follow vLLM's weight version (one attribute read): before any look-up or store
        of a step, so none runs under the generation of the weights before an update."""
        if self.generation.observe(self._weights.read()):
            self._moved("vLLM's weight version changed")

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._follow_weights()
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
        self._follow_weights()
        self._checks.flush()

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        self._checks.cleanup(req_context.req_id)

    # ------------------------------------------------------------------ transfers
    def _row(self, chunk_id: int) -> np.ndarray:
        return self._rows[int(chunk_id)]

    def _new_job(self, job_metadata: TransferJob, *, is_load: bool) -> _Job:
        """Register a job (reported exactly once, whatever happens next)."""
        try:
            keys = list(job_metadata.keys)
        except Exception:  # keys unreadable: nothing to report per key
            keys = []
        job = _Job(job_metadata.job_id, keys, is_load=is_load, epoch=self._epoch,
                   oks=[False] * len(keys), pending=1)  # 1: held by the submitting thread
        self._jobs[job.job_id] = job
        return job

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        """Queue each chunk's write; never raises (a failure is a reported failed job)."""
        job = self._new_job(job_metadata, is_load=False)
        try:
            plan = self._store_plan(job, job_metadata)
            with self._cond:
                job.pending += len(plan)  # each released by its on_done (exactly once)
            try:
                # One hand-over for the job (one wake-up of the writer). The framework pins
                # the chunks until this job is reported: no copy.
                self.redis.submit_puts([(bk, row, self._on_stored(job, i), 0)
                                        for i, bk, row in plan])
            except BaseException:
                with self._cond:
                    job.pending -= len(plan)  # nothing queued: no on_done will run
                raise
        except Exception as exc:
            self._job_error(job, "store", exc)
        self._release(job)  # reported once the writes already queued have ended

    def _store_plan(self, job: _Job, job_metadata: TransferJob) -> list[Any]:
        """The chunks to write: (index, key, row view); present ones are marked done."""
        todo: list[Any] = []
        for i, (key, cid) in enumerate(zip(job.keys, job_metadata.chunk_ids, strict=True)):
            if key in self._known:
                job.oks[i] = True
                self._count("store_skipped_present")
                continue
            bk = self.block_key(key, job_metadata.req_context)
            if bk is None:
                self._count("unpositioned_keys")
                continue
            todo.append((i, bk, memoryview(self._row(cid))))
        return todo

    def _on_stored(self, job: _Job, i: int):
        def done(ok: bool) -> None:  # Redis writer thread (or at once, on a drop)
            with self._cond:
                job.oks[i] = ok
            self._release(job)
        return done

    def _release(self, job: _Job) -> None:
        """One holder of ``job`` is done with it; the last one queues its result."""
        with self._cond:
            job.pending -= 1
            last = job.pending == 0
        if last:
            self._finish(job.job_id)

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        """Start one batched read on an I/O thread; never raises (see ``submit_store``)."""
        job = self._new_job(job_metadata, is_load=True)
        try:
            block_keys = [self.block_key(k, job_metadata.req_context) for k in job.keys]
            chunk_ids = [int(c) for c in job_metadata.chunk_ids]
            if len(chunk_ids) != len(block_keys):
                raise ValueError(f"{len(block_keys)} keys but {len(chunk_ids)} chunk ids")
            with self._cond:  # the submitting call's hold passes to the I/O thread
                job.future = self._io.submit(self._load, job, block_keys, chunk_ids)
        except Exception as exc:
            self._job_error(job, "load", exc)
            self._release(job)

    def _load(self, job: _Job, block_keys: list[BlockKey | None], chunk_ids: list[int]) -> None:
        """I/O thread: each value received straight into its primary row, validated there."""
        idx = [i for i, bk in enumerate(block_keys) if bk is not None]
        try:
            oks = self.redis.get_many_into([block_keys[i] for i in idx],
                                           [self._row(chunk_ids[i]) for i in idx])
            for i, ok in zip(idx, oks, strict=True):
                job.oks[i] = ok
        except Exception as exc:  # a programming error; Redis trouble never raises
            self._job_error(job, "load", exc)
        self._release(job)

    def _job_error(self, job: _Job, stage: str, exc: Exception) -> None:
        """An unexpected error in a job (any thread): its keys fail, it is counted when
        reported, and it is logged once per kind (stage, exception type, place)."""
        where = exc.__traceback__
        while where is not None and where.tb_next is not None:
            where = where.tb_next
        site = (f"{where.tb_frame.f_code.co_filename.rsplit('/', 1)[-1]}:{where.tb_lineno}"
                if where is not None else "?")
        kind = (stage, f"{type(exc).__name__}@{site}")
        with self._cond:
            job.error = True
            job.oks = [False] * len(job.keys)
            first = kind not in self._errors_logged and len(self._errors_logged) < 64
            if first:
                self._errors_logged.add(kind)
        if not first:
            return
        log.error("kvtier native tier %s: %s job %s failed before or while it ran (%s at %s); "
                  "reported failed, its chunks are misses. Further errors of this kind are "
                  "only counted (job_errors)", self.tier_type, stage, job.job_id,
                  self._scrubber.describe(exc), site)

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
        current = job.epoch == self._epoch  # else: another generation's keys, not ours now
        if job.error:
            self._count("job_errors")
        if current:
            self._remember(good)
        if job.is_load:
            self._count("loaded_chunks", len(good))
            self._count("load_misses", len(bad))
            for key in bad:
                self._known.pop(key, None)
            if current:
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
        for name, ours in _MIRRORED:
            seen = self._redis_seen.get(name, 0)
            now = st.get(name, 0)
            if now > seen:
                self._count(ours, now - seen)
                self._redis_seen[name] = now

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

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        """vLLM >= 0.33: the label names :meth:`config_info` fills (whatever the settings)."""
        return CONFIG_INFO_KEYS

    def config_info(self) -> dict[str, str | int | float | bool]:
        """vLLM >= 0.33: this tier's settings as info labels: the Redis URL redacted, without
        user name or query, never a password; None written "None", as vLLM does."""
        return dict(self._config_info)

    def counters(self) -> dict[str, Any]:
        """What this tier counted since the last ``get_stats`` (for tests and debugging)."""
        self._follow_redis()
        values = self._stats.data["data"]
        return {name[len(METRIC_PREFIX):]: sum(v.values()) for name, v in values.items()}

    # ------------------------------------------------------------------ drain, shutdown
    def wait_for_jobs(self) -> None:
        """Wait until every submitted job has finished and its result is queued for
        ``get_finished_jobs``. Nothing is aborted mid-copy. Bounded: each Redis exchange ends
        within ``redis_timeout_s``, and once Redis has failed later ones return at once."""
        self.redis.flush(timeout=None)
        with self._cond:
            self._cond.wait_for(lambda: len(self._done) >= len(self._jobs))

    @override
    def drain_jobs(self) -> None:
        """vLLM's connector-cache reset (``TieringOffloadingManager.reset_cache``, its only
        caller in vLLM 0.32-0.34): wait for every job (their results queued, none deferred),
        then move to a new generation."""
        self.wait_for_jobs()
        self.generation.reset(self._weights.read())
        self._moved("connector-cache reset")

    @override
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.wait_for_jobs()
        self._checks.shutdown()
        self._io.shutdown(wait=True)
        self.redis.close(timeout=self.settings.redis_shutdown_flush_s)
        self._rows = None  # release the primary region's buffer (it is unmapped next)


__all__ = ["KvtierRedisTier", "NativeTierSettings"]
