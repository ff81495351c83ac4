"""The worker half (one per TP rank): owns the bytes, copies blocks, talks to Redis.

Rules this module keeps:

* The scheduler decides which slot holds which key; this rank's slab holds its shard of
  every slot. ``holds[slot]`` is the key a slot really contains here: a load from a slot
  that holds something else (a failed copy, a fetch that did not validate) is a failed
  load, never a wrong block.
* The forward step never waits on Redis: probes and fetches run on kvtier's I/O threads,
  writes on the Redis tier's write-behind thread (``write_mode: back``, the default), and
  results are picked up at the next step. ``write_mode: through`` writes in the step.
* A request whose load failed in this step saves nothing in it: its blocks were computed
  over bad context.
* Every job in the plan is reported back exactly once (:class:`WorkerReport`).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from connector.vllm_connector.affinity import SpareCores
from connector.vllm_connector.config import TieredConfig
from connector.vllm_connector.daemon_redis import DAEMON_REDIS_TIMEOUT_S, DaemonRedis
from connector.vllm_connector.gil import short_switch_interval
from connector.vllm_connector.host import NoHostTier, WorkerHostTier, host_digest
from connector.vllm_connector.layout import KVLayout, LayoutError, build_layout
from connector.vllm_connector.namespace import BoundedCache, rank_fingerprint
from connector.vllm_connector.pinned import PinnedMapping
from connector.vllm_connector.plan import (
    HOST_SLOT,
    OVERFLOW_SLOT,
    FetchOp,
    LoadOp,
    ProbeOp,
    SaveOp,
    StepPlan,
    WorkerReport,
)
from connector.vllm_connector.remote_store import (
    OwnRedis,
    PendingSave,
    RemoteStore,
    SaveDoneCallback,
    SaveKind,
)
from connector.vllm_connector.stats import ConnectorCounters
from connector.vllm_connector.transfer import BlockTransfer
from offload_tiers.cpu_tier import allocate_slab
from offload_tiers.host_tier.client import HostTierClient, SlotLease
from offload_tiers.host_tier.client import new_save_id as new_host_save_id
from offload_tiers.keys import BlockKey, BlockKind
from offload_tiers.redis.settings import WRITE_SETTLE_S
from offload_tiers.shared_segment import seqlock_sound
from offload_tiers.thread_names import name_current_thread

if TYPE_CHECKING:  # redis-py is imported only by an engine that uses Redis
    from offload_tiers.redis.tier import RedisTier

log = logging.getLogger(__name__)

#: A Redis write's counters by kind: (written, bytes written, what a failure adds to).

#: Base fingerprints (tenants x generations) whose rank fingerprints are kept.
RANK_FP_CACHE_MAX = 4096


def make_redis_tier(config: TieredConfig) -> RedisTier:
    """The Redis tier a worker stores through, from the connector's settings (no vLLM here).

    Never raises for an unreachable or refusing server (TLS, ACL, password): the tier starts
    unavailable, says why in ``last_error`` (no password in it) and the worker serves from the
    CPU tier until Redis answers.
    """
    from offload_tiers.redis.tier import RedisTier

    redis = RedisTier.from_settings(config, write_linger_s=config.redis_write_linger_ms / 1e3,
                                    write_settle_s=WRITE_SETTLE_S)
    if not redis.available:
        log.warning("kvtier: Redis at %s is not answering (%s); serving from the CPU tier "
                    "until it does", redis.target.redacted, redis.last_error)
    return redis


def worker_redis(config: TieredConfig, host: HostTierClient | None) -> RemoteStore | None:
    """The Redis a worker uses: its own (``redis_url``), the daemon's (``host_tier_redis``),
    or None."""
    if config.host_tier_redis and host is not None:
        return DaemonRedis(host, DAEMON_REDIS_TIMEOUT_S)
    if config.redis_url:
        return OwnRedis(make_redis_tier(config), config.write_mode)
    return None


@dataclass(frozen=True, slots=True)
class ProbeDone:
    """A probe job's answer: each key's save id in Redis (0: none)."""

    job: int
    save_ids: list[int]


@dataclass(frozen=True, slots=True)
class FetchDone:
    """A fetch batch of one request, and which of its ops read a valid value."""

    req_id: str
    ops: list[FetchOp]
    oks: list[bool]


@dataclass(frozen=True, slots=True)
class SaveDone:
    """A save settled without a Redis write: ``[ok, 1, copy_failed]`` for the report."""

    job: int
    counts: list[int]


@dataclass(frozen=True, slots=True)
class WriteDone:
    """A Redis write's outcome: a save's (``kind`` "write") or a backfill's."""

    kind: SaveKind
    job: int
    ok: bool
    nbytes: int


@dataclass(frozen=True, slots=True)
class TailsSent:
    """Finished requests whose partial tails are copied: their blocks may go now."""

    req_ids: list[str]


#: What the I/O and saver threads hand the main thread (:meth:`TieredWorker.collect`).
IoResult = ProbeDone | FetchDone | SaveDone | WriteDone | TailsSent


class TieredWorker:
    """One rank's slab, transfers and Redis I/O."""

    def __init__(self, config: TieredConfig, tp_rank: int, tp_size: int, num_slots: int,
                 redis: RemoteStore | None = None, host: HostTierClient | None = None) -> None:
        self.config = config
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.num_slots = num_slots
        self.counters = ConnectorCounters()
        self.redis = redis  # its own or the daemon's (connector/vllm_connector/remote_store.py)
        # the host's shared CPU tier (connector/vllm_connector/host.py), or none
        self.host: WorkerHostTier = host if host is not None else NoHostTier()
        # with a host tier a step's saves are copied into it inside the step (no saver)
        self._host_tier_configured = host is not None
        self._host_commits: set[futures.Future[None]] = set()
        # req -> key -> (segment, slot, seq) of each host shard checked for that request
        self._host_shards: dict[str, dict[BlockKey, tuple[Any, int, int]]] = {}
        if redis is not None:
            self.counters.set_gauge("redis_configured", 1)
        self.layout: KVLayout | None = None
        self.transfer: BlockTransfer | None = None
        self.slab: Any = None
        self._slab_owner: Any = None
        self._segment_pins = PinnedMapping(False)
        self.slot_keys: list[BlockKey | None] = [None] * num_slots
        self._rank_fps: BoundedCache[str, str] = BoundedCache(RANK_FP_CACHE_MAX)
        self._cores = SpareCores()  # on a CPU engine: the cores vLLM left free
        self._io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvtier-io",
                                      initializer=self._cores.pin_current)
        # vLLM's shutdown closes the worker (connector.shutdown); where it never runs (an
        # engine torn down by the interpreter's exit), this does, while I/O still works
        atexit.register(_close_at_exit, weakref.ref(self))
        # The saver copies a step's saves off the step (CPU; see save()). Started from the
        # main thread, it shares that thread's cores: it runs while the worker waits for
        # the next step.
        self._saver: ThreadPoolExecutor | None = None
        self._gathered: threading.Event | None = None  # set once the saver read its blocks
        self._saver_tail: futures.Future[None] | None = None  # the saver's last task
        self._lock = threading.Lock()
        self._done: deque[IoResult] = deque()  # results from I/O threads
        self._waiting: dict[str, list[LoadOp]] = {}  # req -> loads waiting on its fetches
        self._fetching: dict[str, int] = {}  # req -> fetch batches still running
        self._fetch_failed: set[str] = set()
        self._finished: set[str] = set()
        self._finished_sending: set[str] = set()
        self._async: set[str] = set()  # requests loaded asynchronously, not yet finished
        self._failed_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._failed_now: set[str] = set()  # requests whose load failed in this step
        self._report = WorkerReport()
        self._redis_seen: dict[str, int] = {}
        self._redis_events_serial = 0  # RedisTier.events_serial when last mirrored
        self._redis_up_sent: int | None = None  # the Redis health last reported
        # Rank 0 tells the scheduler its layout (the presence summary's key names) until a
        # plan says it arrived.
        self._send_layout = tp_rank == 0 and (
            (redis is not None and config.presence) or host is not None)
        # Sleep mode (vLLM >= 0.33): between unregister() and restore() no KV block is read
        # or written; fetches that end meanwhile keep their loads here until restore()
        self._groups: list[tuple[int, str, int, list[str]]] = []
        self._deferred_loads: list[str] = []
        self.closed = False

    # ------------------------------------------------------------------ setup
    def register(self, kv_caches: dict[str, Any], groups: list[tuple[int, str, int, list[str]]],
                 num_blocks: int, declared_block_dims: dict[str, list[int]] | None = None
                 ) -> KVLayout:
        layout = build_layout(kv_caches, groups, num_blocks, declared_block_dims)
        self.layout = layout
        self._groups = groups
        self.slab, self._slab_owner = allocate_slab(self.num_slots, layout.slot_bytes)
        self.transfer = BlockTransfer(kv_caches, layout, self.slab)
        if self.config.async_saves and self.transfer.gathers_in_numpy \
                and not self._host_tier_configured:
            self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-saver",
                                             initializer=name_current_thread)
        # on CUDA the host tier's segment is page-locked once, so loads from it are one DMA
        self._segment_pins = PinnedMapping(self.transfer.device.type == "cuda")
        return layout

    def adopt_spare_cores(self, ranks: int) -> None:
        """On the CPU, move this worker's kvtier threads off vLLM's OpenMP cores
        (:mod:`connector.vllm_connector.affinity`); ``ranks``: the engine's workers."""
        if self.transfer is not None and self.transfer.device.type == "cpu":
            self._cores.adopt(ranks)

    @property
    def kv_registered(self) -> bool:
        """vLLM's KV cache is registered: blocks may be copied (False while asleep)."""
        return self.transfer is not None and self.transfer.attached

    def unregister(self) -> None:
        """vLLM is about to sleep (``unregister_kv_caches``): its KV memory may be freed or
        remapped. Saves handed to the saver thread finish reading their blocks first; then
        every view of the KV tensors is dropped. The CPU tier (slab, page-locked or not),
        its entries, Redis writes from it and fetches into it carry on: they never touch
        the KV cache. A fetch that ends before :meth:`restore` keeps its blocks' writes
        (and its request's completion) until then. Idempotent."""
        if self.transfer is None or not self.transfer.attached:
            return
        if self._gathered is not None and not self._gathered.is_set():
            log.info("kvtier: KV cache unregistered (sleep): waiting for the saves in flight "
                     "to read their blocks")
        self.fence()
        self.transfer.detach()
        log.info("kvtier worker (TP rank %d): KV cache unregistered; the CPU tier is kept",
                 self.tp_rank)

    def restore(self, kv_caches: dict[str, Any],
                declared_block_dims: dict[str, list[int]] | None = None) -> None:
        """vLLM woke up (``restore_kv_caches``): take fresh views of ``kv_caches`` as they
        are now (the memory may be other than before the sleep), then write the loads that
        waited and report their requests. The tensors must have the layout registered at
        start (the storage namespace depends on it): else a :class:`LayoutError`.
        Idempotent."""
        if self.transfer is None or self.transfer.attached:
            return
        assert self.layout is not None
        layout = build_layout(kv_caches, self._groups, self.layout.num_blocks,
                              declared_block_dims)
        if layout != self.layout:
            raise LayoutError(
                f"kvtier: the KV cache restored after sleep has layout {layout.descriptor()}, "
                f"not {self.layout.descriptor()} as registered; its slots and storage names "
                "would not match. Fix: restart the engine")
        self.transfer.attach(kv_caches)
        waiting, self._deferred_loads = self._deferred_loads, []
        for req_id in waiting:
            self._scatter(self._waiting.pop(req_id, []))
            self._finish_recv(req_id)
        log.info("kvtier worker (TP rank %d): KV cache restored; %d waiting load(s) written",
                 self.tp_rank, len(waiting))

    def storage_key(self, key: BlockKey) -> BlockKey:
        """The key this rank stores ``key`` under (its own fingerprint)."""
        fp = self._rank_fps.get(key.fingerprint)
        if fp is None:
            assert self.layout is not None
            fp = rank_fingerprint(key.fingerprint, self.tp_rank, self.tp_size,
                                  self.layout.descriptor())
            self._rank_fps.put(key.fingerprint, fp)
        return BlockKey(fp, key.group, key.block_hash, key.num_tokens, key.kind)

    def _nbytes(self, group: int) -> int:
        assert self.transfer is not None
        return self.transfer.group(group).nbytes

    # ------------------------------------------------------------------ loads
    def start_step(self, plan: StepPlan) -> None:
        """Before the forward: probes and fetches go to the I/O threads, CPU loads run."""
        self.fence()  # the last step's saves have read their blocks and filled their slots
        if self._failed_now:
            self._failed_now = set()
        if plan.layout_known:
            self._send_layout = False
        if plan.backfills:
            self._backfill(plan.backfills)
        if self.transfer is None or not plan:
            return  # most steps: nothing to load, probe or fetch
        self._async.update(plan.async_reqs)
        now: list[LoadOp] = []
        for op in plan.loads:
            if op.after_fetch:
                self._waiting.setdefault(op.req_id, []).append(op)
            else:
                now.append(op)
        # CPU loads first: a fetch planned in the same step may reuse a slot they read.
        self._scatter(now)
        for probe in plan.probes:
            self._io.submit(self._probe, probe)
        by_req: dict[str, list[FetchOp]] = {}
        for op in plan.fetches:
            by_req.setdefault(op.req_id, []).append(op)
            if op.slot >= 0:
                self.slot_keys[op.slot] = None
        for req_id, ops in by_req.items():
            self._fetching[req_id] = self._fetching.get(req_id, 0) + 1
            self._io.submit(self._fetch, req_id, ops, plan.idle)
        for req_id in plan.async_reqs:
            if req_id not in self._fetching:
                self._finish_recv(req_id)

    def _scatter(self, ops: list[LoadOp]) -> None:
        """Write blocks from their slots; a slot that does not hold its key fails its load."""
        assert self.transfer is not None
        self._scatter_host([op for op in ops if op.slot == HOST_SLOT])
        ops = [op for op in ops if op.slot != HOST_SLOT]
        corrupt = self.config.debug_corrupt_loads
        for group, group_ops in _by_group(ops).items():
            good = [op for op in group_ops if self.slot_keys[op.slot] == op.key]
            for op in group_ops:
                if self.slot_keys[op.slot] != op.key:
                    self._fail_load(op, "slot does not hold the key")
            if not good:
                continue
            t0 = time.perf_counter_ns()
            try:
                moved = self.transfer.scatter(group, [o.block_id for o in good],
                                              [o.slot for o in good], corrupt=corrupt)
            except Exception:
                log.exception("kvtier: load into group %d failed; vLLM recomputes", group)
                for op in good:
                    self._fail_load(op, "copy failed")
                continue
            self.counters.add("bytes_loaded", moved)
            self.counters.add("load_us", (time.perf_counter_ns() - t0) // 1000)
            self.counters.add("blocks_loaded_cpu", sum(not o.after_fetch for o in good))
            self.counters.add("blocks_loaded_redis", sum(o.after_fetch for o in good))

    def _scatter_host(self, ops: list[LoadOp]) -> None:
        """Write blocks straight from the host tier's segment, where their fetch checked
        them; a shard whose slot was written again since (its seqlock moved) fails its
        load (vLLM recomputes it). Where the fetch copied the shard out and checked the copy
        (a weakly ordered CPU: :func:`seqlock_sound`), the block is written from that copy."""
        assert self.transfer is not None
        corrupt = self.config.debug_corrupt_loads
        for group, group_ops in _by_group(ops).items():
            checked = [(op, self._host_shards.get(op.req_id, {}).get(op.key)) for op in group_ops]
            for op, shard in checked:
                if shard is None:
                    self._fail_load(op, "its host-tier shard was not checked")
            by_segment: dict[int, list[tuple[LoadOp, tuple[Any, int, int]]]] = {}
            for op, shard in checked:
                if shard is not None:
                    by_segment.setdefault(id(shard[0]), []).append((op, shard))
            for pairs in by_segment.values():
                segment = pairs[0][1][0]
                slots = [shard[1] for _, shard in pairs]
                t0 = time.perf_counter_ns()
                try:
                    if isinstance(segment, np.ndarray):  # this rank's checked private copy
                        moved = self.transfer.scatter(group, [op.block_id for op, _ in pairs],
                                                      slots, corrupt=corrupt, source=segment)
                        same = [True] * len(pairs)
                    else:
                        pinned = self._segment_pins.pinned(segment)
                        moved = self.transfer.scatter(group, [op.block_id for op, _ in pairs],
                                                      slots, corrupt=corrupt,
                                                      source=segment.payloads,
                                                      source_pinned=pinned)
                        same = segment.unchanged(slots, [shard[2] for _, shard in pairs])
                except Exception:
                    log.exception("kvtier: load from the host tier into group %d failed; vLLM "
                                  "recomputes", group)
                    same = [False] * len(pairs)
                    moved = 0
                for (op, _), ok in zip(pairs, same, strict=True):
                    if not ok:
                        self._fail_load(op, "its host-tier slot was written during the load")
                good = sum(same)
                self.counters.add("bytes_loaded", moved * good // len(pairs))
                self.counters.add("load_us", (time.perf_counter_ns() - t0) // 1000)
                self.counters.add("blocks_loaded_host", good)

    def _fail_load(self, op: LoadOp, why: str) -> None:
        """An asynchronous load fails its request (``failed_recving``: hybrid models have no
        usable block ids); a synchronous one reports its block (single-group models only)."""
        log.warning("kvtier: load of %s for %s failed (%s); vLLM recomputes", op.key.name,
                    op.req_id, why)
        self._failed_now.add(op.req_id)
        if op.req_id in self._async:
            self._fetch_failed.add(op.req_id)
        else:
            self._load_errors.add(op.block_id)
        self.counters.add("load_errors")

    def _finish_recv(self, req_id: str) -> None:
        self._host_shards.pop(req_id, None)
        self._finished.add(req_id)
        self._async.discard(req_id)
        if req_id in self._fetch_failed:
            self._fetch_failed.discard(req_id)
            self._failed_recving.add(req_id)

    # ------------------------------------------------------------------ I/O threads
    def _probe(self, probe: ProbeOp) -> None:
        """Which save of each key this rank's Redis holds (0: none valid)."""
        ids: list[int | None] = [None] * len(probe.keys)
        try:
            if self.redis is not None:
                ids = self.redis.save_ids_many([self.storage_key(k) for k in probe.keys])
        except Exception:
            log.exception("kvtier: Redis probe failed")
        self._done.append(ProbeDone(probe.job, [i or 0 for i in ids]))

    def forward_starts(self) -> None:
        """A step with a forward begins: fetches on the compute cores leave them."""
        self._cores.forward_starts()

    def _fetch(self, req_id: str, ops: list[FetchOp], idle: bool = False) -> None:
        """Read values from Redis or the host tier straight into their slots, validated (I/O
        thread). ``idle``: planned in a step without a forward (the rank's compute cores
        are free: see :meth:`SpareCores.fetching`)."""
        from_redis = [op for op in ops if op.host is None]
        oks = dict.fromkeys((op.job for op in ops), False)
        if idle and from_redis:
            self.counters.add("fetches_without_forward")
        t0 = time.perf_counter_ns()
        try:
            if self.redis is not None and from_redis:
                dests = [self.slab[op.slot, :self._nbytes(op.key.group)] for op in from_redis]
                with self._cores.fetching(idle), short_switch_interval():
                    # the GIL comes back sooner after each recv
                    got = self.redis.get_many_into(
                        [self.storage_key(op.key) for op in from_redis], dests,
                        save_ids=[op.save_id for op in from_redis])
                oks.update(zip((op.job for op in from_redis), got, strict=True))
        except Exception:
            log.exception("kvtier: fetching from Redis failed")
        t1 = time.perf_counter_ns()
        oks.update(self._read_host([op for op in ops if op.host is not None]))
        self._count_fetched(from_redis, oks, "redis", t1 - t0)
        self._count_fetched([op for op in ops if op.host is not None], oks, "host",
                            time.perf_counter_ns() - t1)
        self._done.append(FetchDone(req_id, ops, [oks[op.job] for op in ops]))

    def _count_fetched(self, ops: list[FetchOp], oks: dict[int, bool], tier: str,
                       elapsed_ns: int) -> None:
        """Bytes fetched (validated) from ``tier`` and the I/O thread's time on them."""
        if ops:
            self.counters.add(f"bytes_fetched_{tier}",
                              sum(self._nbytes(op.key.group) for op in ops if oks[op.job]))
            self.counters.add(f"fetch_us_{tier}", elapsed_ns // 1000)

    def _read_host(self, ops: list[FetchOp]) -> dict[int, bool]:
        """Check this rank's shards of ``ops``' keys in the host tier (I/O thread): only the
        exact saves the scheduler found, against each slot's header and the checksum of its
        bytes. Where the seqlock is sound (x86-64: :func:`seqlock_sound`) the check runs
        where the bytes lie and the loads copy them from there (the scheduler's pins keep
        the slots from reuse until every rank reported; the seqlock catches a write since).
        Elsewhere (aarch64) each shard is copied out into a private buffer and the checksum
        runs over the copy, in the same pass; the loads write from that copy. Job -> ok."""
        if not ops:
            return {}
        oks = dict.fromkeys((op.job for op in ops), False)
        segment = self.host.segment
        if segment is None:
            return oks
        fit = []
        for op in ops:
            assert op.host is not None
            if op.host[self.tp_rank][2] == self._nbytes(op.key.group):
                fit.append(op)
        try:
            where = [op.host[self.tp_rank] for op in fit]  # type: ignore[index]
            slots = [w[0] for w in where]
            digests = [host_digest(self.storage_key(op.key)) for op in fit]
            save_ids = [w[1] for w in where]
            checked: list[tuple[Any, int, int] | None]
            if seqlock_sound():
                seqs = segment.verify_many(slots, digests, save_ids, [w[2] for w in where])
                checked = [None if seq is None else (segment, w[0], seq)
                           for w, seq in zip(where, seqs, strict=True)]
            else:  # copy-then-checksum, into one private buffer per shard size
                rows: list[int] = []
                counts: dict[int, int] = {}
                for w in where:
                    rows.append(counts.get(w[2], 0))
                    counts[w[2]] = rows[-1] + 1
                copies = {n: np.empty((k, n), dtype=np.uint8) for n, k in counts.items()}
                got = segment.read_many_into(
                    slots, digests, save_ids, next(iter(copies.values())) if len(copies) == 1
                    else [copies[w[2]][row] for w, row in zip(where, rows, strict=True)])
                checked = [(copies[w[2]], row, 0) if ok else None
                           for w, row, ok in zip(where, rows, got, strict=True)]
        except Exception:
            log.exception("kvtier: checking the host tier failed")
            return oks
        for op, shard in zip(fit, checked, strict=True):
            if shard is not None:
                self._host_shards.setdefault(op.req_id, {})[op.key] = shard
                oks[op.job] = True
        return oks

    def _on_written(self, kind: SaveKind) -> SaveDoneCallback:
        """What a store calls, on any thread, once a save of ``kind`` is settled."""
        def done(save: PendingSave, ok: bool) -> None:
            self._done.append(WriteDone(kind, save.job, ok, save.view.nbytes))
        return done

    def collect(self) -> None:
        """Main thread: apply what the I/O threads finished since the last call."""
        while self._done:
            match self._done.popleft():
                case ProbeDone(job, save_ids):
                    self._report.probes[job] = (save_ids, 1)
                case FetchDone(req_id, ops, oks):
                    self._fetched(req_id, ops, oks)
                case SaveDone(job, counts):
                    self._report.saves[job] = counts
                case TailsSent(req_ids):
                    self._finished_sending.update(req_ids)
                case WriteDone(kind, job, ok, nbytes):
                    self._report.saves[job] = [int(ok), 1, 0]
                    assert self.redis is not None  # only a store reports writes
                    written, written_bytes, failed = self.redis.write_counters(kind)
                    if ok:
                        self.counters.add(written)
                        if written_bytes is not None:
                            self.counters.add(written_bytes, nbytes)
                    else:
                        for name in failed:
                            self.counters.add(name)

    def _fetched(self, req_id: str, ops: list[FetchOp], oks: list[bool]) -> None:
        for op, ok in zip(ops, oks, strict=True):
            if op.slot >= 0:
                self.slot_keys[op.slot] = op.key if ok else None
            self._report.fetches[op.job] = [int(ok), 1]
            if not ok:
                self._fetch_failed.add(req_id)
        self._fetching[req_id] -= 1
        if self._fetching[req_id]:
            return
        del self._fetching[req_id]
        if req_id not in self._fetch_failed and self.transfer is not None \
                and not self.transfer.attached:
            self._deferred_loads.append(req_id)  # asleep: written by restore()
            return
        waiting = self._waiting.pop(req_id, [])
        if req_id not in self._fetch_failed and self.transfer is not None:
            self._scatter(waiting)
        self._finish_recv(req_id)

    # ------------------------------------------------------------------ saves
    def save(self, plan: StepPlan) -> None:
        """After the forward: copy blocks into their slots, then hand them to Redis.

        On the CPU the copies run on the saver thread, off the step (its output goes back to
        the scheduler without waiting for them); :meth:`fence`, before anything of the next
        step can write a KV block, waits for them. Finished requests' tails are reported
        sent (their blocks may go) once copied.
        """
        if not plan.saves and not plan.tail_reqs:
            return
        keep = self._claim(plan)
        if self._saver is None or self.closed or not keep:
            self._copy_kept(keep)
            self._finished_sending.update(plan.tail_reqs)
            return
        gathered = self._gathered = threading.Event()
        self._saver_tail = self._saver.submit(self._copy_off_step, keep, list(plan.tail_reqs),
                                              gathered)

    def flush_redis(self, timeout_s: float | None = None) -> bool:
        """Every save handed over so far has its Redis outcome (written or failed): the
        saver's hand-offs are done and the writer's queue is drained; False on timeout."""
        tail = self._saver_tail
        if tail is not None:
            try:
                tail.result(timeout_s)
            except TimeoutError:
                return False
        return self.redis is None or self.redis.flush(timeout_s)

    def fence(self) -> None:
        """Wait until the saves handed to the saver thread have read their blocks into
        their slots: vLLM calls it (``handle_preemptions``) before a step can write any KV
        block, and every step's loads run after it. Their hand-off to Redis may still run
        (the slots stay pinned until written), except with ``write_mode: through``."""
        gathered, self._gathered = self._gathered, None
        if gathered is not None:
            gathered.wait()

    def _copy_off_step(self, keep: list[SaveOp], tails: list[str],
                       gathered: threading.Event) -> None:
        through = self.config.write_mode == "through"
        read = False

        def blocks_read() -> None:
            nonlocal read
            read = True
            self._done.append(TailsSent(tails))  # finished requests' blocks may go now
            if not through:
                gathered.set()

        try:
            self._copy_kept(keep, blocks_read)
        except Exception:
            # A bug (copy failures are reported where they happen). Its saves stay open,
            # their slots pinned: reporting them here could report a job twice, and a rank
            # counted twice could let a slot go while another rank's writer still reads it.
            log.exception("kvtier: saving blocks off the step failed; their slots stay held")
        finally:
            if not read:
                self._done.append(TailsSent(tails))
            gathered.set()

    def _claim(self, plan: StepPlan) -> list[SaveOp]:
        """The saves to copy (main thread: slot books, and the saves that are not made)."""
        if not plan.saves:
            return []
        if self.transfer is None:
            for op in plan.saves:
                self._report_save(op.job, ok=False, gathered=False)
            return []
        # A slot given twice in one plan (a small tier evicting this step's own saves) keeps
        # the scheduler's last choice; the earlier save is gone from its books already.
        last = {op.slot: op for op in plan.saves if op.slot != OVERFLOW_SLOT}
        keep: list[SaveOp] = []
        for op in plan.saves:
            if op.slot != OVERFLOW_SLOT and last[op.slot] is not op:
                self._report_save(op.job, ok=True, gathered=True)
            elif op.req_id in self._failed_now:
                # Computed over a context that failed to load here. Other ranks may not know
                # (with TP their shards are bad too): this rank writes no shard of this save,
                # so no reader can ever assemble it (shards are served only as one save).
                self.counters.add("saves_skipped_after_failed_load")
                if op.slot != OVERFLOW_SLOT:
                    self.slot_keys[op.slot] = None
                self._report_save(op.job, ok=False, gathered=False)
            else:
                if op.slot != OVERFLOW_SLOT:
                    self.slot_keys[op.slot] = None
                keep.append(op)
        return keep

    def _copy_kept(self, keep: list[SaveOp],
                   blocks_read: Callable[[], None] | None = None) -> None:
        """Gather the kept saves into their slots and on to the host tier (then
        ``blocks_read()``: no KV block is read after it), then hand them to Redis."""
        handed: list[tuple[int, list[SaveOp], np.ndarray | None, set[int]]] = []
        for group, ops in _by_group(keep).items():
            slotted = [op for op in ops if op.slot != OVERFLOW_SLOT]
            if slotted and self._gather(group, slotted, None):
                for op in slotted:
                    self.slot_keys[op.slot] = op.key
                    if not op.to_redis:  # in this engine's tier now: nothing else to wait for
                        self._report_save(op.job, ok=True, gathered=True)
                # on CUDA the host tier's copy reads the KV blocks themselves
                hosted = self._to_host(group, [op for op in slotted if op.to_host])
                handed.append((group, slotted, None, hosted))
            overflow = [op for op in ops if op.slot == OVERFLOW_SLOT]
            if overflow:
                # Rows of a buffer of this step's own; the Redis writer keeps it alive.
                try:
                    buf = np.empty((len(overflow), self._nbytes(group)), dtype=np.uint8)
                except MemoryError:
                    log.warning("kvtier: no memory for %d overflow saves; dropped", len(overflow))
                    for op in overflow:
                        self._report_save(op.job, ok=False, gathered=False)
                    self.counters.add("store_drops", len(overflow))
                    continue
                if self._gather(group, overflow, buf):
                    handed.append((group, overflow, buf, set()))
        if blocks_read is not None:
            blocks_read()
        for group, ops, buf, hosted in handed:
            if buf is None:
                self._to_redis([(op, memoryview(self.slab[op.slot, :self._nbytes(group)]))
                                for op in ops], hosted)
            else:
                self._to_redis([(op, memoryview(buf[i])) for i, op in enumerate(ops)], hosted)

    def _gather(self, group: int, ops: list[SaveOp], buf: np.ndarray | None) -> bool:
        assert self.transfer is not None
        try:
            if buf is None:
                moved = self.transfer.gather(group, [op.block_id for op in ops],
                                             [op.slot for op in ops])
            else:
                moved = self.transfer.gather(group, [op.block_id for op in ops],
                                             list(range(len(ops))), dest=torch.from_numpy(buf))
        except Exception:
            log.exception("kvtier: gathering blocks into the CPU tier failed")
            for op in ops:
                self._report_save(op.job, ok=False, gathered=False)
            self.counters.add("store_drops", len(ops))
            return False
        self.counters.add("bytes_saved_cpu", moved)
        self.counters.add("blocks_saved", len(ops))
        self.counters.add("partial_blocks_saved",
                          sum(op.key.kind is BlockKind.PARTIAL for op in ops))
        return True

    def _to_host(self, group: int, ops: list[SaveOp]) -> set[int]:
        """Copy saved blocks from their CPU-tier slots into leased host-tier slots (in the
        step: the slot may be reused by a later step); the checksums and the commit run on
        an I/O thread. A save with no leased slot at hand is not offered (counted). The
        jobs of the saves offered."""
        if not ops:
            return set()
        nbytes = self._nbytes(group)
        known = self.host.segment
        lease = self.host.take_slots(len(ops) if known is not None
                                     and nbytes <= known.slot_bytes else 0)
        segment, slots = lease.segment, list(lease.slots)
        self.counters.add("host_store_drops", len(ops) - len(slots))
        if not slots or segment is None or nbytes > segment.slot_bytes:
            self.host.abandon(lease)
            return set()
        ops = ops[:len(slots)]
        for slot in slots:
            segment.begin_write(slot)
        assert self.transfer is not None
        try:
            if self.transfer.device.type == "cuda":
                # straight from the KV tensors: one DMA per slot into the page-locked
                # segment (a host memcpy from the slab would hold the step at memcpy speed)
                pinned = self._segment_pins.pinned(segment)
                self.transfer.gather(group, [op.block_id for op in ops], slots,
                                     dest=torch.from_numpy(segment.payloads), dest_pinned=pinned)
            else:
                segment.payloads[slots, :nbytes] = self.slab[[op.slot for op in ops], :nbytes]
        except Exception:
            log.exception("kvtier: copying saves into the host tier failed; not offered")
            for slot in slots:
                segment.invalidate(slot)
            self.host.abandon(lease)  # given back now, not when this process exits
            self.counters.add("host_store_drops", len(ops))
            return set()
        future = self._io.submit(self._commit_host, lease, ops, nbytes)
        self._host_commits.add(future)
        future.add_done_callback(self._host_commits.discard)
        return {op.job for op in ops}

    def flush_host(self, timeout_s: float) -> bool:
        """Wait until every host-tier write begun so far is committed (and its commit
        queued to the daemon); False on timeout."""
        _, not_done = futures.wait(list(self._host_commits), timeout=timeout_s)
        return not not_done

    def _commit_host(self, lease: SlotLease, ops: list[SaveOp], nbytes: int) -> None:
        """Checksum and publish host-tier writes begun in the step (I/O thread), each
        under its save's id (every TP rank's shard of one save carries the same); a slot
        whose commit failed is given back. A lease of an earlier daemon run is dropped
        by the client (its slots may be someone else's in the new run)."""
        assert lease.segment is not None
        segment = lease.segment
        saves = []
        behind: list[Any] = []  # where the daemon writes each behind to Redis
        try:
            for op, slot in zip(ops, lease.slots, strict=False):
                key = self.storage_key(op.key)
                d = host_digest(key)
                save_id = op.save_id or new_host_save_id()
                segment.commit_write(slot, d, save_id, nbytes)
                saves.append((d, slot, save_id, nbytes))
                behind.append(self.redis.host_commit_note(key, op.save_id, self.tp_rank == 0)
                              if op.to_redis and self.redis is not None else None)
        except Exception:
            log.exception("kvtier: committing host-tier writes failed")
        self.host.commit(lease, saves, behind[:len(saves)] if any(behind) else None)
        self.counters.add("blocks_written_host", len(saves))

    def _to_redis(self, items: list[tuple[SaveOp, memoryview]], hosted: set[int]) -> None:
        """Hand the saves for Redis to the remote store (``hosted``: saves whose host-tier
        commits name their Redis keys, for a store that writes through the daemon). Saves
        not for Redis were reported gathered."""
        remote = [PendingSave(op.job, self.storage_key(op.key), view, op.save_id,
                              op.job in hosted) for op, view in items if op.to_redis]
        if not remote:
            return
        if self.redis is None or not self.redis.available:
            self.counters.add("redis_unavailable_steps")
            for save in remote:
                self._report_save(save.job, ok=False, gathered=True)
            self.counters.add("store_drops", len(remote))
            self.counters.add("redis_write_failures", len(remote))
            return
        self.redis.write(remote, self._on_written("write"))

    def _backfill(self, ops: list[SaveOp]) -> None:
        """Hand entries that never reached Redis to its writer, from their slots (the last
        step's saves are in them: :meth:`fence` ran). A slot that does not hold its key on
        this rank fails its op as a failed copy: the scheduler drops the entry."""
        if self.redis is None or not self.redis.backfills:
            for op in ops:
                self._report_save(op.job, ok=False, gathered=True)
            self.counters.add("redis_backfill_failures", len(ops))
            return
        saves = []
        for op in ops:
            if self.transfer is None or op.slot < 0 or self.slot_keys[op.slot] != op.key:
                self._report_save(op.job, ok=False, gathered=False)
                self.counters.add("redis_backfill_failures")
                continue
            view = memoryview(self.slab[op.slot, :self._nbytes(op.group)])
            saves.append(PendingSave(op.job, self.storage_key(op.key), view, op.save_id))
        if saves:
            self.redis.write(saves, self._on_written("backfill"))  # refusals answer at once

    def _report_save(self, job: int, *, ok: bool, gathered: bool) -> None:
        """Any thread: the main thread applies it to the report (:meth:`collect`)."""
        self._done.append(SaveDone(job, [int(ok), 1, int(not gathered)]))

    # ------------------------------------------------------------------ to vLLM
    def take_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """Requests done receiving (failed ones included), the failed ones, and finished
        requests whose partial tails were copied (done sending)."""
        self.collect()
        done, failed, sent = self._finished, self._failed_recving, self._finished_sending
        self._finished, self._failed_recving, self._finished_sending = set(), set(), set()
        return done, failed, sent

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_report(self) -> WorkerReport:
        self.collect()
        report = self._report  # kept (empty) for the next step when nothing is in it
        if self._send_layout and self.layout is not None:
            report.rank0_layout = self.layout.descriptor()
        if self._host_tier_configured:
            self.counters.set_gauge("host_tier_available", int(self.host.available))
        if self.redis is not None:
            up = int(bool(self.redis.available))
            if up != self._redis_up_sent:
                report.redis_up[self.tp_rank] = self._redis_up_sent = up
                self.counters.set_gauge("redis_available", up)
            self._follow_redis_events()
        if report:
            self._report = WorkerReport()
        return report

    def _follow_redis_events(self) -> None:
        """Mirror the Redis tier's outage/recovery counts into the connector's counters
        (read only when they moved: this runs every step)."""
        serial = self.redis.events_serial
        if serial == self._redis_events_serial:
            return
        self._redis_events_serial = serial
        st = self.redis.counts()
        for name, ours in (("unavailable_events", "redis_unavailable_events"),
                           ("recoveries", "redis_recoveries"),
                           ("corrupt", "redis_corrupt_values"),
                           ("corrupt_deleted", "redis_corrupt_deleted"),
                           ("stale_saves", "redis_stale_saves")):
            seen = self._redis_seen.get(name, 0)
            now = int(st.get(name, 0))
            if now > seen:
                self.counters.add(ours, now - seen)
                self._redis_seen[name] = now

    def close(self) -> None:
        """Finish queued writes (bounded), stop the I/O threads, drop the slab. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.fence()
        if self._saver is not None:
            self._saver.shutdown(wait=True)
        # host-tier writes begun are committed (sent) within the flush's bound; any still
        # queued after it are cancelled, and the daemon releases their slots at this
        # process's exit: never served half-written
        self.flush_host(self.config.redis_shutdown_flush_s)
        self._io.shutdown(wait=True, cancel_futures=True)
        if self.redis is not None:
            self.redis.close(timeout=self.config.redis_shutdown_flush_s)
        self._segment_pins.close()
        self.host.close()
        self.transfer = None
        self.slab = self._slab_owner = None


def _close_at_exit(ref: weakref.ref[TieredWorker]) -> None:
    """The interpreter's exit hook: close a worker vLLM did not close (bounded flush)."""
    worker = ref()
    if worker is not None and not getattr(worker, "closed", True):
        try:
            worker.close()
        except Exception:
            log.exception("kvtier: closing the worker at exit failed")


def _by_group(ops: list[Any]) -> dict[int, list[Any]]:
    out: dict[int, list[Any]] = {}
    for op in ops:
        out.setdefault(op.key.group if isinstance(op, FetchOp) else op.group, []).append(op)
    return out
