"""The Redis janitor: removes values under the daemon's prefix that no reader can ever serve.

A pass walks ``{prefix}:*`` with ``SCAN`` (bounded ``COUNT``, paced to at most
``max_keys_per_s`` keys examined per second), reads only each value's 64-byte header and its
length (``GETRANGE 0 63`` + ``STRLEN``, pipelined) and deletes what a reader would reject
whatever it asked for (the readers' own :func:`offload_tiers.codec.check_fields`): key names
that :func:`offload_tiers.keys.parse_key_name` refuses (the presence feed's announcement
stream excepted), non-string values, short values, bad
magic, unknown format version, a kind that is neither FULL nor PARTIAL, header fingerprint /
group / hash tag contradicting the key name, ``num_tokens`` 0, a length that disagrees with
the header — and, only when ``allowed_fingerprints`` is set, values of namespaces not in
that list.

Deletes are conditional: a fixed Lua script deletes a key only if its type, length and
header are still the ones judged (the verdict depends on nothing else), so a concurrent
writer that replaced a bad value with a good one is never deleted. Nothing read from Redis
is evaluated. Redis being down is counted and backed off (:mod:`offload_tiers.redis.client`);
the janitor never raises into the daemon and never logs the password.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.exceptions import NoPermissionError, ResponseError, WatchError

from offload_tiers import codec
from offload_tiers.keys import KeyName, parse_key_name
from offload_tiers.redis.client import ClientFactory, Health, close_quietly
from offload_tiers.redis.presence_feed import is_announce_stream
from offload_tiers.redis.url import RedisTarget, parse_redis_url
from offload_tiers.thread_names import name_current_thread

__all__ = ["REASONS", "JanitorCounters", "Pacer", "RedisJanitor", "judge"]

log = logging.getLogger("kvtier.daemon.janitor")

#: Why a value was deleted (label values of ``kvtier_daemon_janitor_deleted_total``).
REASONS = ("bad_key_name", "wrong_type", *codec.HEADER_PROBLEMS, "retired_namespace")

# Delete KEYS[1] only if it is still what was judged. ARGV[1] = "s" (a string value whose
# length was ARGV[3] and first 64 bytes ARGV[2]) or "n" (a non-string value).
_LUA_DELETE_IF_SAME = """
local t = redis.call('TYPE', KEYS[1])['ok']
if ARGV[1] == 'n' then
  if t ~= 'string' and t ~= 'none' then return redis.call('UNLINK', KEYS[1]) end
  return 0
end
if t ~= 'string' then return 0 end
if redis.call('STRLEN', KEYS[1]) ~= tonumber(ARGV[3]) then return 0 end
if redis.call('GETRANGE', KEYS[1], 0, 63) ~= ARGV[2] then return 0 end
return redis.call('UNLINK', KEYS[1])
"""


def is_nested_prefix(rest: bytes) -> bool:
    """``rest`` is ``{more}:{fp}:{group}:{hash}``: a key of a deployment whose prefix extends
    ours (``kvtier:a`` under ``kvtier``) — not ours to judge."""
    parts = rest.split(b":")
    return len(parts) > 3 and parse_key_name(b":".join(parts[-3:])) is not None


def judge(name: KeyName, header: bytes, total_len: int,
          allowed: frozenset[bytes] | None = None) -> str | None:
    """Why no reader can ever serve this value (a :data:`REASONS` entry), or None if one may.

    The reader's own header check (:func:`codec.check_fields`) with what the key name says
    and any stored kind and ``num_tokens``: it condemns exactly the values that every reader
    of this name refuses. Depends only on the key name, the first 64 bytes and the length —
    exactly what the conditional delete re-checks.
    """
    try:
        codec.check_fields(header, digest=name.digest, group=name.group,
                           block_hash=name.block_hash, total_len=total_len)
    except codec.CorruptValue as exc:
        return exc.code
    if allowed is not None and name.digest not in allowed:
        return "retired_namespace"
    return None


class Pacer:
    """Token pacing: work of ``n`` units starts only once the work before it fits in
    ``rate`` units per second (so any interval sees at most ``rate * t + one batch``)."""

    def __init__(self, rate: float, clock: Callable[[], float],
                 sleep: Callable[[float], Any]) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate}")
        self.rate = rate
        self._clock = clock
        self._sleep = sleep
        self._next: float | None = None

    def spend(self, n: int) -> None:
        now = self._clock()
        if self._next is not None and self._next > now:
            self._sleep(self._next - now)
            now = self._clock()
        start = now if self._next is None else max(self._next, now)
        self._next = start + n / self.rate

    def reset(self) -> None:
        """Forget the debt (after an idle wait, nothing is owed)."""
        self._next = None


@dataclass
class JanitorCounters:
    """Plain ints, written by the janitor thread, read at scrape time."""

    passes: int = 0
    passes_failed: int = 0
    sweeps: int = 0  # full walks of the keyspace completed
    scan_calls: int = 0
    keys_examined_budget: int = 0  # SCAN COUNT charged against max_keys_per_s
    keys_scanned: int = 0
    bytes_seen: int = 0
    errors: int = 0
    unavailable_events: int = 0
    recoveries: int = 0
    changed_before_delete: int = 0  # judged bad, but no longer the same value: kept
    vanished: int = 0  # gone (deleted, expired) between SCAN and the delete
    nested_prefix_skipped: int = 0
    last_pass_keys: int = 0
    last_pass_seconds: float = 0.0
    last_pass_end: float = 0.0


@dataclass(frozen=True, slots=True)
class _Doomed:
    """A key judged unservable, with what the conditional delete must find unchanged."""

    key: bytes
    reason: str
    mode: str  # "s": string (header, length); "n": non-string; "name": unparseable name
    header: bytes
    length: int


class _Unavailable(Exception):
    """Redis failed during a pass (already counted)."""


class _ScriptsRefused(Exception):
    """EVAL/EVALSHA/SCRIPT are not permitted (ACL or a managed service)."""


def _refuses_scripts(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, NoPermissionError) or any(
        t in text for t in ("noperm", "no permissions", "unknown command"))


class RedisJanitor:
    """Periodic, paced, conditional clean-up of one prefix. ``start()`` / ``stop()``."""

    def __init__(self, url: str, prefix: str = "kvtier", *, interval_s: float = 300.0,
                 scan_count: int = 100, max_keys_per_s: float = 2000.0,
                 max_keys_per_pass: int = 0, allowed_fingerprints: Iterable[str] | None = None,
                 dry_run: bool = False, redis_timeout_s: float = 2.0,
                 backoff_initial_s: float = 1.0, ssl_ca_certs: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Any] | None = None,
                 redis_kwargs: dict[str, Any] | None = None) -> None:
        if not prefix:
            raise ValueError("prefix must not be empty")
        if scan_count < 1 or max_keys_per_pass < 0 or interval_s <= 0:
            raise ValueError("scan_count >= 1, max_keys_per_pass >= 0, interval_s > 0")
        self.target: RedisTarget = parse_redis_url(url)
        self._factory = ClientFactory(self.target, timeout_s=redis_timeout_s,
                                      ssl_ca_certs=ssl_ca_certs, **(redis_kwargs or {}))
        self.prefix = prefix
        self._prefix_colon = prefix.encode() + b":"
        self.pattern = _glob_escape(self._prefix_colon) + b"*"
        self.interval_s = interval_s
        self.scan_count = scan_count
        self.max_keys_per_pass = max_keys_per_pass
        self.allowed = (None if allowed_fingerprints is None
                        else frozenset(bytes.fromhex(f) for f in allowed_fingerprints))
        self.dry_run = dry_run
        self.use_watch = False  # set when the server refuses scripts
        # a failed pass is retried after a backoff that doubles up to one interval
        self._health = Health(self.target.redacted, backoff_initial_s, interval_s)
        self._stop = threading.Event()
        self._clock = clock
        self._sleep = sleep or self._stop.wait
        self.pacer = Pacer(max_keys_per_s, clock, self._sleep)
        self.counters = JanitorCounters()
        self.deleted = dict.fromkeys(REASONS, 0)
        self.would_delete = dict.fromkeys(REASONS, 0)
        self.last_error = ""
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # where a pass cut short by max_keys_per_pass stopped: node, cursor, carried keys,
        # whether that node's SCAN has started
        self._resume: tuple[str, int, list[bytes], bool] | None = None
        self._pass_keys = 0
        self._client: Any = None
        self._scripts: dict[str, Any] = {}

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        log.info("redis janitor: %s prefix %r every %.0f s, at most %.0f keys/s%s",
                 self.target.redacted, self.prefix, self.interval_s, self.pacer.rate,
                 " (dry run)" if self.dry_run else "")
        self._thread = threading.Thread(target=self._loop, name="kvtier-redis-janitor",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        client, self._client = self._client, None
        close_quietly(client)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def available(self) -> bool:
        """True when the last contact with Redis succeeded."""
        return self._health.available

    def _loop(self) -> None:
        name_current_thread()
        while not self._stop.is_set():
            ok = self.run_pass()
            if ok:
                wait = self.interval_s
            else:
                wait = min(max(self._health.next_try - self._clock(), 0.0), self.interval_s)
            if self._stop.wait(wait):
                return
            self.pacer.reset()

    # ------------------------------------------------------------------ one pass
    def run_pass(self) -> bool:
        """One pass (the whole keyspace, or ``max_keys_per_pass`` keys). False if Redis failed.

        Never raises: every failure is counted and reflected in ``available``. Not reentrant:
        the background thread calls it; call it directly only when the thread is not running.
        """
        started = self._clock()
        self._pass_keys = 0
        with self._lock:
            before = dict(self.deleted if not self.dry_run else self.would_delete)
        try:
            finished = self._walk()
        except _Unavailable:
            with self._lock:
                self.counters.passes_failed += 1
            return False
        except Exception as exc:  # a bug must not kill the daemon: count it, say it
            self._failed(exc)
            log.error("redis janitor pass failed: %s",
                      self._factory.scrub(traceback.format_exc()))
            with self._lock:
                self.counters.passes_failed += 1
            return False
        with self._lock:
            c = self.counters
            c.passes += 1
            c.sweeps += finished
            c.last_pass_keys = self._pass_keys
            c.last_pass_seconds = self._clock() - started
            c.last_pass_end = time.time()
            now = self.deleted if not self.dry_run else self.would_delete
            gone = {r: n - before[r] for r, n in now.items() if n != before[r]}
        self._ok()
        if gone:
            log.info("redis janitor: %s %d value(s) under %r: %s",
                     "would delete" if self.dry_run else "deleted", sum(gone.values()),
                     self.prefix, ", ".join(f"{r}={n}" for r, n in sorted(gone.items())))
        return True

    def _walk(self) -> bool:
        """Scan on from where the last pass stopped; True when a full sweep completed."""
        nodes = self._nodes()
        labels = [label for label, _ in nodes]
        i, cursor, carry, started = 0, 0, [], False
        if self._resume is not None and self._resume[0] in labels:
            label, cursor, carry, started = self._resume
            i = labels.index(label)
        self._resume = None
        while i < len(nodes):
            label, node = nodes[i]
            if carry:
                batch, carry = self._take(carry)
                if batch:
                    self._process(label, node, batch)
            node_done = started and cursor == 0 and not carry
            if node_done:
                i, cursor, started = i + 1, 0, False
                continue
            if carry or self._budget_left() == 0 or self._stop.is_set():
                self._resume = (label, cursor, carry, started)
                return False
            self.pacer.spend(self.scan_count)
            cursor, keys = self._call(lambda n=node, c=cursor: n.scan(
                c, match=self.pattern, count=self.scan_count))
            started = True
            with self._lock:
                self.counters.scan_calls += 1
                self.counters.keys_examined_budget += self.scan_count
            carry = list(keys)
        return True

    def _budget_left(self) -> int | None:
        if not self.max_keys_per_pass:
            return None
        return max(0, self.max_keys_per_pass - self._pass_keys)

    def _take(self, keys: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        left = self._budget_left()
        if left is None:
            return keys, []
        return keys[:left], keys[left:]

    def _process(self, label: str, node: Any, keys: Sequence[bytes]) -> None:
        """Judge one SCAN batch and delete what can never be served."""
        self._pass_keys += len(keys)
        plen = len(self._prefix_colon)
        named: list[tuple[bytes, KeyName]] = []
        doomed: list[_Doomed] = []
        nested = 0
        for key in keys:
            if not key.startswith(self._prefix_colon):
                continue  # SCAN MATCH already filters; never judge outside the prefix
            rest = key[plen:]
            parsed = parse_key_name(rest)
            if parsed is not None:
                named.append((key, parsed))
            elif is_nested_prefix(rest):
                nested += 1
            elif is_announce_stream(rest):
                continue  # the presence feed's stream (offload_tiers/redis/presence_feed.py)
            else:
                doomed.append(_Doomed(key, "bad_key_name", "name", b"", 0))
        replies = self._pipeline(node, [(("GETRANGE", k, 0, codec.HEADER_SIZE - 1),
                                         ("STRLEN", k)) for k, _ in named])
        seen_bytes = 0
        for (key, parsed), (header, length) in zip(named, _pairs(replies), strict=True):
            if isinstance(header, ResponseError):
                if str(header).startswith("WRONGTYPE"):
                    doomed.append(_Doomed(key, "wrong_type", "n", b"", 0))
                    continue
                self._failed(header)
                raise _Unavailable
            if not isinstance(header, bytes) or not isinstance(length, int):
                self._failed(RuntimeError(f"unexpected reply type {type(header).__name__}"))
                raise _Unavailable
            seen_bytes += length
            reason = judge(parsed, header, length, self.allowed)
            if reason is not None:
                doomed.append(_Doomed(key, reason, "s", header, length))
        done = self._delete(label, node, doomed) if doomed else []
        with self._lock:
            c = self.counters
            c.keys_scanned += len(keys)
            c.bytes_seen += seen_bytes
            c.nested_prefix_skipped += nested
            for d, ok in zip(doomed, done, strict=True):
                if self.dry_run:
                    self.would_delete[d.reason] += 1
                elif ok:
                    self.deleted[d.reason] += 1
                elif d.mode == "s" and d.length == 0:
                    c.vanished += 1  # GETRANGE/STRLEN of a missing key look like ""
                else:
                    c.changed_before_delete += 1

    def _delete(self, label: str, node: Any, doomed: list[_Doomed]) -> list[bool]:
        """Delete each doomed key if it is still what was judged; one flag per key."""
        if self.dry_run:
            return [False] * len(doomed)
        if not self.use_watch:
            try:
                return self._delete_lua(label, node, doomed)
            except _ScriptsRefused as exc:
                self.use_watch = True
                log.warning("redis janitor: scripts refused (%s); deleting with WATCH/MULTI "
                            "instead (one round trip per key)", self._factory.scrub(str(exc)))
        return [self._call(lambda d=d: self._delete_watched(node, d)) for d in doomed]

    def _delete_lua(self, label: str, node: Any, doomed: list[_Doomed]) -> list[bool]:
        script = self._script(label, node)
        pipe = node.pipeline(transaction=False)
        for d in doomed:
            if d.mode == "name":  # a name no writer produces: whatever it holds is garbage
                pipe.unlink(d.key)
            else:
                script(keys=[d.key], args=[d.mode, d.header, d.length], client=pipe)

        def run() -> list[Any]:
            try:
                return pipe.execute(raise_on_error=False)
            except ResponseError as exc:  # SCRIPT EXISTS/LOAD refused (ACL, managed Redis)
                if _refuses_scripts(exc):
                    raise _ScriptsRefused(str(exc)) from None
                raise

        out = []
        for r in self._call(run):
            if isinstance(r, ResponseError):
                if _refuses_scripts(r):
                    raise _ScriptsRefused(str(r))  # nothing was deleted by a refused EVALSHA
                self._failed(r)
                raise _Unavailable
            out.append(bool(r))
        return out

    @staticmethod
    def _delete_watched(node: Any, d: _Doomed) -> bool:
        """The same condition as the Lua script, as WATCH / check / MULTI UNLINK EXEC."""
        with node.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(d.key)
                if d.mode != "name":
                    kind = pipe.type(d.key)
                    kind = kind.decode() if isinstance(kind, bytes) else kind
                    if d.mode == "n":
                        same = kind not in ("string", "none")
                    else:
                        same = (kind == "string" and pipe.strlen(d.key) == d.length
                                and pipe.getrange(d.key, 0, codec.HEADER_SIZE - 1) == d.header)
                    if not same:
                        pipe.unwatch()
                        return False
                pipe.multi()
                pipe.unlink(d.key)
                return bool(pipe.execute()[0])
            except WatchError:
                return False  # written meanwhile: judged again next pass

    # ------------------------------------------------------------------ Redis plumbing
    def _get_client(self) -> Any:
        if self._client is None:
            self._client = self._factory.make()
        return self._client

    def _nodes(self) -> list[tuple[str, Any]]:
        client = self._call(self._get_client)
        if not self.target.cluster:
            return [("main", client)]
        return self._call(lambda: [(n.name, client.get_redis_connection(n))
                                   for n in client.get_primaries()])

    def _script(self, label: str, node: Any) -> Any:
        script = self._scripts.get(label)
        if script is None:
            script = self._scripts[label] = node.register_script(_LUA_DELETE_IF_SAME)
        return script

    def _pipeline(self, node: Any, groups: list[tuple[tuple[Any, ...], ...]]) -> list[Any]:
        if not groups:
            return []
        pipe = node.pipeline(transaction=False)
        for group in groups:
            for cmd in group:
                pipe.execute_command(*cmd)
        return self._call(lambda: pipe.execute(raise_on_error=False))

    def _call(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)
            if self._client is not None and not self.target.cluster:
                try:
                    self._client.connection_pool.disconnect()
                except Exception:
                    log.debug("pool disconnect failed", exc_info=True)
            if self.target.cluster:  # topology may have changed: start over next pass
                client, self._client, self._scripts = self._client, None, {}
                close_quietly(client)
            raise _Unavailable from None

    def _failed(self, exc: BaseException) -> None:
        text = self._factory.describe(exc)
        with self._lock:
            was_up = self._health.failed(self._clock())
            self.last_error = text
            self.counters.errors += 1
            if was_up:
                self.counters.unavailable_events += 1
        if was_up:
            log.warning("redis janitor: %s unavailable (%s); retrying with backoff",
                        self.target.redacted, text)

    def _ok(self) -> None:
        with self._lock:
            recovered = self._health.recovered()
            self.counters.recoveries += recovered
        if recovered:
            log.warning("redis janitor: %s answers again", self.target.redacted)

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(vars(self.counters))
            out.update(
                url=self.target.redacted, prefix=self.prefix, available=self.available,
                last_error=self.last_error, dry_run=self.dry_run,
                delete_method="watch" if self.use_watch else "lua",
                interval_s=self.interval_s, max_keys_per_s=self.pacer.rate,
                max_keys_per_pass=self.max_keys_per_pass,
                deleted={k: v for k, v in self.deleted.items() if v},
                deleted_total=sum(self.deleted.values()),
                would_delete={k: v for k, v in self.would_delete.items() if v},
            )
        return out


def _pairs(replies: list[Any]) -> Iterable[tuple[Any, Any]]:
    it = iter(replies)
    return zip(it, it, strict=True)


def _glob_escape(raw: bytes) -> bytes:
    """Escape SCAN MATCH metacharacters so the prefix matches literally."""
    return re.sub(rb"([*?\[\]\\])", rb"\\\1", raw)
