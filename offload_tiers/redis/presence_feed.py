"""What every writer sharing a Redis prefix stored, learned without asking per key.

A :class:`PresenceFeed` runs one thread of its own (never the caller's):

* **Announce.** ``announce(names)`` queues the digests (:func:`offload_tiers.presence.
  name_digest`) of key names this process stored; the thread appends them to the prefix's
  announcement stream ``{prefix}:announce`` (``XADD``, one entry per batch, field ``d`` =
  packed 8-byte digests, ``MAXLEN ~`` :data:`STREAM_MAXLEN` entries).
* **Learn.** At start, and again after any Redis failure, it notes the stream's last entry,
  walks the key names under ``{prefix}:`` (``SCAN``, paced to ``scan_keys_per_s``), then reads
  the stream from the noted entry on (``XREAD``, blocking at most ``block_ms``): what others
  stored during the walk is in the stream. Every digest learned is handed over by
  :meth:`take`; ``synced`` is True once the walk is done and the stream read to its end, and
  False from the first failure until the next walk is done.

Entries not written by a feed (a foreign writer, a truncated value) are skipped and counted,
never raised. Nothing read is evaluated. Errors are logged without the password. A server
that refuses the stream commands (ACL) or holds more than ``max_keys`` key names under the
prefix turns the feed off for good (``synced`` stays False, callers ask Redis per key), said
once in a warning.

Its memory is bounded: both queues hold 8-byte digests (an ``array``, not Python ints). The
announcements waiting for ``XADD`` (they pile up while Redis does not answer) are at most
``announce_max``, and the learned digests waiting for :meth:`take` (they pile up while no
one takes them: an idle engine's scheduler) at most ``learned_max`` (default ``max_keys``:
a summary keeps no more than its capacity anyway); past either, the oldest are dropped and
counted (``announce_dropped``, ``learned_dropped``). A feed that turned itself off drops its
queued announcements at once and every later one as it comes (counted in
``announce_dropped``).
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections.abc import Iterable
from typing import Any

from redis.exceptions import NoPermissionError, ResponseError

from offload_tiers.keys import parse_key_name
from offload_tiers.presence import name_digest, pack_digests, unpack_digests
from offload_tiers.redis.client import ClientFactory, Health, close_quietly
from offload_tiers.thread_names import name_current_thread
from offload_tiers.thread_priority import lower_current_thread

__all__ = ["ANNOUNCE_MAX", "ANNOUNCE_SUFFIX", "STREAM_MAXLEN", "PresenceFeed",
           "announce_stream", "is_announce_stream"]

log = logging.getLogger(__name__)

#: The announcement stream's name under a prefix: ``{prefix}:announce``.
ANNOUNCE_SUFFIX = "announce"
#: Entries the stream keeps (approximately; each holds one batch of digests).
STREAM_MAXLEN = 10_000
#: Digests per stream entry at most.
BATCH_MAX = 512
#: Announced digests waiting for ``XADD`` at most (512 KiB; 128 stream entries): the oldest
#: are dropped past it. A dropped announcement costs another engine a miss, never a wrong
#: block (and while Redis does not answer, the writes it announces mostly fail too).
ANNOUNCE_MAX = 1 << 16
_SCAN_COUNT = 1000
_READ_COUNT = 1000


def announce_stream(prefix: str) -> bytes:
    """The announcement stream of ``prefix``."""
    return f"{prefix}:{ANNOUNCE_SUFFIX}".encode()


def is_announce_stream(rest: bytes) -> bool:
    """``rest`` (a key name after ``{prefix}:``) is the announcement stream of this prefix or
    of a nested one (no block's name ends so: its last part is a hex hash)."""
    suffix = ANNOUNCE_SUFFIX.encode()
    return rest == suffix or rest.endswith(b":" + suffix)


class PresenceFeed:
    """Announces this process's stores and learns everyone's, on its own thread."""

    def __init__(self, factory: ClientFactory, prefix: str, *, max_keys: int = 1 << 20,
                 scan_keys_per_s: float = 200_000.0, block_ms: int = 100,
                 backoff_initial_s: float = 0.1, backoff_max_s: float = 5.0,
                 learn: bool = True, skip_own: bool = False,
                 announce_max: int = ANNOUNCE_MAX, learned_max: int | None = None) -> None:
        """``learn=False``: announce only (no walk of key names, no reading of the stream),
        e.g. for a process that writes on engines' behalf and looks nothing up.
        ``skip_own``: do not hand back this feed's own announcements read from the stream
        (for a caller that remembers what it announced). ``announce_max`` / ``learned_max``
        (default ``max_keys``): digests queued to announce / to hand over at most, the
        oldest dropped past them."""
        if scan_keys_per_s <= 0:
            raise ValueError(f"scan_keys_per_s must be positive, got {scan_keys_per_s}")
        learned_max = max_keys if learned_max is None else learned_max
        if announce_max < 1 or learned_max < 1:
            raise ValueError(f"announce_max and learned_max must be ≥ 1, got {announce_max} "
                             f"and {learned_max}")
        self._factory = factory
        self.prefix = prefix
        self.stream = announce_stream(prefix)
        self._match = f"{prefix}:*".encode()
        self._name_start = len(prefix) + 1
        self.max_keys = max_keys
        self.scan_keys_per_s = scan_keys_per_s
        self.block_ms = block_ms
        self._health = Health(factory.target.redacted, backoff_initial_s, backoff_max_s)
        self._lock = threading.Lock()
        self.announce_max = announce_max
        self.learned_max = learned_max
        self._outgoing: array[int] = array("Q")  # digests to announce, oldest first
        self._learned: array[int] = array("Q")  # digests learned, not taken yet
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: Any = None
        self._cursor = b"0-0"
        self.learn = learn
        self._need_walk = learn
        self._skip_own = skip_own
        self._own_ids: dict[bytes, None] = {}  # ids of own entries not read back yet
        self.synced = False
        self.disabled = ""  # why the feed stopped for good ("" while it runs)
        self._n = dict.fromkeys(("announced", "learned_stream", "learned_scan", "walks",
                                 "bad_entries", "own_skipped", "failures",
                                 "announce_dropped", "learned_dropped"), 0)

    # ------------------------------------------------------------------ caller's side
    def start(self) -> PresenceFeed:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvtier-presence",
                                            daemon=True)
            self._thread.start()
        return self

    def announce(self, names: Iterable[bytes]) -> None:
        """Queue the key names (without the prefix) this process stored (dropped, counted,
        once the feed is off)."""
        if self.disabled:
            self._drop_announced(sum(1 for _ in names))
            return
        self.announce_digests([name_digest(n) for n in names])

    def announce_digests(self, digests: Iterable[int]) -> None:
        """Queue digests to announce: at most ``announce_max`` wait, the oldest dropped."""
        batch = array("Q", digests)
        with self._lock:
            if self.disabled:
                self._n["announce_dropped"] += len(batch)
                return
            self._append(self._outgoing, batch, self.announce_max, "announce_dropped")

    def take(self) -> list[int]:
        """Digests learned since the last call (the newest ``learned_max`` of them)."""
        with self._lock:
            out, self._learned = self._learned, array("Q")
        return out.tolist()

    def drop_counts(self) -> tuple[int, int]:
        """``(announce_dropped, learned_dropped)``: digests dropped so far (cheap, for a
        caller that asks every step)."""
        with self._lock:
            return self._n["announce_dropped"], self._n["learned_dropped"]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._n)
            out.update(announce_queue=len(self._outgoing), learned_queue=len(self._learned))
        out.update(synced=int(self.synced), disabled=self.disabled)
        return out

    def _drop_announced(self, count: int) -> None:
        with self._lock:
            self._n["announce_dropped"] += count

    def _append(self, queue: array[int], digests: array[int], limit: int,
                counter: str) -> None:
        """Append to a queue (under the lock), dropping its oldest past ``limit``."""
        queue.extend(digests)
        over = len(queue) - limit
        if over > 0:
            del queue[:over]
            self._n[counter] += over

    def _turn_off(self, why: str) -> None:
        """Stop for good: the queued announcements are dropped (counted), as are later ones."""
        with self._lock:
            self._n["announce_dropped"] += len(self._outgoing)
            self._outgoing = array("Q")
            self.disabled = why

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (its queued announcements are flushed first when Redis answers)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        close_quietly(self._client)
        self._client = None

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        name_current_thread()
        lower_current_thread()
        while not self._stop.is_set() and not self.disabled:
            now = time.monotonic()
            if self._health.waiting(now):
                self._stop.wait(max(0.0, self._health.next_try - now))
                continue
            try:
                client = self._connect()
                if self._need_walk:
                    self._walk(client)
                self._flush(client)
                if self.learn:
                    self._read(client, block=True)
                else:
                    self._stop.wait(self.block_ms / 1000)
                if self._health.recovered():
                    log.info("kvtier presence feed: Redis %s answers again", self._health.label)
            except _Stop:
                continue
            except Exception as exc:  # refused, reset, timeout, cluster down: all the same
                self._failed(exc)
        if self._stop.is_set() and self._client is not None and not self.disabled:
            try:
                self._flush(self._client)
            except Exception:
                log.debug("kvtier presence feed: final flush failed", exc_info=True)

    def _connect(self) -> Any:
        if self._client is None:
            self._client = self._factory.make()
        return self._client

    def _failed(self, exc: BaseException) -> None:
        self.synced = False
        self._need_walk = self.learn
        close_quietly(self._client)
        self._client = None
        with self._lock:
            self._n["failures"] += 1
        if _refused(exc):
            self._turn_off(f"Redis refuses the presence stream's commands (XADD, XREAD, "
                           f"XREVRANGE, SCAN): {self._factory.describe(exc)}")
            log.warning("kvtier presence feed off: %s; every miss asks Redis. Fix: allow "
                        "those commands on %s* for this user", self.disabled, self.prefix)
            return
        if self._health.failed(time.monotonic()):
            log.warning("kvtier presence feed: Redis %s failed (%s); misses ask Redis until "
                        "the feed has walked the key names again", self._health.label,
                        self._factory.describe(exc))

    def _walk(self, client: Any) -> None:
        """Note the stream's tip, learn every key name under the prefix, read the stream up
        to now; then ``synced``."""
        self.synced = False
        tip = client.xrevrange(self.stream, count=1)
        self._cursor = tip[0][0] if tip else b"0-0"
        seen = 0
        batch: list[int] = []
        started = time.monotonic()
        for key in client.scan_iter(match=self._match, count=_SCAN_COUNT):
            name = key[self._name_start:]
            if parse_key_name(name) is None:
                continue  # the stream, nested prefixes, foreign keys: not a block's name
            batch.append(name_digest(name))
            seen += 1
            if seen > self.max_keys:
                self._turn_off(f"Redis holds more than {self.max_keys} key names under "
                               f"{self.prefix}:")
                log.warning("kvtier presence feed off: %s; every miss asks Redis. Fix: raise "
                            "presence_capacity", self.disabled)
                raise _Stop
            if len(batch) >= _SCAN_COUNT:
                self._learn(batch, "learned_scan")
                batch = []
                ahead = seen / self.scan_keys_per_s - (time.monotonic() - started)
                if ahead > 0 and self._stop.wait(ahead):
                    raise _Stop
        self._learn(batch, "learned_scan")
        while self._read(client, block=False) >= _READ_COUNT:
            pass
        self._need_walk = False
        self.synced = True
        with self._lock:
            self._n["walks"] += 1
        log.info("kvtier presence feed: synced with %s (%d key names under %s:, %.2f s)",
                 self._health.label, seen, self.prefix, time.monotonic() - started)

    def _flush(self, client: Any) -> None:
        with self._lock:
            out, self._outgoing = self._outgoing, array("Q")
        for i in range(0, len(out), BATCH_MAX):
            chunk = out[i:i + BATCH_MAX]
            try:
                entry_id = client.xadd(self.stream, {b"d": pack_digests(chunk.tolist())},
                                       maxlen=STREAM_MAXLEN, approximate=True)
            except Exception:
                with self._lock:  # keep what was not sent for the next try (it is older)
                    queued, self._outgoing = self._outgoing, out[i:]
                    self._append(self._outgoing, queued, self.announce_max,
                                 "announce_dropped")
                raise
            if self._skip_own:
                self._own_ids[entry_id] = None
                while len(self._own_ids) > STREAM_MAXLEN:  # never read back (trimmed, reset)
                    del self._own_ids[next(iter(self._own_ids))]
            with self._lock:
                self._n["announced"] += len(chunk)

    def _read(self, client: Any, *, block: bool) -> int:
        """Read the stream past the cursor; the number of entries read."""
        reply = client.xread({self.stream: self._cursor}, count=_READ_COUNT,
                             block=self.block_ms if block else None)
        entries = _entries(reply)
        digests: list[int] = []
        bad = own = 0
        for entry_id, fields in entries:
            self._cursor = entry_id
            if entry_id in self._own_ids:
                del self._own_ids[entry_id]
                own += 1
                continue
            data = fields.get(b"d") if isinstance(fields, dict) else None
            try:
                if not isinstance(data, bytes):
                    raise ValueError("no digest field")
                digests.extend(int(d) for d in unpack_digests(data))
            except ValueError:
                bad += 1
        if own:
            with self._lock:
                self._n["own_skipped"] += own
        if bad:
            with self._lock:
                self._n["bad_entries"] += bad
            log.debug("kvtier presence feed: %d stream entries were not digests", bad)
        self._learn(digests, "learned_stream")
        return len(entries)

    def _learn(self, digests: list[int], counter: str) -> None:
        if not digests:
            return
        batch = array("Q", digests)
        with self._lock:
            self._append(self._learned, batch, self.learned_max, "learned_dropped")
            self._n[counter] += len(digests)


class _Stop(Exception):
    """The walk ends: the feed is closing or turned off."""


def _refused(exc: BaseException) -> bool:
    if isinstance(exc, NoPermissionError):
        return True
    text = str(exc)
    return isinstance(exc, ResponseError) and (text.startswith("NOPERM")
                                               or "unknown command" in text)


def _entries(reply: Any) -> list[tuple[bytes, Any]]:
    """``[(id, fields)]`` of one stream's XREAD reply (redis-py's RESP2 list or RESP3 map)."""
    if not reply:
        return []
    streams = reply.values() if isinstance(reply, dict) else (s[1] for s in reply)
    out: list[tuple[bytes, Any]] = []
    for items in streams:
        if items and isinstance(items[0], list) and items[0] \
                and isinstance(items[0][0], list | tuple):
            items = items[0]  # RESP3: one more level of nesting
        for entry in items:
            fields = entry[1]
            if isinstance(fields, list):
                fields = dict(zip(fields[::2], fields[1::2], strict=False))
            out.append((entry[0], fields))
    return out
