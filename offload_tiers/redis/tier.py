"""The Redis tier: one Redis key per block, pipelined batches, write-behind, never raises.

Key names are ``{prefix}:{fingerprint}:{group}:{hash hex}``; values are
:mod:`offload_tiers.codec` (header + payload). Works with one server (``redis://``,
``rediss://``, ``unix://``, credentials in the URL) and with Redis Cluster
(``redis+cluster://`` / ``rediss+cluster://`` or ``cluster=True``). The batches travel on a
:class:`~offload_tiers.redis.channel.RedisChannel` (pipelining, the Cluster fan-out, endpoint
health and the failure model live there); this module says what the commands and replies
mean for blocks. ``get_many_into`` receives each GET reply straight into the caller's buffer
(a CPU-tier slot) and checks header and checksum there; a SET's header is built as the
pipeline window reaches it, so encoding overlaps the server.

Nothing raises into the caller for Redis trouble (reads miss, writes are counted as failed),
except ``from_url(strict=True)`` at start-up. Error texts and logs never contain the password.

Save ids: a store may carry the writer's save id in the header (:mod:`offload_tiers.codec`);
a read that asks for one treats a valid value of another save as a miss (``stale_saves``),
never as corrupt. ``save_ids_many`` reports the stored save ids without reading payloads.

Corrupt values: a value a read proved corrupt (header or checksum) is deleted right after the
read, on the calling thread, by a one-key Lua script that unlinks it only while its first 64
bytes are still the bytes judged (a value rewritten meanwhile is kept). Best effort and
counted (``corrupt_deleted``); off with ``delete_corrupt=False``. A miss, another save, an
error reply or a timeout never deletes anything.
"""

from __future__ import annotations

import hashlib
import logging
import random
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from redis.exceptions import ResponseError

from offload_tiers import codec
from offload_tiers._types import BytesLike
from offload_tiers.keys import BlockKey
from offload_tiers.redis.channel import LazyCommands, RedisChannel
from offload_tiers.redis.client import ClientFactory
from offload_tiers.redis.counters import Counters
from offload_tiers.redis.resp import Reader, command, set_parts
from offload_tiers.redis.settings import WRITE_LINGER_S, RedisConnectionSettings
from offload_tiers.redis.url import RedisTarget, parse_redis_url
from offload_tiers.redis.write_behind import DoneCallback, Item, WriteBehind

log = logging.getLogger(__name__)

#: The event counts that move :attr:`RedisTier.events_serial` (outages, bad values).
EVENT_COUNTS = ("unavailable_events", "recoveries", "corrupt", "corrupt_deleted", "stale_saves")
#: Every count :meth:`RedisTier.counts` reports, in its order.
COUNT_NAMES = ("puts", "put_bytes", "put_failures", "gets", "hits", "misses", "corrupt",
               "exists_checks", "deletes", "errors", "unavailable_events", "recoveries",
               "dropped_unavailable", "skipped_unavailable", "stale_saves", "corrupt_deleted",
               "corrupt_changed", "corrupt_delete_failures")

# Unlink KEYS[1] only while its first 64 bytes are ARGV[1] and its length ARGV[2]: what was
# judged corrupt (a short value's GETRANGE is the short bytes, so those compare as read).
# One key: Cluster-safe.
_LUA_UNLINK_IF_SAME = ("if redis.call('GETRANGE', KEYS[1], 0, 63) == ARGV[1] and "
                       "redis.call('STRLEN', KEYS[1]) == tonumber(ARGV[2]) then "
                       "return redis.call('UNLINK', KEYS[1]) else return 0 end")
_LUA_SHA = hashlib.sha1(_LUA_UNLINK_IF_SAME.encode(), usedforsecurity=False).hexdigest().encode()


#: A value proven corrupt: (key name, its first 64 bytes as read, its length).
Doomed = tuple[bytes, bytes, int]


class _Refused(NamedTuple):
    """A value a read did not serve. ``judged``: the bytes that proved it corrupt (its first
    64, or fewer for a short value), to delete it while unchanged; None when it is not proof
    of corruption (``stale``: another save; else another kind, ``num_tokens`` or length than
    asked — maybe a valid value for another reader of the same name)."""

    reason: str
    judged: bytes | None = None
    total_len: int = 0
    stale: bool = False


class RedisTierError(RuntimeError):
    """Start-up failure reported by ``from_url(strict=True)`` (never contains the password)."""


class RedisTier:
    """Blocks in Redis. Build with :meth:`from_url`."""

    def __init__(self, client: ClientFactory, *, prefix: str = "kvtier",
                 ttl_s: float | None = None, ttl_jitter: float = 0.1, max_inflight: int = 64,
                 max_inflight_bytes: int = 64 << 20, write_queue_max: int = 256,
                 write_queue_max_bytes: int = 512 << 20, backoff_initial_s: float = 0.1,
                 backoff_max_s: float = 5.0, delete_corrupt: bool = True,
                 write_linger_s: float = WRITE_LINGER_S, write_settle_s: float = 0.0,
                 write_batch_items: int = 32, write_pace_s: float = 0.0) -> None:
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        if not 0 <= ttl_jitter <= 1:
            raise ValueError(f"ttl_jitter must be within [0, 1], got {ttl_jitter}")
        self.target: RedisTarget = client.target
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.ttl_jitter = ttl_jitter
        self.delete_corrupt = delete_corrupt
        self._scripts_refused = False  # the server refuses EVAL (ACL): no corrupt deletes
        self._factory = client
        self._closed = False
        self._counts = Counters(COUNT_NAMES, EVENT_COUNTS)
        self._channel = RedisChannel(client, self._counts, max_inflight=max_inflight,
                                     max_inflight_bytes=max_inflight_bytes,
                                     backoff_initial_s=backoff_initial_s,
                                     backoff_max_s=backoff_max_s)
        self._writer = WriteBehind(self._sink, max_items=write_queue_max,
                                   max_bytes=write_queue_max_bytes, tick=self._channel.probe,
                                   linger_s=write_linger_s, settle_s=write_settle_s,
                                   batch_items=write_batch_items, pace_s=write_pace_s,
                                   name="kvtier-redis-writer")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_url(cls, url: str, *, prefix: str = "kvtier", ttl_s: float | None = None,
                 ttl_jitter: float = 0.1, redis_timeout_s: float = 2.0,
                 connect_timeout_s: float | None = None, max_inflight: int = 64,
                 max_inflight_bytes: int = 64 << 20, write_queue_max: int = 256,
                 write_queue_max_bytes: int = 512 << 20, cluster: bool | None = None,
                 ssl_ca_certs: str | None = None, backoff_initial_s: float = 0.1,
                 backoff_max_s: float = 5.0, strict: bool = False, delete_corrupt: bool = True,
                 write_linger_s: float = WRITE_LINGER_S, write_settle_s: float = 0.0,
                 write_batch_items: int = 32, write_pace_s: float = 0.0,
                 **redis_kwargs: Any) -> RedisTier:
        """Connect to ``url``; with ``strict`` a failing first contact raises RedisTierError.

        ``redis_timeout_s`` bounds every network wait (and connecting, unless
        ``connect_timeout_s``). ``write_linger_s``: how long the write-behind thread waits
        for more stores once one arrives (0: it writes at once; a flush never waits for it);
        ``write_settle_s``: how long after the latest store it waits at least (ditto);
        ``write_batch_items``: stores per pipelined batch at most; ``write_pace_s``: the
        gap between two batches while more wait (``WriteBehind``'s ``pace_s``).
        Extra keyword arguments go to redis-py (e.g. ``ssl_certfile``, ``ssl_keyfile``,
        ``password``).
        """
        if "socket_timeout_s" in redis_kwargs:  # the name before redis_timeout_s
            warnings.warn("RedisTier.from_url(socket_timeout_s=) is deprecated; use "
                          "redis_timeout_s=", DeprecationWarning, stacklevel=2)
            redis_timeout_s = redis_kwargs.pop("socket_timeout_s")
        target = parse_redis_url(url, cluster)
        redis_kwargs.setdefault("socket_read_size", 1 << 20)  # fewer recv calls for big values
        client = ClientFactory(target, timeout_s=redis_timeout_s,
                               connect_timeout_s=connect_timeout_s, ssl_ca_certs=ssl_ca_certs,
                               **redis_kwargs)
        tier = cls(client, prefix=prefix, ttl_s=ttl_s, ttl_jitter=ttl_jitter,
                   max_inflight=max_inflight, max_inflight_bytes=max_inflight_bytes,
                   write_queue_max=write_queue_max, write_queue_max_bytes=write_queue_max_bytes,
                   backoff_initial_s=backoff_initial_s, backoff_max_s=backoff_max_s,
                   delete_corrupt=delete_corrupt, write_linger_s=write_linger_s,
                   write_settle_s=write_settle_s, write_batch_items=write_batch_items,
                   write_pace_s=write_pace_s)
        tier._channel.probe(force=True)
        if strict and not tier.available:
            error = tier.last_error
            tier.close()
            raise RedisTierError(f"cannot use Redis at {target.redacted}: {error}")
        return tier

    @classmethod
    def from_settings(cls, settings: RedisConnectionSettings, **tuning: Any) -> RedisTier:
        """:meth:`from_url` with the connection settings every kvtier config shares
        (resolved: ``redis_url`` carries its credentials); ``tuning``: the other arguments."""
        if not settings.redis_url:
            raise ValueError("no redis_url: the settings are not resolved, or name no Redis")
        return cls.from_url(settings.redis_url, prefix=settings.redis_prefix,
                            ttl_s=settings.redis_ttl_s, redis_timeout_s=settings.redis_timeout_s,
                            ssl_ca_certs=settings.redis_ssl_ca_certs, **tuning)

    # ------------------------------------------------------------------ the channel's state
    @property
    def available(self) -> bool:
        """True when the last contact with every known endpoint succeeded."""
        return self._channel.available

    @property
    def last_error(self) -> str:
        return self._channel.last_error

    @property
    def noeviction(self) -> bool:
        """True once a server said its ``maxmemory-policy`` is ``noeviction``."""
        return self._channel.noeviction

    @property
    def max_inflight(self) -> int:
        return self._channel.max_inflight

    @property
    def max_inflight_bytes(self) -> int:
        return self._channel.max_inflight_bytes

    # ------------------------------------------------------------------ blocks
    def _name(self, key: BlockKey) -> bytes:
        return f"{self.prefix}:{key.name}".encode()

    def _px(self) -> int | None:
        if self.ttl_s is None:
            return None
        return max(1, int(self.ttl_s * 1000 * (1 + random.uniform(0, self.ttl_jitter))))

    # ------------------------------------------------------------------ API
    def put_many(self, items: Sequence[tuple[BlockKey, BytesLike]], *,
                 save_ids: Sequence[int] | None = None) -> int:
        """Store blocks now (pipelined); the number stored. ``save_ids[i]``: the save id
        ``items[i]``'s header carries (default 0). Never raises for Redis trouble; a key or
        save id that cannot be stored raises ValueError before anything is sent."""
        if save_ids is not None:
            if len(save_ids) != len(items):
                raise ValueError(f"{len(items)} items but {len(save_ids)} save ids")
            for save_id in save_ids:
                codec.validate_save_id(save_id)
        return sum(self._put_flags(items, save_ids))

    def _put_flags(self, items: Sequence[tuple[BlockKey, BytesLike]],
                   save_ids: Sequence[int] | None = None) -> list[bool]:
        if not items:
            return []
        keys = [key for key, _ in items]
        for key in keys:
            codec.validate_key(key)  # every key, before anything is sent
        views = [p if isinstance(p, bytes) else memoryview(p).cast("B") for _, p in items]
        names = [self._name(k) for k in keys]
        digests = _digests(keys)

        def build(i: int) -> list:  # run as the window is topped up: overlaps the server
            header = codec.encode_header(keys[i], views[i], digest=digests[i], validated=True,
                                         save_id=0 if save_ids is None else save_ids[i])
            return set_parts(names[i], header, views[i], self._px())

        sizes = [len(v) + codec.HEADER_SIZE for v in views]
        replies = self._channel.run(names, LazyCommands(len(items), build), sizes=sizes)
        flags = [r == b"OK" or r is True for r in replies]
        stored = sum(flags)
        self._counts.add(puts=stored, put_failures=len(flags) - stored,
                         put_bytes=sum(n - codec.HEADER_SIZE
                                       for n, ok in zip(sizes, flags, strict=True) if ok))
        for reply in replies:
            if isinstance(reply, ResponseError):
                log.debug("Redis refused a store: %s", self._factory.scrub(str(reply)))
        return flags

    def _sink(self, batch: Sequence[Item]) -> list[bool]:
        return self._put_flags([(item.key, item.payload) for item in batch],
                               [item.save_id for item in batch])

    def submit_put(self, key: BlockKey, payload: BytesLike, *,
                   on_done: DoneCallback | None = None, save_id: int = 0) -> bool:
        """Queue a store for the background writer; False = dropped (counted), never blocks.

        Without ``on_done`` a non-``bytes`` payload is copied (the caller may reuse its
        buffer). With ``on_done`` the caller keeps the buffer unchanged until
        ``on_done(stored: bool)`` runs (called exactly once, also on a drop). ``save_id``:
        the save id the stored header carries.
        """
        return self.submit_puts([(key, payload, on_done, save_id)])[0]

    def submit_puts(self, puts: Sequence[tuple[BlockKey, BytesLike, DoneCallback | None, int]]
                    ) -> list[bool]:
        """:meth:`submit_put` for several ``(key, payload, on_done, save_id)`` at once: one
        queue lock and one wake-up of the writer for all (a step's saves). Per put, False =
        dropped; every key and save id is checked before any is queued."""
        for key, _, _, save_id in puts:
            codec.validate_key(key)  # a bad key is the caller's error: say so now, not later
            codec.validate_save_id(save_id)
        if not self._accepting():
            self._counts.add(dropped_unavailable=len(puts))
            for _, _, on_done, _ in puts:
                if on_done is not None:
                    on_done(False)
            return [False] * len(puts)
        items = []
        for key, payload, on_done, save_id in puts:
            if on_done is None and not isinstance(payload, bytes):
                payload = bytes(memoryview(payload).cast("B"))
            items.append(Item(key, payload, memoryview(payload).nbytes, on_done, save_id))
        return self._writer.submit_many(items)

    def _accepting(self) -> bool:
        """Worth queueing a store? (A Cluster with one node down still takes the others'.)"""
        return not self._closed and self._channel.accepting()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued stores to be written (or fail); False on timeout."""
        return self._writer.flush(timeout)

    def get_many(self, keys: Sequence[BlockKey]) -> list[memoryview | None]:
        """Validated payloads (zero-copy views) or None for misses and bad values."""
        if not keys:
            return []
        names = [self._name(k) for k in keys]
        replies = self._channel.run(names, [[command(b"GET", n)] for n in names])
        out: list[memoryview | None] = []
        corrupt = hits = 0
        doomed: list[Doomed] = []
        for key, name, reply in zip(keys, names, replies, strict=True):
            if reply is None:
                out.append(None)
                continue
            if isinstance(reply, ResponseError) or not isinstance(reply, bytes | memoryview):
                corrupt += 1
                out.append(None)
                continue
            try:
                out.append(codec.decode(key, reply))
                hits += 1
            except codec.CorruptValue as exc:
                corrupt += 1
                log.debug("bad value at %s: %s", key.name, exc.reason)
                head, total = bytes(reply[:codec.HEADER_SIZE]), memoryview(reply).nbytes
                if exc.code == "bad_checksum" or _unservable(key, head, total):
                    doomed.append((name, head, total))
                out.append(None)
        self._count_reads(len(keys), hits, corrupt)
        self._delete_corrupt(doomed)
        return out

    def _count_reads(self, n: int, hits: int, corrupt: int, stale: int = 0) -> None:
        self._counts.add(gets=n, hits=hits, misses=n - hits, corrupt=corrupt, stale_saves=stale)

    def get(self, key: BlockKey) -> memoryview | None:
        return self.get_many([key])[0]

    def get_many_into(self, keys: Sequence[BlockKey], dests: Sequence[memoryview | np.ndarray],
                      *, save_ids: Sequence[int | None] | None = None) -> list[bool]:
        """Read each key's validated payload into ``dests[i]``; True = hit, dest filled.

        ``dests[i]`` is a writable, contiguous buffer of exactly the expected payload length
        (e.g. a CPU-tier slot row). Each reply is received straight into its dest and its
        header and checksum are checked there; no payload object is made. ``save_ids[i]``
        not None: a valid value of another save is a miss (``stale_saves``, not corrupt).
        False = miss, bad value, other save, other length or Redis trouble: the dest's
        contents are then undefined. Never raises for Redis trouble; a read-only or
        non-contiguous dest, or a length mismatch, is a ValueError.
        """
        if len(keys) != len(dests):
            raise ValueError(f"{len(keys)} keys but {len(dests)} destinations")
        if save_ids is not None and len(save_ids) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(save_ids)} save ids")
        if not keys:
            return []
        views = [_writable_u8(d) for d in dests]
        digests = _digests(keys)
        names = [self._name(k) for k in keys]
        wanted = save_ids if save_ids is not None else [None] * len(keys)

        def read(reader: Reader, i: int) -> bool | _Refused | ResponseError:
            return _read_into(reader, keys[i], views[i], digests[i], wanted[i])

        replies = self._channel.run(names, [[command(b"GET", n)] for n in names],
                            sizes=[v.nbytes + codec.HEADER_SIZE for v in views], read=read)
        out = [r is True for r in replies]
        corrupt = stale = 0
        doomed: list[Doomed] = []
        for key, name, reply in zip(keys, names, replies, strict=True):
            if isinstance(reply, _Refused) and reply.stale:
                stale += 1
            elif isinstance(reply, _Refused | ResponseError):
                corrupt += 1
                why = reply.reason if isinstance(reply, _Refused) else str(reply)
                log.debug("bad value at %s: %s", key.name, self._factory.scrub(why))
                if isinstance(reply, _Refused) and reply.judged is not None:
                    doomed.append((name, reply.judged, reply.total_len))
        self._count_reads(len(keys), sum(out), corrupt, stale)
        self._delete_corrupt(doomed)
        return out

    def exists_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Cheap presence check: the header (GETRANGE) and the length (STRLEN) validate."""
        return [s is not None for s in self.save_ids_many(keys)]

    def save_ids_many(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """Each key's stored save id (0: stored without one), or None when absent or invalid.

        The cheap probe: the header (``GETRANGE 0 63``) and the length (``STRLEN``) are
        validated against the key, the payload is not read. An invalid one is counted
        ``corrupt`` (and deleted while unchanged). Never raises for Redis trouble (None).
        """
        if not keys:
            return []
        names, cmds = [], []
        end = str(codec.HEADER_SIZE - 1).encode()
        for key in keys:
            name = self._name(key)
            names += [name, name]
            cmds += [[command(b"GETRANGE", name, b"0", end)], [command(b"STRLEN", name)]]
        replies = self._channel.run(names, cmds)
        out: list[int | None] = []
        corrupt = 0
        doomed: list[Doomed] = []
        for n, key in enumerate(keys):
            header, length = replies[2 * n], replies[2 * n + 1]
            save_id = None
            if isinstance(header, bytes | memoryview) and isinstance(length, int) and length > 0:
                try:
                    codec.check_header(key, header, total_len=length)
                    save_id = codec.parse_header(header).save_id
                except codec.CorruptValue:
                    corrupt += 1
                    if _unservable(key, header, length):
                        doomed.append((names[2 * n], bytes(header), length))
            elif isinstance(header, ResponseError):
                corrupt += 1
            out.append(save_id)
        self._counts.add(exists_checks=len(keys), corrupt=corrupt)
        self._delete_corrupt(doomed)
        return out

    def _delete_corrupt(self, doomed: Sequence[Doomed]) -> None:
        """Unlink each ``(name, first 64 bytes, length)`` while the value still has them.

        Best effort: a refusal, an error reply or Redis trouble is logged (debug) and counted,
        never raised; a value that changed (or went) since it was judged is kept.
        """
        if not doomed or not self.delete_corrupt or self._scripts_refused:
            return
        names = [name for name, _, _ in doomed]
        args = [(name, judged, b"%d" % total) for name, judged, total in doomed]
        replies = self._channel.run(names,
                                    [[command(b"EVALSHA", _LUA_SHA, b"1", *a)] for a in args])
        again = [i for i, r in enumerate(replies)
                 if isinstance(r, ResponseError) and str(r).startswith("NOSCRIPT")]
        if again:  # not cached on that server yet: send the script itself (it caches it)
            script = _LUA_UNLINK_IF_SAME.encode()
            retried = self._channel.run([names[i] for i in again],
                                [[command(b"EVAL", script, b"1", *args[i])] for i in again])
            for i, reply in zip(again, retried, strict=True):
                replies[i] = reply
        deleted = changed = failed = 0
        for name, reply in zip(names, replies, strict=True):
            if isinstance(reply, int):
                deleted += reply == 1
                changed += reply != 1
                continue
            failed += 1
            log.debug("could not delete corrupt value %r: %s", name,
                      self._factory.scrub(str(reply)) if reply is not None else "Redis trouble")
            if isinstance(reply, ResponseError) and _refuses_scripts(reply):
                self._scripts_refused = True
        self._counts.add(corrupt_deleted=deleted, corrupt_changed=changed,
                         corrupt_delete_failures=failed)
        if self._scripts_refused and failed:
            log.warning("Redis %s refuses scripts: corrupt values found by reads are left "
                        "for the janitor", self.target.redacted)

    def delete_many(self, keys: Sequence[BlockKey]) -> int:
        """Remove blocks; the number that existed."""
        if not keys:
            return 0
        names = [self._name(k) for k in keys]
        replies = self._channel.run(names, [[command(b"UNLINK", n)] for n in names])
        deleted = sum(r for r in replies if isinstance(r, int))
        self._counts.add(deletes=deleted)
        return deleted

    def counts(self) -> dict[str, int]:
        """The event counters alone (cheap enough to read every engine step)."""
        return self._counts.snapshot()

    @property
    def events_serial(self) -> int:
        """Moves whenever one of :data:`EVENT_COUNTS` does: a caller mirroring them reads
        :meth:`counts` only when it moved (one int read per engine step otherwise)."""
        return self._counts.serial

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = self._counts.snapshot()
        out.update(available=self.available, last_error=self.last_error,
                   noeviction=self.noeviction, cluster=self.target.cluster,
                   url=self.target.redacted, endpoints=self._channel.endpoints())
        out.update(queue_depth=self._writer.depth, queue_bytes=self._writer.queued_bytes,
                   queued=self._writer.submitted, dropped=self._writer.dropped,
                   written=self._writer.written, write_failed=self._writer.failed,
                   unwritten_at_close=self._writer.unwritten_at_close)
        return out

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (up to ``timeout``), stop the writer, close connections.
        What could not be written in time is counted (``unwritten_at_close``) and logged
        once; nothing here needs an executor, so it also works at interpreter exit."""
        if self._closed:
            return
        unwritten = self._writer.close(timeout)
        self._closed = True
        if unwritten:
            log.warning("Redis tier %s: %d queued writes not made before closing (the flush's "
                        "bound of %.1f s passed); those blocks are not in Redis",
                        self.target.redacted, unwritten, timeout)
        self._channel.close()

    def __enter__(self) -> RedisTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _digests(keys: Sequence[BlockKey]) -> list[bytes]:
    """Each key's namespace digest (parsed once per distinct fingerprint)."""
    seen: dict[str, bytes] = {}
    return [seen.get(k.fingerprint) or seen.setdefault(k.fingerprint, codec.namespace_digest(k))
            for k in keys]


def _read_into(reader: Reader, key: BlockKey, dest: memoryview, digest: bytes,
               save_id: int | None) -> bool | _Refused | ResponseError:
    """Read one GET reply: True = the payload is in ``dest`` and valid, False = no such key,
    a :class:`_Refused` = why the value was not served (its bytes consumed), or the server's
    error reply. Corruption is judged first; another save only of a valid value."""
    n = reader.bulk_len()
    if n is None or isinstance(n, ResponseError):
        return False if n is None else n
    if n < codec.HEADER_SIZE:
        short = bytes(reader.read_bytes(n))
        reader.crlf()
        return _Refused(f"truncated header ({n} < {codec.HEADER_SIZE} bytes)", short, n)
    header = bytes(reader.read_bytes(codec.HEADER_SIZE))
    try:
        length, csum = codec.check_header(key, header, total_len=n, digest=digest)
    except codec.CorruptValue as exc:
        proof = header if _unservable(key, header, n, digest) else None
        refused: _Refused | None = _Refused(exc.reason, proof, n)
    else:
        refused = None if length == dest.nbytes else _Refused(
            f"payload is {length} bytes, the destination {dest.nbytes}")
    if refused is not None:
        reader.skip(n - codec.HEADER_SIZE)
        reader.crlf()
        return refused
    reader.read_into(dest)
    reader.crlf()
    if codec.checksum(dest) != csum:
        return _Refused("payload checksum mismatch", header, n)
    try:
        codec.check_save_id(codec.parse_header(header), save_id)
    except codec.StaleSave as exc:
        return _Refused(str(exc), stale=True)
    return True


def _unservable(key: BlockKey, header: bytes, total_len: int, digest: bytes | None = None) -> bool:
    """No reader of ``key``'s Redis name can serve a value with this header and length (the
    janitor's verdict: any stored kind, any ``num_tokens`` but 0). A refusal for another kind
    or ``num_tokens`` alone proves nothing: a FULL and a PARTIAL key share one name."""
    try:
        codec.check_fields(header, digest=digest or codec.namespace_digest(key), group=key.group,
                           block_hash=key.block_hash, total_len=total_len)
    except codec.CorruptValue:
        return True
    return False


def _refuses_scripts(reply: ResponseError) -> bool:
    """The server does not run scripts for us (ACL, a managed service, scripting off)."""
    text = str(reply).lower()
    return any(t in text for t in ("noperm", "no permissions", "unknown command"))


def _writable_u8(dest: memoryview | np.ndarray) -> memoryview:
    """A flat writable byte view of ``dest`` (no copy); ValueError if it cannot be one."""
    view = memoryview(dest)
    if view.readonly:
        raise ValueError("destination buffer is read-only")
    if not view.c_contiguous:
        raise ValueError("destination buffer is not contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
