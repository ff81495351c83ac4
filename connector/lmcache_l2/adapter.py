"""``KvtierL2Adapter``: LMCache 0.5.6's ``L2AdapterInterface`` on kvtier's Redis tier.

LMCache loads it through its ``plugin`` adapter (``module_path`` =
``connector.lmcache_l2.adapter``, ``class_name`` = ``KvtierL2Adapter``; the plugin loader finds
:class:`KvtierL2AdapterConfig` by name and validates ``adapter_params`` with it). This is the
only kvtier module that imports LMCache.

The task model, as LMCache's controllers use it:

* ``submit_*`` return a task id at once; no Redis I/O runs on LMCache's thread. Stores run on
  a kvtier store thread (a task's keys split over ``store_threads`` connections), pipelined
  straight from LMCache's buffers (zero copy: LMCache keeps them until the task completes),
  and so do the unlinks of ``delete`` (ordered with the stores); lookups on a lookup thread;
  loads on ``load_threads`` (a task's keys split between them), each GET reply received into
  LMCache's buffer; listing and the namespace registry on a control thread.
* Each kind of task has its own eventfd, signalled once per completed task after its result is
  published (``pop_completed_store_tasks``, ``query_lookup_and_lock_result``,
  ``query_load_result``: each result handed out once). A task always completes: Redis trouble,
  a closed adapter or an internal error make it a failure (store) or all-zero bitmap, never a
  hang.
* A lookup locks the keys it found (a count per key) until ``submit_unlock``; ``delete`` of a
  locked key takes it out of the accounting and of later lookups at once and unlinks it from
  Redis at its last unlock, so a planned load still finds it.
* Usage: bytes of the keys this adapter stored (first store of a key counts; a store that
  partly fails counts only the keys written and reports the task failed), less those deleted,
  per ``cache_salt`` (LMCache's base class keeps the totals).

Every value carries kvtier's 64-byte header (namespace digest of model, KV rank, salt; group;
chunk-hash tag; length; xxh3 checksum): a damaged, truncated or foreign value is a miss,
counted (``report_status()["tier"]["corrupt"]``), and deleted while unchanged.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from queue import SimpleQueue
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import (
    EncodedObjectKey,
    KeyEntry,
    KeyListPage,
    MemoryLayoutDesc,
    ObjectKey,
)
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform import create_event_notifier

from connector.lmcache_l2.keys import ChunkOwner, KeyMapper, registry_name
from connector.lmcache_l2.listing import list_keys
from connector.lmcache_l2.settings import L2Settings
from offload_tiers.keys import BlockKey
from offload_tiers.redis.client import ClientFactory, close_quietly
from offload_tiers.redis.tier import RedisTier
from offload_tiers.redis.url import parse_redis_url
from offload_tiers.thread_names import name_current_thread

log = logging.getLogger(__name__)

__all__ = ["KvtierL2Adapter", "KvtierL2AdapterConfig"]

Job = Callable[[], None]


class KvtierL2AdapterConfig(L2AdapterConfigBase):
    """LMCache's config object for the adapter (the plugin loader finds it by name)."""

    def __init__(self, settings: L2Settings) -> None:
        self.settings = settings

    @classmethod
    def from_dict(cls, d: dict) -> KvtierL2AdapterConfig:
        return cls(L2Settings.from_params(d))

    @classmethod
    def help(cls) -> str:
        return ("kvtier Redis L2 adapter (plugin): adapter_params = {redis_url | redis_url_env, "
                "redis_username, redis_password_file, key_prefix, namespace, ttl_s, "
                "redis_timeout_s, cluster, ssl_ca_certs, max_capacity_gb, load_threads}; "
                "no password inline. See kvtier's docs/lmcache.md.")


class _Worker:
    """One named kvtier thread draining a queue of jobs (None stops it)."""

    def __init__(self, name: str, queue: SimpleQueue[Job | None] | None = None) -> None:
        self.queue: SimpleQueue[Job | None] = queue if queue is not None else SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        name_current_thread()
        while True:
            job = self.queue.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # a job completes its own task; this is a last resort
                log.exception("kvtier L2 adapter job failed")


class _StoreTask:
    __slots__ = ("task_id", "keys", "sizes", "ok")

    def __init__(self, task_id: int, keys: list[ObjectKey], sizes: list[int]) -> None:
        self.task_id = task_id
        self.keys = keys
        self.sizes = sizes
        self.ok = [False] * len(keys)


class _LoadTask:
    __slots__ = ("task_id", "keys", "loaded", "remaining", "lock")

    def __init__(self, task_id: int, keys: list[ObjectKey], slices: int) -> None:
        self.task_id = task_id
        self.keys = keys
        self.loaded = [False] * len(keys)
        self.remaining = slices
        self.lock = threading.Lock()


def _byte_view(obj: MemoryObj) -> memoryview:
    """The object's logical bytes as a flat byte view (no copy)."""
    view = memoryview(obj.byte_array)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


class KvtierL2Adapter(L2AdapterInterface):
    """kvtier's Redis tier behind LMCache's L2 adapter interface (see the module docstring)."""

    def __init__(self, config: KvtierL2AdapterConfig | L2Settings | dict[str, Any],
                 l1_memory_desc: Any = None, *, tier: RedisTier | None = None) -> None:
        if isinstance(config, KvtierL2AdapterConfig):
            settings = config.settings
        elif isinstance(config, L2Settings):
            settings = config
        else:
            settings = L2Settings.from_params(dict(config))
        super().__init__(max_capacity_bytes=settings.max_capacity_bytes)
        self.settings = settings
        self.keys = KeyMapper(settings.namespace)
        url, warnings = settings.resolve_url()
        for warning in warnings:
            log.warning("kvtier L2 adapter: %s", warning)
        target = parse_redis_url(url, settings.cluster)
        self._redacted = target.redacted
        self._tier = tier if tier is not None else RedisTier.from_url(
            url, prefix=settings.key_prefix, ttl_s=settings.ttl_s,
            redis_timeout_s=settings.redis_timeout_s,
            connect_timeout_s=settings.connect_timeout_s, cluster=settings.cluster,
            ssl_ca_certs=settings.ssl_ca_certs, delete_corrupt=settings.delete_corrupt)
        self._control_factory = ClientFactory(
            target, timeout_s=settings.redis_timeout_s,
            connect_timeout_s=settings.connect_timeout_s, ssl_ca_certs=settings.ssl_ca_certs)
        self._control_client: Any = None
        self._registry = registry_name(settings.key_prefix)
        self._registered: set[ChunkOwner] = set()
        # A bound on what delete() and list_l2_keys() wait for the control thread.
        self._control_wait_s = 4 * settings.redis_timeout_s + 5.0

        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()

        self._lock = threading.Lock()
        self._next_task = 0
        self._closed = False
        self._completed_stores: dict[L2TaskId, L2StoreResult] = {}
        self._completed_lookups: dict[L2TaskId, Bitmap] = {}
        self._completed_loads: dict[L2TaskId, Bitmap] = {}
        self._locks: dict[ObjectKey, int] = defaultdict(int)
        self._doomed: dict[ObjectKey, BlockKey] = {}  # deleted while locked: unlink at unlock
        self._key_sizes: dict[ObjectKey, int] = {}
        self._n: dict[str, int] = dict.fromkeys(
            ("store_tasks", "store_tasks_failed", "keys_stored", "keys_store_failed",
             "lookup_tasks", "keys_looked_up", "keys_found", "load_tasks", "keys_loaded",
             "keys_load_missed", "locks", "unlocks", "unmatched_unlocks", "deletes",
             "deferred_deletes", "bad_keys", "internal_errors"), 0)

        self._store_worker = _Worker("kvtier-lmc-store")  # stores and unlinks, in order
        helper_queue: SimpleQueue[Job | None] = SimpleQueue()
        self._store_helpers = [_Worker(f"kvtier-lmc-st{i}", helper_queue)
                               for i in range(1, settings.store_threads)]
        self._lookup_worker = _Worker("kvtier-lmc-look")
        load_queue: SimpleQueue[Job | None] = SimpleQueue()
        self._load_workers = [_Worker(f"kvtier-lmc-load{i}", load_queue)
                              for i in range(settings.load_threads)]
        self._control = _Worker("kvtier-lmc-ctl")
        log.info("kvtier L2 adapter on %s (prefix %s, %s)", self._redacted, settings.key_prefix,
                 "available" if self._tier.available else f"unavailable: {self._tier.last_error}")

    # ------------------------------------------------------------------ event fds
    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # ------------------------------------------------------------------ helpers
    def _task_id(self) -> L2TaskId:
        with self._lock:
            self._next_task += 1
            return self._next_task

    def _block_keys(self, keys: Sequence[ObjectKey]) -> list[BlockKey | None]:
        """kvtier keys (None for one kvtier cannot store, counted ``bad_keys``)."""
        out: list[BlockKey | None] = []
        bad = 0
        for key in keys:
            try:
                owner = ChunkOwner(key.model_name, key.kv_rank, key.cache_salt)
                out.append(self.keys.block_key(owner, key.object_group_id, key.chunk_hash))
            except (ValueError, TypeError, AttributeError):
                out.append(None)
                bad += 1
        if bad:
            with self._lock:
                self._n["bad_keys"] += bad
        return out

    def _submit(self, worker: _Worker, job: Job, fail: Job) -> None:
        """Queue ``job``, or run ``fail`` (completes the task as failed) once closed (queued
        under the lock that close() takes to queue its stop: no job lands behind it)."""
        with self._lock:
            closed = self._closed
            if not closed:
                worker.queue.put(job)
        if closed:
            fail()

    # ------------------------------------------------------------------ store
    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        task_id = self._task_id()
        if len(keys) != len(objects):
            log.error("store task with %d keys but %d objects", len(keys), len(objects))
            self._finish_store(_StoreTask(task_id, [], []), failed=True)
            return task_id
        views: list[memoryview | None] = []
        for obj in objects:
            try:
                views.append(_byte_view(obj))
            except (TypeError, ValueError, AttributeError):
                views.append(None)
        task = _StoreTask(task_id, list(keys), [0 if v is None else v.nbytes for v in views])
        if not keys:
            self._finish_store(task)
            return task_id
        bkeys = self._block_keys(keys)
        with self._lock:
            closed = self._closed
            for key in keys:
                self._doomed.pop(key, None)  # a new store replaces what a delete waited for
        if closed:
            self._finish_store(task, failed=True)
            return task_id
        self._register([ChunkOwner(k.model_name, k.kv_rank, k.cache_salt)
                        for k, bk in zip(keys, bkeys, strict=True) if bk is not None])
        self._submit(self._store_worker, lambda: self._run_store(task, bkeys, views),
                     lambda: self._finish_store(task, failed=True))
        return task_id

    def _run_store(self, task: _StoreTask, bkeys: list[BlockKey | None],
                   views: list[memoryview | None]) -> None:
        """The task's SETs, pipelined, split over ``store_threads`` connections (this thread
        and helpers; the task ends before the store thread's next job, so unlinks stay in
        order). The payloads go from LMCache's buffers to the sockets."""
        idx = [i for i, (bk, v) in enumerate(zip(bkeys, views, strict=True))
               if bk is not None and v is not None]
        n_slices = max(1, min(len(self._store_helpers) + 1, len(idx)))
        bounds = [len(idx) * s // n_slices for s in range(n_slices + 1)]
        slices = [idx[lo:hi] for lo, hi in zip(bounds, bounds[1:], strict=False)]
        finished = [threading.Event() for _ in slices]

        def run(j: int) -> None:
            try:
                self._store_slice(task, bkeys, views, slices[j])
            finally:
                finished[j].set()

        for j in range(1, len(slices)):
            self._store_helpers[0].queue.put(lambda j=j: run(j))
        run(0)
        for event in finished:
            event.wait()
        self._finish_store(task)

    def _store_slice(self, task: _StoreTask, bkeys: list[BlockKey | None],
                     views: list[memoryview | None], idx: list[int]) -> None:
        """One pipelined batch of SETs; when fewer than all were stored, the header probe
        says which ones Redis holds."""
        try:
            items = [(bkeys[i], views[i]) for i in idx]
            stored = self._tier.put_many(items) if items else 0  # type: ignore[arg-type]
            if stored == len(idx):
                flags = [True] * len(idx)
            else:
                flags = self._tier.exists_many([bkeys[i] for i in idx])  # type: ignore[misc]
            for i, ok in zip(idx, flags, strict=True):
                task.ok[i] = ok
        except Exception:
            log.exception("kvtier L2 adapter: store task %d failed", task.task_id)
            with self._lock:
                self._n["internal_errors"] += 1
            for i in idx:
                task.ok[i] = False

    def _finish_store(self, task: _StoreTask, failed: bool = False) -> None:
        """Account the keys written, publish the task's result, signal the store fd."""
        stored_keys: list[ObjectKey] = []
        stored_sizes: list[int] = []
        written = 0
        with self._lock:
            for key, size, ok in zip(task.keys, task.sizes, task.ok, strict=True):
                if not ok:
                    continue
                written += size
                stored_keys.append(key)
                if key in self._key_sizes:  # a re-store: the bytes were counted once
                    stored_sizes.append(0)
                else:
                    self._key_sizes[key] = size
                    stored_sizes.append(size)
            success = not failed and all(task.ok)
            n_ok = len(stored_keys)
            self._n["store_tasks"] += 1
            self._n["store_tasks_failed"] += not success
            self._n["keys_stored"] += n_ok
            self._n["keys_store_failed"] += len(task.keys) - n_ok
        if stored_keys:
            self._notify_quietly(self._notify_keys_stored, stored_keys, stored_sizes)
        with self._lock:
            self._completed_stores[task.task_id] = L2StoreResult(success, written)
        self._signal(self._store_efd)

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._completed_stores = self._completed_stores, {}
        return done

    def _register(self, owners: list[ChunkOwner]) -> None:
        """Name new fingerprints in the registry (for list_l2_keys), on the control thread."""
        new: list[ChunkOwner] = []
        with self._lock:
            for owner in owners:
                if owner not in self._registered:
                    self._registered.add(owner)
                    new.append(owner)
        if new:
            self._submit(self._control, lambda: self._write_registry(new), lambda: None)

    def _write_registry(self, owners: list[ChunkOwner]) -> None:
        try:
            client = self._client()
            for owner in owners:
                client.hsetnx(self._registry, self.keys.fingerprint(owner),
                              self.keys.registry_entry(owner))
        except Exception as exc:
            with self._lock:
                self._registered.difference_update(owners)  # a later store tries again
            log.debug("kvtier L2 adapter: registry write failed: %s",
                      self._control_factory.describe(exc))

    # ------------------------------------------------------------------ lookup and lock
    def submit_lookup_and_lock_task(self, keys: list[ObjectKey],
                                    group_layout_descs: dict[int, MemoryLayoutDesc] | None = None
                                    ) -> L2TaskId:
        task_id = self._task_id()
        keys = list(keys)
        self._submit(self._lookup_worker, lambda: self._run_lookup(task_id, keys),
                     lambda: self._publish_lookup(task_id, len(keys), []))
        return task_id

    def _run_lookup(self, task_id: int, keys: list[ObjectKey]) -> None:
        found_idx: list[int] = []
        try:
            bkeys = self._block_keys(keys)
            idx = [i for i, bk in enumerate(bkeys) if bk is not None]
            found = self._tier.exists_many([bkeys[i] for i in idx])  # type: ignore[misc]
            found_idx = [i for i, hit in zip(idx, found, strict=True) if hit]
        except Exception:
            log.exception("kvtier L2 adapter: lookup task %d failed", task_id)
            with self._lock:
                self._n["internal_errors"] += 1
        self._publish_lookup(task_id, len(keys), found_idx, keys)

    def _publish_lookup(self, task_id: int, n: int, found_idx: list[int],
                        keys: list[ObjectKey] | None = None) -> None:
        bitmap = Bitmap(n)
        with self._lock:
            hits = 0
            for i in found_idx:
                key = keys[i]  # type: ignore[index]
                if key in self._doomed:  # deleted, waiting for its last unlock
                    continue
                bitmap.set(i)
                self._locks[key] += 1
                hits += 1
            self._n["lookup_tasks"] += 1
            self._n["keys_looked_up"] += n
            self._n["keys_found"] += hits
            self._n["locks"] += hits
            self._completed_lookups[task_id] = bitmap
        self._signal(self._lookup_efd)

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._completed_lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        unlink: list[BlockKey] = []
        with self._lock:
            for key in keys:
                count = self._locks.get(key, 0)
                if count <= 0:
                    self._n["unmatched_unlocks"] += 1
                    continue
                self._n["unlocks"] += 1
                if count == 1:
                    del self._locks[key]
                    doomed = self._doomed.pop(key, None)
                    if doomed is not None:
                        unlink.append(doomed)
                else:
                    self._locks[key] = count - 1
        if unlink:
            self._submit(self._store_worker, lambda: self._unlink(unlink), lambda: None)

    # ------------------------------------------------------------------ load
    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        task_id = self._task_id()
        keys = list(keys)
        if len(keys) != len(objects) or not keys:
            if keys:
                log.error("load task with %d keys but %d objects", len(keys), len(objects))
            self._finish_load(_LoadTask(task_id, keys, 0))
            return task_id
        objs = list(objects)
        n_slices = min(len(self._load_workers), len(keys))
        task = _LoadTask(task_id, keys, n_slices)
        bounds = [len(keys) * s // n_slices for s in range(n_slices + 1)]
        with self._lock:
            closed = self._closed
            if not closed:
                for lo, hi in zip(bounds, bounds[1:], strict=False):
                    self._load_workers[0].queue.put(
                        lambda lo=lo, hi=hi: self._run_load(task, objs, lo, hi))
        if closed:
            self._finish_load(_LoadTask(task_id, keys, 0))
        return task_id

    def _run_load(self, task: _LoadTask, objs: list[MemoryObj], lo: int, hi: int) -> None:
        try:
            bkeys = self._block_keys(task.keys[lo:hi])
            idx: list[int] = []
            dests: list[memoryview] = []
            for j, bkey in enumerate(bkeys):
                if bkey is None:
                    continue
                try:
                    view = _byte_view(objs[lo + j])
                except (TypeError, ValueError, AttributeError):
                    continue
                if view.readonly:
                    continue
                idx.append(j)
                dests.append(view)
            got = self._tier.get_many_into([bkeys[j] for j in idx], dests)  # type: ignore[misc]
            for j, ok in zip(idx, got, strict=True):
                task.loaded[lo + j] = ok
        except Exception:
            log.exception("kvtier L2 adapter: load task %d failed", task.task_id)
            with self._lock:
                self._n["internal_errors"] += 1
        with task.lock:
            task.remaining -= 1
            last = task.remaining == 0
        if last:
            self._finish_load(task)

    def _finish_load(self, task: _LoadTask) -> None:
        bitmap = Bitmap(len(task.keys))
        loaded = [k for i, k in enumerate(task.keys) if task.loaded[i]]
        for i, ok in enumerate(task.loaded):
            if ok:
                bitmap.set(i)
        with self._lock:
            self._n["load_tasks"] += 1
            self._n["keys_loaded"] += len(loaded)
            self._n["keys_load_missed"] += len(task.keys) - len(loaded)
        if loaded:
            self._notify_quietly(self._notify_keys_accessed, loaded)
        with self._lock:
            self._completed_loads[task.task_id] = bitmap
        self._signal(self._load_efd)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._completed_loads.pop(task_id, None)

    # ------------------------------------------------------------------ delete, list
    def delete(self, keys: list[ObjectKey]) -> None:
        """Forget ``keys`` now (usage, later lookups); unlink them from Redis on kvtier's
        control thread (waited for, bounded), a locked one at its last unlock."""
        if not keys:
            return
        bkeys = self._block_keys(keys)
        gone: list[ObjectKey] = []
        sizes: list[int] = []
        now: list[BlockKey] = []
        with self._lock:
            for key, bkey in zip(keys, bkeys, strict=True):
                size = self._key_sizes.pop(key, None)
                if size is not None:
                    gone.append(key)
                    sizes.append(size)
                if bkey is None:
                    continue
                if self._locks.get(key, 0) > 0:
                    self._doomed[key] = bkey
                    self._n["deferred_deletes"] += 1
                else:
                    now.append(bkey)
            self._n["deletes"] += len(keys)
        if gone:
            self._notify_quietly(self._notify_keys_deleted, gone, sizes)
        if now:  # after the stores queued before it, so a re-store is never unlinked
            self._call_on(self._store_worker, lambda: self._unlink(now), None)

    def _unlink(self, bkeys: list[BlockKey]) -> int:
        return self._tier.delete_many(bkeys)

    def list_l2_keys(self, model_name: str | None = None, page_size: int = 500,
                     cursor: str | None = None) -> KeyListPage:
        """The keys this adapter's prefix holds in Redis (every node of a Cluster), paged;
        sizes are LMCache's payload bytes. Keys whose namespace the registry cannot name
        (another kvtier deployment's, another ``namespace`` setting's) are left out."""
        if page_size <= 0:
            raise ValueError(f"page_size must be positive (got {page_size})")
        result = self._call_on(
            self._control, lambda: list_keys(self._client(), self.keys, self.settings.key_prefix,
                              model_name=model_name, page_size=page_size, cursor=cursor),
            RuntimeError("kvtier L2 adapter: listing did not finish"))
        entries = tuple(
            KeyEntry(key=EncodedObjectKey(chunk_hash_hex=item.chunk_hash.hex(),
                                          model_name=item.owner.model_name,
                                          kv_rank=item.owner.kv_rank,
                                          object_group_id=item.group,
                                          cache_salt=item.owner.cache_salt),
                     size_bytes=item.size)
            for item in result.items)
        return KeyListPage(entries=entries, next_page_token=result.next_cursor)

    def _call_on(self, worker: _Worker, fn: Callable[[], Any], default: Any) -> Any:
        """Run ``fn`` on ``worker``'s thread and wait for it (bounded); ``default`` when it
        could not run or did not finish (an exception default is raised)."""
        future: Future[Any] = Future()

        def job() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        with self._lock:
            closed = self._closed
            if not closed:
                worker.queue.put(job)
        if closed:
            if isinstance(default, BaseException):
                raise default
            return default
        try:
            return future.result(timeout=self._control_wait_s)
        except TimeoutError:
            future.cancel()
            log.warning("kvtier L2 adapter: %s did not finish in %.0f s",
                        worker.thread.name, self._control_wait_s)
            if isinstance(default, BaseException):
                raise default from None
            return default

    def _client(self) -> Any:
        """The control thread's redis-py client (built on first use)."""
        if self._control_client is None:
            self._control_client = self._control_factory.make()
        return self._control_client

    # ------------------------------------------------------------------ status, close
    def counts(self) -> dict[str, int]:
        """The adapter's own counters, and the number of keys locked / awaiting unlink."""
        with self._lock:
            out = dict(self._n)
            out["locked_keys"] = len(self._locks)
            out["lock_count"] = sum(self._locks.values())
            out["deletes_waiting_for_unlock"] = len(self._doomed)
            out["keys_accounted"] = len(self._key_sizes)
        return out

    def report_status(self) -> dict[str, Any]:
        tier = self._tier.stats()
        threads = [self._store_worker, self._lookup_worker, self._control, *self._load_workers,
                   *self._store_helpers]
        usage = self.get_usage()
        return {
            "is_healthy": (not self._closed and bool(tier["available"])
                           and all(w.thread.is_alive() for w in threads)),
            "type": "kvtier-redis",
            "url": self._redacted,
            "key_prefix": self.settings.key_prefix,
            "cluster": tier["cluster"],
            "last_error": tier["last_error"],
            "current_size_bytes": usage.total_bytes_used,
            "max_capacity_bytes": usage.total_capacity_bytes,
            "adapter": self.counts(),
            "tier": {k: tier[k] for k in (
                "hits", "misses", "corrupt", "stale_saves", "corrupt_deleted", "puts",
                "put_failures", "dropped", "dropped_unavailable", "errors",
                "unavailable_events", "recoveries", "queue_depth", "noeviction")},
        }

    def close(self) -> None:
        """Finish queued work (each task completes, Redis trouble bounded by the timeout),
        write queued stores (bounded), stop kvtier's threads, close the event fds."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for worker in [self._store_worker, self._lookup_worker, self._control]:
                worker.queue.put(None)
            for _ in self._load_workers:
                self._load_workers[0].queue.put(None)
        workers = [self._store_worker, self._lookup_worker, self._control, *self._load_workers]
        for worker in workers:
            worker.thread.join(timeout=self._control_wait_s)
        for helper in self._store_helpers:  # after the store thread: it may still use them
            helper.queue.put(None)
        for helper in self._store_helpers:
            helper.thread.join(timeout=self._control_wait_s)
        self._tier.close(timeout=self._control_wait_s)
        client, self._control_client = self._control_client, None
        close_quietly(client)
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()

    # ------------------------------------------------------------------ internals
    def _signal(self, efd: Any) -> None:
        try:
            efd.notify()
        except (OSError, ValueError):  # closed: nobody waits any more
            log.debug("kvtier L2 adapter: event fd closed before a task completed")

    def _notify_quietly(self, notify: Callable[..., None], *args: Any) -> None:
        """LMCache's listener / accounting hook; a listener's error never loses a task."""
        try:
            notify(*args)
        except Exception:
            log.exception("kvtier L2 adapter: an LMCache listener failed")
