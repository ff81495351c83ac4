"""The daemon's Redis behind the host tier: write-behind, restores and probes for engines.
The daemon's end of ``host_tier_redis`` (the engine's end:
:class:`~connector.vllm_connector.host_tier_redis.HostTierRedisStore`).

With ``kvtier daemon --cpu-bytes N --redis-url URL`` the daemon holds the host's one Redis
connection for the engines that attach with ``host_tier_redis``:

* **write-behind**: a commit that names a Redis key (``Commit.redis``) is read back from
  its slot (verified: header, save id, checksum) and queued to Redis under that key, in the
  Redis tier's own format, with the save id the engine chose (TP ranks' shards of one save
  share it). A save the directory drops as a duplicate is not written again: two engines
  storing one prefix write it to Redis once. The entry is held (not evicted) from its commit
  until its bytes are read back, so an eviction never skips a write-behind; a write that
  is skipped all the same (its bytes no longer verify) counts as a failed write. Once
  written, TP rank 0's shard is announced
  on the prefix's presence stream (``feed``), as engines announce their own writes, so
  engines with a Redis connection of their own learn the key without a walk;
* **backfill**: a write that failed or was dropped (Redis down) is kept (bounded: as many
  as the host tier has slots, oldest dropped first); once Redis answers again a thread of
  this module writes them from their slots, one batch at a time, each tried once. A slot
  reused meanwhile (its digest or save id changed) is skipped, counted;
* **presence**: the feed also walks the prefix's key names and reads every engine's
  announcements; what it learns is pushed to subscribers (``Presence``; a new one gets the
  last :data:`PRESENCE_WINDOW` digests in its ``Welcome``), so an engine without a Redis
  connection keeps the same summary of what Redis may hold as one with its own (misses no
  engine announced are answered without a probe);
* **restores**: ``Restore`` reads values from Redis straight into slots leased to the
  daemon's own row, checked by the Redis tier (header, key, save id, checksum), commits
  them under the engines' host digests *with the save id asked for* (TP ranks' shards of
  one save keep one id in the host tier too), and answers where they are. It answers only
  with that save: an entry of another save under the digest is replaced by the one read
  from Redis, never handed out in its place. Every engine on the host then finds them in
  the host tier. A restore answers on every path (an error is a miss) and gives back every
  slot it leased and did not commit;
* **probes**: ``Probe`` answers which save of each key Redis holds (a header read).

Redis I/O runs on this module's threads, never on the daemon's socket loop; replies go
back through ``post`` (run on the loop). Nothing read from Redis is trusted before the
Redis tier's checks; nothing is unpickled or evaluated.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from offload_tiers.host_tier.directory import HostDirectory, Location
from offload_tiers.host_tier.protocol import EntryTuple
from offload_tiers.keys import BlockKey

if TYPE_CHECKING:  # redis-py is imported only where Redis is configured
    from offload_tiers.redis.presence_feed import PresenceFeed
    from offload_tiers.redis.tier import RedisTier

log = logging.getLogger("kvtier.host_tier")

#: Key-name digests the daemon keeps for new subscribers (8 bytes each: 8 MiB), as many as
#: an engine's presence summary remembers by default (``presence_capacity``).
PRESENCE_WINDOW = 1 << 20
#: How often learned digests are pushed to subscribers.
PRESENCE_PUSH_S = 0.05

#: Backfill writes out at once (one batch of the Redis writer), and how often a thread with
#: writes to backfill looks whether Redis answers again (the Redis tier probes on its own).
BACKFILL_BATCH = 32
BACKFILL_POLL_S = 0.1

#: (host digest, where the save lies, its Redis key, the Redis save id, announce it)
WriteItem = tuple[bytes, Location, BlockKey, int, bool]
#: (host digest, Redis key, Redis save id asked for, payload length)
RestoreItem = tuple[bytes, BlockKey, int, int]


@dataclass(slots=True)
class RedisServiceCounters:
    redis_writes_queued: int = 0
    redis_writes: int = 0
    redis_write_failures: int = 0
    redis_writes_skipped: int = 0  # the slot was reused before its bytes were read back
    redis_probes: int = 0
    redis_restores_asked: int = 0
    redis_restored: int = 0
    redis_restore_misses: int = 0  # not in Redis, invalid, another save, or no slot
    redis_restores_already_held: int = 0  # answered from the directory, no Redis read
    redis_backfills: int = 0  # failed writes submitted again once Redis answered
    redis_backfilled: int = 0
    redis_backfill_failures: int = 0
    redis_backfill_skipped: int = 0  # the slot was reused before the backfill read it
    redis_backfill_dropped: int = 0  # more failed writes than the host tier has slots

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class HostTierRedisService:
    """Redis write-behind and restores for one host tier (``directory``, under ``lock``)."""

    def __init__(self, redis: RedisTier, directory: HostDirectory, lock: threading.RLock,
                 post: Callable[[Callable[[], None]], None], *, request_threads: int = 2,
                 feed: PresenceFeed | None = None,
                 push: Callable[[np.ndarray, bool], None] | None = None,
                 window: int = PRESENCE_WINDOW) -> None:
        """``feed``: a started PresenceFeed (announces; learns when its ``learn``);
        ``push(digests, synced)``, run on the loop, sends learned digests to subscribers."""
        self.redis = redis
        self.directory = directory
        self.segment = directory.segment
        self.lock = lock
        self._post = post
        self.feed = feed
        self._push = push
        self._window = window
        self._learned: deque[np.ndarray] = deque()  # the newest ``window`` digests, in order
        self._learned_count = 0
        self._synced = False
        self._stop = threading.Event()
        self._pump: threading.Thread | None = None
        if feed is not None and getattr(feed, "learn", False) and push is not None:
            self._pump = threading.Thread(target=self._pump_presence, daemon=True,
                                          name="kvtier-host-presence")
            self._pump.start()
        with lock:
            row = directory.attach_client()
        if row is None:
            raise ValueError("the host tier has no client row left for its Redis service")
        self.row = row  # the daemon's own row: restores are leased and committed under it
        self.counters = RedisServiceCounters()
        self._counter_lock = threading.Lock()
        self._writes = ThreadPoolExecutor(1, thread_name_prefix="kvtier-host-redis-write")
        self._requests = ThreadPoolExecutor(request_threads,
                                            thread_name_prefix="kvtier-host-redis-read")
        # Writes that failed, to write again once Redis answers (by digest: the newest wins).
        self._failed: OrderedDict[bytes, WriteItem] = OrderedDict()
        self._failed_max = self.segment.num_slots
        self._backfill_out = threading.Condition(self._counter_lock)
        self._backfill_pending = 0
        self._backfiller = threading.Thread(target=self._run_backfill, daemon=True,
                                            name="kvtier-host-redis-backfill")
        self._backfiller.start()

    # ------------------------------------------------------------ callers (the loop)
    def write_behind(self, items: list[WriteItem]) -> None:
        if items:
            self._writes.submit(self._write, items)

    def probe(self, keys: list[BlockKey], reply: Callable[[list[int]], None]) -> None:
        self._requests.submit(self._probe, keys, reply)

    def restore(self, items: list[RestoreItem],
                reply: Callable[[list[EntryTuple | None]], None]) -> None:
        self._requests.submit(self._restore, items, reply)

    def stats(self) -> dict[str, Any]:
        with self._counter_lock:
            out: dict[str, Any] = self.counters.as_dict()
        st = self.redis.stats()
        out.update(redis_available=int(bool(st["available"])), redis_write_queue=st["queue_depth"],
                   redis_write_queue_bytes=st["queue_bytes"], redis_url=st["url"])
        if self.feed is not None:
            fs = self.feed.stats()
            with self._counter_lock:  # what subscribers have been sent, not the feed's own
                synced, window = self._synced, self._learned_count
            out.update(redis_announced=int(fs["announced"]), presence_synced=int(synced),
                       redis_announce_dropped=int(fs.get("announce_dropped", 0)),
                       presence_learned_dropped=int(fs.get("learned_dropped", 0)),
                       presence_learned=int(fs["learned_stream"]) + int(fs["learned_scan"]),
                       presence_window=window)
        return out

    def close(self, timeout: float = 5.0) -> None:
        """Finish queued work (bounded by the Redis tier's own timeouts), then close Redis."""
        self._stop.set()
        if self._pump is not None:
            self._pump.join()
        self._requests.shutdown(wait=True, cancel_futures=True)
        self._writes.shutdown(wait=True)
        self.redis.close(timeout=timeout)  # answers every write still out: the thread ends
        self._backfiller.join()
        if self.feed is not None:
            self.feed.close(timeout)

    def presence_snapshot(self) -> tuple[np.ndarray, bool]:
        """The newest learned digests (up to the window) and whether the feed is synced:
        a new subscriber's start (later ones arrive pushed)."""
        with self._counter_lock:
            parts = list(self._learned)
            synced = self._synced
        return (np.concatenate(parts) if parts else np.zeros(0, dtype="<u8")), synced

    def _pump_presence(self) -> None:
        """Move what the feed learned into the window and to subscribers (via the loop)."""
        assert self.feed is not None and self._push is not None
        push = self._push
        while not self._stop.wait(PRESENCE_PUSH_S):
            synced = bool(self.feed.synced)  # read before draining: the walk's come first
            learned = np.asarray(self.feed.take(), dtype="<u8")
            with self._counter_lock:
                changed = bool(len(learned)) or synced != self._synced
                if len(learned):
                    self._learned.append(learned)
                    self._learned_count += len(learned)
                    while self._learned_count - len(self._learned[0]) >= self._window:
                        self._learned_count -= len(self._learned.popleft())
                self._synced = synced
            if changed:
                self._post(lambda d=learned, s=synced: push(d, s))

    # ------------------------------------------------------------ threads
    def _count(self, **deltas: int) -> None:
        with self._counter_lock:
            for name, delta in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + delta)

    def _write(self, items: list[WriteItem], backfill: bool = False) -> None:
        """Read each save back from its slot and queue it to Redis (a backfill: counted
        apart, and waited for by the caller through ``_backfill_pending``). A first write's
        entry was held at its commit: let go once its bytes are read."""
        for item in items:
            digest, where, key, save_id, _announce = item
            payload = np.empty(where.length, dtype=np.uint8)
            try:
                read = self.segment.read_into(where.slot, digest, where.save_id, payload)
            finally:
                if not backfill:
                    with self.lock:
                        self.directory.unpin_for_copy(digest)
            if not read:
                self._count(**({"redis_backfill_skipped": 1} if backfill else
                               {"redis_writes_skipped": 1, "redis_write_failures": 1}))
                continue
            with self._counter_lock:
                if backfill:
                    self.counters.redis_backfills += 1
                    self._backfill_pending += 1
                else:
                    self.counters.redis_writes_queued += 1
            self.redis.submit_put(key, payload, save_id=save_id,
                                  on_done=self._written(item, backfill))

    def _written(self, item: WriteItem, backfill: bool) -> Callable[[bool], None]:
        announce = item[2] if item[4] else None

        def done(stored: bool) -> None:
            with self._counter_lock:
                if backfill:
                    if stored:
                        self.counters.redis_backfilled += 1
                    else:
                        self.counters.redis_backfill_failures += 1
                    self._backfill_pending -= 1
                    self._backfill_out.notify_all()
                elif stored:
                    self.counters.redis_writes += 1
                else:
                    self.counters.redis_write_failures += 1
                    self._failed[item[0]] = item
                    self._failed.move_to_end(item[0])
                    if len(self._failed) > self._failed_max:
                        self._failed.popitem(last=False)
                        self.counters.redis_backfill_dropped += 1
            if stored and announce is not None and self.feed is not None:
                self.feed.announce([announce.name.encode()])
        return done

    def _run_backfill(self) -> None:
        """Once Redis answers, write the failed writes again, a batch at a time (the next
        once every write of the last is answered)."""
        while not self._stop.wait(BACKFILL_POLL_S):
            while self.redis.available and not self._stop.is_set():
                with self._counter_lock:
                    batch = [self._failed.popitem(last=False)[1]
                             for _ in range(min(BACKFILL_BATCH, len(self._failed)))]
                if not batch:
                    break
                self._write(batch, backfill=True)
                with self._backfill_out:  # every write ends answered (closing: dropped)
                    self._backfill_out.wait_for(lambda: self._backfill_pending == 0)

    def _probe(self, keys: list[BlockKey], reply: Callable[[list[int]], None]) -> None:
        self._count(redis_probes=len(keys))
        try:
            ids: Sequence[int | None] = self.redis.save_ids_many(keys)
        except Exception:
            log.exception("host tier: Redis probe failed")
            ids = [None] * len(keys)
        answer = [i or 0 for i in ids]
        self._post(lambda: reply(answer))

    def _restore(self, items: list[RestoreItem],
                 reply: Callable[[list[EntryTuple | None]], None]) -> None:
        """Answer a restore on every path: each item the asked save, or None."""
        out: list[EntryTuple | None] = [None] * len(items)
        try:
            self._restore_into(items, out)
        except Exception:
            log.exception("host tier: a restore failed; answered as misses")
        finally:
            self._post(lambda: reply(out))

    def _restore_into(self, items: list[RestoreItem], out: list[EntryTuple | None]) -> None:
        todo: list[int] = []
        already = 0
        with self.lock:
            for i, (digest, _key, save_id, length) in enumerate(items):
                held = self.directory.entries.get(digest)
                if held is not None and held.length == length and held.save_id == save_id:
                    out[i] = (digest, held.slot, held.save_id, held.length)
                    already += 1
                elif 0 < length <= self.segment.slot_bytes and save_id:
                    todo.append(i)  # absent, or another save: read the asked one
            slots = self.directory.lease(self.row, len(todo))
        pairs = list(zip(todo, slots, strict=False))
        committed: set[int] = set()
        restored = 0
        try:
            written = self._read_into_slots(items, pairs)
            with self.lock:
                for i, slot in written:
                    digest, _key, save_id, length = items[i]
                    if self.directory.commit(self.row, slot, digest, save_id, length,
                                             replace=True):
                        out[i] = (digest, slot, save_id, length)
                        committed.add(slot)
                        restored += 1
                    elif (held := self.directory.entries.get(digest)) is not None \
                            and held.length == length and held.save_id == save_id:
                        out[i] = (digest, held.slot, held.save_id, held.length)
                        already += 1  # another restore of it came first
        finally:
            with self.lock:
                for _, slot in pairs:
                    if slot not in committed:
                        self.directory.abandon(self.row, slot)
            self._count(redis_restores_asked=len(items), redis_restored=restored,
                        redis_restores_already_held=already,
                        redis_restore_misses=len(items) - restored - already)

    def _read_into_slots(self, items: list[RestoreItem], pairs: list[tuple[int, int]]
                         ) -> list[tuple[int, int]]:
        """Read the asked saves from Redis into their leased slots and commit each write
        there (checksum) under the asked save id; the (item, slot) pairs written."""
        if not pairs:
            return []
        rows = [self.segment.begin_write(slot)[:items[i][3]] for i, slot in pairs]
        try:
            got = self.redis.get_many_into([items[i][1] for i, _ in pairs], rows,
                                           save_ids=[items[i][2] for i, _ in pairs])
        except Exception:
            log.exception("host tier: Redis restore failed")
            got = [False] * len(pairs)
        written = []
        for (i, slot), ok in zip(pairs, got, strict=True):
            if ok:
                digest, _key, save_id, length = items[i]
                self.segment.commit_write(slot, digest, save_id, length)
                written.append((i, slot))
        return written
