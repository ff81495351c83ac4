"""RESP over redis-py's connections: how a Redis tier's batches reach the server and back.

Rules this module keeps:

* It is the only module of the tier that touches redis-py's internals (the client, its
  connection pools, their sockets). redis-py makes and pools the connections (TLS, AUTH/ACL,
  HELLO, Cluster topology); the commands and replies of a batch travel as hand-packed RESP
  on the connection's socket (:mod:`offload_tiers.redis.resp`), and the batch's reader must
  end with nothing buffered, so the connection stays usable by redis-py.
* A batch is pipelined in a sliding window of at most ``max_inflight`` commands and
  ``max_inflight_bytes`` (one command may exceed it alone), topped up once half of it is
  answered, so the server always has queued work. Commands may be built as the window
  reaches them (:class:`LazyCommands`), so encoding overlaps the server.
* Cluster: a batch is split per master (``keyslot`` → ``nodes_manager``) and the node shares
  are served at once on a :class:`~offload_tiers.redis.node_pool.NodePool`. A MOVED, ASK,
  CLUSTERDOWN or TRYAGAIN reply is handed back as it is and has the topology read again
  before the next batch.
* Failure model: every network wait is bounded by the client's timeout; any failure marks
  the endpoint (the server, or one node) unavailable, after which batches touching it return
  at once (``None`` per command, counted ``skipped_unavailable``) until :meth:`RedisChannel.
  probe` (exponential backoff with jitter, :class:`~offload_tiers.redis.client.Health`) finds
  it answering again. Nothing here raises for Redis trouble; error texts never contain the
  password. A per-command error reply is a value (``ResponseError``), not a failure.
* Each endpoint's ``maxmemory-policy`` is read once it answers; ``noeviction`` is warned
  about once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from redis import ConnectionPool, Redis
from redis.exceptions import ResponseError

from offload_tiers.redis.client import ClientFactory, Health, close_quietly
from offload_tiers.redis.counters import Counters
from offload_tiers.redis.kernel_wait import kernel_wait
from offload_tiers.redis.node_pool import NodePool
from offload_tiers.redis.resp import Packer, ProtocolError, Reader, command, send_all
from offload_tiers.redis.url import RedisTarget

if TYPE_CHECKING:
    import socket

    from redis.cluster import ClusterNode, RedisCluster

__all__ = ["LazyCommands", "ReadReply", "RedisChannel"]

log = logging.getLogger(__name__)

_MOVED = ("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN")
_NODE_THREADS = 8  # Cluster nodes exchanged with at once

#: Reads the reply to command ``i`` of a batch from the reader (default: the whole reply).
ReadReply = Callable[[Reader, int], Any]
#: One Cluster node's share of a batch: (node name, (node, the batch's indices)).
NodeJob = tuple[str, tuple["ClusterNode", list[int]]]


class LazyCommands(Sequence[list]):
    """``n`` commands, each built when the pipeline first asks for it."""

    __slots__ = ("_n", "_build")

    def __init__(self, n: int, build: Callable[[int], list]) -> None:
        self._n = n
        self._build = build

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> list:  # type: ignore[override]
        if not 0 <= i < self._n:
            raise IndexError(i)
        return self._build(i)


def _whole_reply(reader: Reader, _i: int) -> Any:
    return reader.reply()


def _reindexed(read: ReadReply, idx: list[int]) -> ReadReply:
    """``read`` for a per-node sub-batch: its i-th command is the batch's ``idx[i]``-th."""
    return lambda reader, i: read(reader, idx[i])


class _Endpoint(Health):
    """A server (``main``) or Cluster node, and whether its memory policy was read."""

    __slots__ = ("policy_checked",)

    def __init__(self, label: str, initial_s: float, max_s: float) -> None:
        super().__init__(label, initial_s, max_s)
        self.policy_checked = False


class RedisChannel:
    """Pipelined RESP batches to one Redis deployment (a server, or a Cluster's masters).

    ``counts`` receives ``errors``, ``unavailable_events``, ``recoveries`` and
    ``skipped_unavailable``.
    """

    def __init__(self, factory: ClientFactory, counts: Counters, *, max_inflight: int = 64,
                 max_inflight_bytes: int = 64 << 20, backoff_initial_s: float = 0.1,
                 backoff_max_s: float = 5.0) -> None:
        if max_inflight < 1:
            raise ValueError("max_inflight must be at least 1")
        self.target: RedisTarget = factory.target
        self.max_inflight = max_inflight
        self.max_inflight_bytes = max_inflight_bytes
        self._factory = factory
        self._counts = counts
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._client: Redis | RedisCluster | None = None
        # Cluster: nodes served at once, on threads that outlive interpreter shutdown's
        # refusal of new futures (the last flush runs then: node_pool.py)
        self._nodes_pool: NodePool | None = NodePool(_NODE_THREADS) if self.target.cluster \
            else None
        self._lock = threading.Lock()
        self._init_ep = _Endpoint(self.target.redacted, *self._backoff)
        self._eps: dict[str, _Endpoint] = {}
        self._topology_stale = False
        self._closed = False
        self._last_error = ""
        self._warned_policy = False
        self.noeviction = False

    # ------------------------------------------------------------------ client
    def _get_client(self) -> Redis | RedisCluster | None:
        if self._client is None and not self._closed:
            if self._init_ep.waiting(time.monotonic()):
                return None
            try:
                client = self._factory.make()
            except Exception as exc:
                self._mark_failed(self._init_ep, exc)
                return None
            with self._lock:
                if self._client is None:
                    self._client = client
            self._mark_ok(self._init_ep)  # after a failed start: a recovery, counted
        return self._client

    def close(self) -> None:
        """Stop the node threads and close the connections (a later batch gets nothing)."""
        self._closed = True
        if self._nodes_pool is not None:
            self._nodes_pool.close()
        client, self._client = self._client, None
        close_quietly(client)

    # ------------------------------------------------------------------ health
    @property
    def available(self) -> bool:
        """True when the last contact with every known endpoint succeeded."""
        return (self._client is not None and self._init_ep.available
                and all(ep.available for ep in self._eps.values()))

    @property
    def last_error(self) -> str:
        return self._last_error

    def endpoints(self) -> dict[str, bool]:
        """Each known endpoint's label and whether it is available."""
        with self._lock:
            return {ep.label: ep.available for ep in self._eps.values()}

    def accepting(self) -> bool:
        """Worth queueing work for? (A Cluster with one node down still takes the others'.)"""
        if self._closed or self._client is None:
            return False
        if not self._init_ep.available:  # a topology refresh failed: retry once it is due
            return self._init_ep.due(time.monotonic())
        if self.target.cluster:
            return any(ep.available for ep in self._eps.values())
        return self.available

    def _endpoint(self, label: str) -> _Endpoint:
        ep = self._eps.get(label)
        if ep is None:
            with self._lock:
                ep = self._eps.setdefault(label, _Endpoint(label, *self._backoff))
        return ep

    def _mark_failed(self, ep: _Endpoint, exc: BaseException) -> None:
        text = self._factory.describe(exc)
        with self._lock:
            was_up = ep.failed(time.monotonic())
            self._last_error = text
        self._counts.add(errors=1, unavailable_events=int(was_up))
        if was_up:
            log.warning("Redis tier %s (%s) unavailable: %s; reads miss and writes drop "
                        "until it answers again", ep.label, self.target.redacted, text)

    def _mark_ok(self, ep: _Endpoint) -> None:
        if ep.available:
            return
        with self._lock:
            recovered = ep.recovered()
        self._counts.add(recoveries=int(recovered))
        if recovered:
            log.warning("Redis tier %s (%s) answers again", ep.label, self.target.redacted)

    def probe(self, force: bool = False) -> None:
        """Health check (``force``: every endpoint now): reconnect the endpoints whose
        backoff expired, read each answering endpoint's memory policy once."""
        client = self._get_client()
        if client is None:
            return
        now = time.monotonic()
        try:
            pools = self._pools(client)
        except Exception as exc:  # cluster topology unavailable
            self._mark_failed(self._init_ep, exc)
            return
        for label, pool in pools:
            ep = self._endpoint(label)
            if force or ep.due(now):
                self._ping(ep, pool)
            if ep.available and not ep.policy_checked:
                ep.policy_checked = True
                self._check_policy(pool, ep)
        if self.target.cluster:  # forget nodes that left the cluster
            current = {label for label, _ in pools}
            with self._lock:
                for label in [x for x in self._eps if x not in current]:
                    del self._eps[label]

    def _ping(self, ep: _Endpoint, pool: ConnectionPool) -> None:
        responses = self._exchange(ep, pool, [[command(b"PING")]], probe=True)
        if responses is not None:
            self._mark_ok(ep)

    def _check_policy(self, pool: ConnectionPool, ep: _Endpoint) -> None:
        responses = self._exchange(ep, pool, [[command(b"CONFIG", b"GET", b"maxmemory-policy")]])
        reply = responses[0] if responses else None
        if isinstance(reply, dict):  # RESP3 map
            policy = reply.get(b"maxmemory-policy")
        elif isinstance(reply, list) and len(reply) >= 2:  # RESP2 pair
            policy = reply[1]
        else:
            return  # CONFIG not permitted (ACL, managed Redis): nothing to say
        if policy == b"noeviction":
            self.noeviction = True
            if not self._warned_policy:
                self._warned_policy = True
                log.warning("Redis %s has maxmemory-policy noeviction: once full, every store "
                            "fails; use allkeys-lru (or volatile-lru with ttl_s)", ep.label)

    def _pools(self, client: Redis | RedisCluster) -> list[tuple[str, ConnectionPool]]:
        if not self.target.cluster:
            return [("main", client.connection_pool)]
        return [(node.name, client.get_redis_connection(node).connection_pool)
                for node in client.get_primaries()]

    # ------------------------------------------------------------------ batches
    def run(self, names: Sequence[bytes], cmds: Sequence[list], *,
            sizes: Sequence[int] | None = None, read: ReadReply | None = None) -> list[Any]:
        """One reply per command (None where its endpoint failed), batched per node.

        ``names[i]``: the key command ``i`` touches (it picks the Cluster node). ``sizes``:
        the bytes each command moves (default: its size). ``read(reader, i)`` reads reply
        ``i`` (default: the whole reply as a value).
        """
        replies: list[Any] = [None] * len(cmds)
        client = self._get_client()
        if client is None or not cmds:
            return replies
        if not self.target.cluster:
            got = self._exchange(self._endpoint("main"), client.connection_pool, cmds,
                                 sizes=sizes, read=read)
            return got if got is not None else replies
        jobs = self._node_jobs(client, names)
        if not jobs:
            return replies
        if len(jobs) == 1:
            results = [self._node_exchange(client, jobs[0], cmds, sizes, read)]
        else:  # every node at once: each serves its share while the others do
            results = list(self._node_pool().map(
                lambda job: self._node_exchange(client, job, cmds, sizes, read), jobs))
        for (_label, (_node, idx)), got in zip(jobs, results, strict=True):
            if got is None:
                continue
            for i, reply in zip(idx, got, strict=True):
                if isinstance(reply, ResponseError) and str(reply).startswith(_MOVED):
                    self._topology_stale = True
                replies[i] = reply
        return replies

    def _node_jobs(self, client: RedisCluster, names: Sequence[bytes]) -> list[NodeJob]:
        """The batch split per master (the topology read again first where it went stale);
        empty when the Cluster cannot be reached now."""
        if self._topology_stale or not self._init_ep.available:
            if self._init_ep.waiting(time.monotonic()):
                return []
            try:
                client.nodes_manager.initialize()
            except Exception as exc:
                self._topology_stale = True
                self._mark_failed(self._init_ep, exc)
                return []
            self._topology_stale = False
            self._mark_ok(self._init_ep)
        groups: dict[str, tuple[ClusterNode, list[int]]] = {}
        try:
            for i, name in enumerate(names):
                node = client.nodes_manager.get_node_from_slot(client.keyslot(name))
                groups.setdefault(node.name, (node, []))[1].append(i)
        except Exception as exc:  # slots not covered (cluster down)
            self._topology_stale = True
            self._mark_failed(self._init_ep, exc)
            return []
        return list(groups.items())

    def _node_exchange(self, client: RedisCluster, job: NodeJob, cmds: Sequence[list],
                       sizes: Sequence[int] | None, read: ReadReply | None) -> list[Any] | None:
        """One Cluster node's share of a batch."""
        label, (node, idx) = job
        ep = self._endpoint(label)
        try:
            pool = client.get_redis_connection(node).connection_pool
        except Exception as exc:
            self._mark_failed(ep, exc)
            return None
        return self._exchange(ep, pool, LazyCommands(len(idx), lambda j: cmds[idx[j]]),
                              sizes=None if sizes is None else [sizes[i] for i in idx],
                              read=None if read is None else _reindexed(read, idx))

    def _node_pool(self) -> NodePool:
        with self._lock:
            if self._nodes_pool is None:
                self._nodes_pool = NodePool(_NODE_THREADS)
            return self._nodes_pool

    def _exchange(self, ep: _Endpoint, pool: ConnectionPool, cmds: Sequence[list], *,
                  sizes: Sequence[int] | None = None, read: ReadReply | None = None,
                  probe: bool = False) -> list[Any] | None:
        """Send ``cmds`` pipelined (bounded in flight) on one of ``pool``'s connections;
        their replies, or None on failure (the endpoint is then marked unavailable)."""
        if not probe and not ep.available:
            self._counts.add(skipped_unavailable=len(cmds))
            return None
        conn = None
        try:
            conn = pool.get_connection()
            sock = conn._sock
            if sock is None:
                raise ConnectionError("redis-py returned an unconnected connection")
            if sizes is None:
                sizes = [sum(memoryview(part).nbytes for part in c) for c in cmds]
            with kernel_wait(sock) as payload_flags:
                reader = Reader(sock, payload_flags)
                out = self._pipeline(sock, reader, cmds, sizes, read or _whole_reply)
            if not reader.drained():
                raise ProtocolError("bytes beyond the last reply")
            return out
        except Exception as exc:  # timeouts, resets, refused, auth, protocol: all the same
            if conn is not None:
                conn.disconnect()
            try:
                pool.disconnect(inuse_connections=False)
            except Exception:
                log.debug("pool disconnect failed", exc_info=True)
            self._mark_failed(ep, exc)
            return None
        finally:
            if conn is not None:
                pool.release(conn)

    def _pipeline(self, sock: socket.socket, reader: Reader, cmds: Sequence[list],
                  sizes: Sequence[int], read: ReadReply) -> list[Any]:
        """A sliding window: at most ``max_inflight`` commands and ``max_inflight_bytes``
        (one command may exceed it alone) in flight; topped up once half of it is answered,
        so the server always has queued work while replies are read."""
        n = len(cmds)
        out: list[Any] = [None] * n
        cap_n, cap_b = self.max_inflight, self.max_inflight_bytes
        sent = done = inflight = 0
        while done < n:
            if sent < n and (sent == done or (sent - done <= cap_n // 2
                                              and inflight <= cap_b // 2)):
                packer = Packer()
                while sent < n and sent - done < cap_n and (
                        sent == done or inflight + sizes[sent] <= cap_b):
                    packer.add(cmds[sent])
                    inflight += sizes[sent]
                    sent += 1
                send_all(sock, packer.finish())
            out[done] = read(reader, done)
            inflight -= sizes[done]
            done += 1
        return out
