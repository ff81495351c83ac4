"""One rank's worker state: the slab and what each slot holds, vLLM's KV tensors, the
remote store and the host tier, the I/O threads and what they hand back; the loads
(:mod:`connector.vllm_connector.worker_loads`), the saves
(:mod:`connector.vllm_connector.worker_saves`) and the I/O
(:mod:`connector.vllm_connector.worker_io`) work on it.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections import deque
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from connector.vllm_connector.affinity import SpareCores
from connector.vllm_connector.bounded_cache import BoundedCache
from connector.vllm_connector.config import TieredConfig
from connector.vllm_connector.host import NoHostTier, WorkerHostTier
from connector.vllm_connector.layout import KVLayout, LayoutError, build_layout
from connector.vllm_connector.namespace import rank_fingerprint
from connector.vllm_connector.pinned import PinnedMapping
from connector.vllm_connector.plan import (
    FetchOp,
    LoadOp,
    WorkerReport,
)
from connector.vllm_connector.remote_store import (
    PendingSave,
    RemoteStore,
    SaveDoneCallback,
    SaveKind,
)
from connector.vllm_connector.stats import ConnectorCounters
from connector.vllm_connector.transfer import BlockTransfer
from offload_tiers.cpu_tier import allocate_slab
from offload_tiers.host_tier.client import HostTierClient
from offload_tiers.keys import BlockKey
from offload_tiers.shared_segment import SharedSegment
from offload_tiers.thread_names import name_current_thread

log = logging.getLogger("connector.vllm_connector.worker")  # the worker half's log

#: Base fingerprints (tenants x generations) whose rank fingerprints are kept.
RANK_FP_CACHE_MAX = 4096


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


class WorkerState:
    """What the loads, the saves and the I/O of one rank share."""

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
        self._host_shards: dict[str, dict[BlockKey, tuple[SharedSegment, int, int]]] = {}
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

    def _on_written(self, kind: SaveKind) -> SaveDoneCallback:
        """What a store calls, on any thread, once a save of ``kind`` is settled."""
        def done(save: PendingSave, ok: bool) -> None:
            self._done.append(WriteDone(kind, save.job, ok, save.view.nbytes))
        return done

    def _report_save(self, job: int, *, ok: bool, gathered: bool) -> None:
        """Any thread: the main thread applies it to the report (:meth:`collect`)."""
        self._done.append(SaveDone(job, [int(ok), 1, int(not gathered)]))

    def close(self) -> None:
        """Finish queued writes (bounded), stop the threads: the worker's
        (:class:`~connector.vllm_connector.worker.TieredWorker`)."""
        raise NotImplementedError


def _close_at_exit(ref: weakref.ref[WorkerState]) -> None:
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
