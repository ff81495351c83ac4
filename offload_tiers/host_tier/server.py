"""The daemon's side of the host tier: the segment, the directory, and a Unix socket.

One thread runs a ``selectors`` loop over the listening socket and every client
connection; it alone touches the directory (under ``lock``, which ``stats`` also takes).

A client's leases and pins are released when its *process* is gone, not when its
connection is: the daemon opens a pidfd for the peer (``SO_PEERCRED``) at accept, and a
closed connection whose process still runs keeps its leased slots and pins quarantined
until that process exits. A live process may still be copying into a slot it leased, and
a slot re-leased under it could be committed with its bytes mixed in (with a checksum
over the mix). A killed engine's half-written slots are invalidated once it is gone:
never served; its pins never hold a slot forever.

The segment, the pin table and the socket are created 0600, then given ``group`` and
``mode`` (0600: only the daemon's user; 0660 with ``group`` for a group), in a socket
directory the daemon owns alone (:mod:`offload_tiers.host_tier.trust`). A run locks its
name and its socket for its lifetime; a file of the same name left by an earlier run is
replaced (a new run starts with an empty tier), and a stop removes only the files its own
run created (:mod:`offload_tiers.host_tier.run_files`).

Given a Redis tier (``redis``), the daemon also writes commits behind to Redis and restores
from it for its clients (:mod:`offload_tiers.host_tier.redis_service`): its threads do the
Redis I/O and ``post`` their replies back to this loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import selectors
import socket
import stat
import struct
import threading
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from offload_tiers.codec import validate_key
from offload_tiers.host_tier.directory import HostDirectory, Location
from offload_tiers.host_tier.pins import PinTable
from offload_tiers.host_tier.protocol import (
    PROTOCOL_VERSION,
    Abandon,
    Bye,
    Changes,
    Commit,
    Committed,
    EntryTuple,
    Hello,
    KeyTuple,
    Lease,
    Leased,
    Presence,
    Probe,
    Probed,
    ProtocolError,
    Refused,
    Restore,
    Restored,
    ToClient,
    Touch,
    Welcome,
    decode_to_daemon,
    frame,
    split_frames,
)
from offload_tiers.host_tier.redis_service import HostTierRedisService, RestoreItem, WriteItem
from offload_tiers.host_tier.run_files import RunFiles, RunLock, share_file
from offload_tiers.host_tier.trust import address_of, mapped_file, prepare_socket_dir
from offload_tiers.keys import BlockKey, BlockKind
from offload_tiers.shared_segment import DIGEST_BYTES, SharedSegment, default_path

if TYPE_CHECKING:  # redis-py is imported only where Redis is configured
    from offload_tiers.redis.presence_feed import PresenceFeed
    from offload_tiers.redis.tier import RedisTier

log = logging.getLogger("kvtier.host_tier")

#: Most slots one Lease may ask for.
MAX_LEASE = 4096
#: A client whose unread replies exceed this is disconnected (it reconnects and resyncs).
MAX_BACKLOG = 64 * 1024 * 1024
#: A subscriber's snapshot goes out this many entries at a time, the next chunk once the
#: connection has taken the last (live updates wait behind it): never a backlog of its own.
SNAPSHOT_CHUNK = 16384
_SNAPSHOT_LOW_WATER = 1 << 20
#: Rows (live connections and quarantined ones) one client process may hold at once.
MAX_ROWS_PER_PROCESS = 32
_RECV = 1 << 20
_U64 = 1 << 64


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    pid: int
    pidfd: int | None  # None: the peer could not be watched (then it is never released)
    row: int | None = None
    label: str = ""
    client_id: bytes = b""
    subscribed: bool = False
    presence: bool = False  # a subscriber that takes the presence feed
    refused: bool = False
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)
    # a subscriber's snapshot still to send (entries), and the updates made meanwhile
    snapshot: list[EntryTuple] = field(default_factory=list)
    deferred: list[bytes] = field(default_factory=list)
    deferred_bytes: int = 0


@dataclass(frozen=True, slots=True)
class _Quarantined:
    """A closed connection's row whose process still runs (released when it exits, or
    given back to the same client when it reconnects)."""

    pid: int
    row: int
    client_id: bytes


class HostTierServer:
    """The host's shared CPU tier: ``cpu_bytes`` of ``slot_bytes`` slots, served on
    ``socket_path``."""

    def __init__(self, *, name: str, cpu_bytes: int, slot_bytes: int, socket_path: str,
                 max_clients: int = 256, mode: int = 0o600, group: int | None = None,
                 redis: RedisTier | None = None,
                 presence_feed: PresenceFeed | None = None) -> None:
        if slot_bytes < 1:
            raise ValueError(f"slot_bytes must be >= 1, got {slot_bytes}")
        num_slots = cpu_bytes // slot_bytes
        if num_slots < 1:
            raise ValueError(f"cpu_bytes {cpu_bytes} holds no slot of {slot_bytes} bytes")
        self.name = name
        self.segment_path = default_path(name)
        self.pins_path = default_path(f"{name}.pins")
        self.socket_path = socket_path
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.max_clients = max_clients
        self.mode = mode
        self.group = group
        self.instance = uuid.uuid4().hex
        self.lock = threading.RLock()
        self.directory: HostDirectory | None = None
        self.protocol_errors = 0
        self.refused = 0
        self._conns: dict[int, _Conn] = {}
        self._waiting_exit: dict[int, _Quarantined] = {}  # pidfd -> its row
        self.quarantined_rows = 0
        self.rows_reused = 0  # a reconnecting client given its quarantined row back
        self.stale_requests = 0  # commits / abandons naming another daemon run
        self.backlog_disconnects = 0  # clients too far behind on their replies
        self.huge_pages = "not started"  # the kernel's transparent-huge-page setting for shm
        self._listener: socket.socket | None = None
        self._selector: selectors.BaseSelector | None = None
        self._wake_r, self._wake_w = -1, -1
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._redis = redis  # a RedisTier: write-behind and restores for the clients
        # a PresenceFeed: announces what is written behind, learns what Redis holds
        self._presence_feed = presence_feed
        self.redis_service: HostTierRedisService | None = None
        self._posted: deque[Callable[[], None]] = deque()  # run on the loop (Redis service replies)
        # one daemon per name and per socket (run_files): held from start to stop
        self._locks = [RunLock(default_path(f"{name}.lock"), f"the host tier {name!r}",
                               "give this one another --host-tier-name"),
                       RunLock(f"{socket_path}.lock", f"the socket {socket_path}",
                               "give this one another --host-tier-socket")]
        self._files = RunFiles()  # what this run created: all it removes at stop

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Lock the name and the socket, create the segment, the pin table and the socket;
        a start that fails removes what it created and lets the locks go."""
        segment = pins = None
        try:
            prepare_socket_dir(self.socket_path, group=self.group)
            for run_lock in self._locks:
                run_lock.acquire()
            for path in (self.segment_path, self.pins_path):
                _remove_stale(path)
            # created private (0600), then given the group and the mode on the file itself:
            # never open to the daemon's primary group, nor to anyone before the group
            segment = SharedSegment.create(self.segment_path, self.num_slots,
                                           self.slot_bytes, mode=0o600)
            self._files.add(self.segment_path, mapped_file(address_of(segment.memory())))
            pins = PinTable.create(self.pins_path, self.max_clients, self.num_slots,
                                   mode=0o600)
            self._files.add(self.pins_path, mapped_file(address_of(pins.counts)))
            for path in (self.segment_path, self.pins_path):
                self._chown(path)
            self.huge_pages = segment.advise_huge_pages()
            self.directory = HostDirectory(segment, pins)
            if self._redis is not None:
                self.redis_service = HostTierRedisService(
                    self._redis, self.directory, self.lock, self._post,
                    feed=self._presence_feed, push=self._push_presence)
            self._listener = self._listen()
        except BaseException:
            if self.redis_service is not None:
                self.redis_service.close()
                self.redis_service = None
            self.directory = None
            for table in (segment, pins):
                if table is not None:
                    table.close()
            self._files.remove()
            for run_lock in reversed(self._locks):
                run_lock.release()
            raise
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="kvtier-host-tier", daemon=True)
        self._thread.start()
        log.info("host tier: %d slots of %d bytes in %s (huge pages asked for; the kernel's "
                 "shmem setting: %s), serving %s", self.num_slots, self.slot_bytes,
                 self.segment_path, self.huge_pages, self.socket_path)

    def stop(self) -> None:
        """Stop serving; remove the socket, the segment and the pin table."""
        if self._thread is None:
            return
        self._stopping = True
        os.write(self._wake_w, b"x")
        self._thread.join()
        self._thread = None
        if self.redis_service is not None:
            self.redis_service.close()
        assert self._selector is not None and self._listener is not None
        for conn in list(self._conns.values()):
            with contextlib.suppress(OSError):
                conn.sock.close()
            if conn.pidfd is not None:
                os.close(conn.pidfd)
        self._conns.clear()
        for pidfd in self._waiting_exit:
            os.close(pidfd)
        self._waiting_exit.clear()
        self._selector.close()
        self._listener.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self.directory is not None:
            for table in (self.directory.segment, self.directory.pins):
                table.close()
        # only the files this run created, still in place (not a later daemon's), then
        # the locks
        self._files.remove()
        for run_lock in reversed(self._locks):
            run_lock.release()

    def stats(self) -> dict[str, Any]:
        with self.lock:
            base = self.directory.stats() if self.directory else {}
            if self.redis_service is not None:
                base.update(self.redis_service.stats())
            return {**base, "redis": self.redis_service is not None,
                    "connections": len(self._conns),
                    "quarantined_clients": self.quarantined_rows,
                    "rows_reused": self.rows_reused, "stale_requests": self.stale_requests,
                    "backlog_disconnects": self.backlog_disconnects,
                    "protocol_errors": self.protocol_errors, "refused": self.refused,
                    "segment_path": self.segment_path, "socket_path": self.socket_path,
                    "huge_pages": self.huge_pages}

    # ------------------------------------------------------------ setup
    def _chown(self, path: str) -> None:
        """Give a file this run created (0600 so far) the group, then ``mode``: it is never
        open to another group (the daemon's primary one included)."""
        if self._files.created.get(path) is None:
            raise FileNotFoundError(f"{path} is not a file this daemon run created")
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            share_file(path, self._files.created[path], mode=self.mode, group=self.group)
            return
        # a socket cannot be opened: by path, in the directory prepare_socket_dir checked
        if self.group is not None:
            os.chown(path, -1, self.group, follow_symlinks=False)
        os.chmod(path, self.mode)

    def _listen(self) -> socket.socket:
        # the directory was made or checked (prepare_socket_dir) and the socket's lock is
        # held: a socket left here is an earlier run's
        _remove_stale(self.socket_path, socket_only=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # bound with a umask that leaves nothing to others, then set to exactly mode
            old = os.umask(0o177)
            try:
                listener.bind(self.socket_path)
            finally:
                os.umask(old)
            self._files.add(self.socket_path)
            self._chown(self.socket_path)
            listener.listen(64)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        return listener

    # ------------------------------------------------------------ loop
    def _run(self) -> None:
        assert self._selector is not None
        while not self._stopping:
            for key, events in self._selector.select():
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj == self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                    while self._posted:
                        try:
                            self._posted.popleft()()
                        except Exception:  # a reply that cannot go: never the loop
                            log.exception("host tier: a Redis reply failed")
                elif isinstance(key.fileobj, int) and key.fileobj in self._waiting_exit:
                    self._process_exited(key.fileobj)
                else:
                    conn = key.data
                    if events & selectors.EVENT_READ:
                        self._read(conn)
                    if events & selectors.EVENT_WRITE and conn.sock.fileno() in self._conns:
                        self._flush(conn)

    def _accept(self) -> None:
        assert self._listener is not None and self._selector is not None
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(False)
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, _uid, _gid = struct.unpack("3i", creds)
        try:
            pidfd: int | None = os.pidfd_open(pid)
        except OSError as exc:
            log.warning("host tier: cannot watch client pid %d (%s): its slots are "
                        "never released", pid, exc)
            pidfd = None
        conn = _Conn(sock, pid, pidfd)
        self._conns[sock.fileno()] = conn
        self._selector.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_RECV)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        conn.inbox += data
        try:
            bodies = split_frames(conn.inbox)
            with self.lock:
                for body in bodies:
                    if conn.refused:
                        break
                    self._handle(conn, decode_to_daemon(body))
                self._broadcast()
        except ProtocolError as exc:
            log.warning("host tier: closing client pid %d (%s): %s", conn.pid, conn.label, exc)
            with self.lock:  # stats() sees the error and the quarantine together
                self.protocol_errors += 1
                self._close(conn)
            return
        if conn.refused:  # the reason first, then the close
            with contextlib.suppress(OSError):
                conn.sock.setblocking(True)
                conn.sock.sendall(bytes(conn.outbox))
            self._close(conn)
            return
        self._flush(conn)

    def _handle(self, conn: _Conn, msg: Any) -> None:
        directory = self.directory
        assert directory is not None
        if isinstance(msg, Hello):
            self._hello(conn, msg)
            return
        if conn.row is None:
            raise ProtocolError(f"{type(msg).__name__} before hello")
        if isinstance(msg, Lease):
            n = max(0, min(msg.n, MAX_LEASE))
            self._send(conn, Leased(directory.lease(conn.row, n)))
        elif isinstance(msg, Commit):
            self._commit(conn, msg)
        elif isinstance(msg, Abandon):
            if self._current(msg.instance):
                for slot in msg.slots:
                    directory.abandon(conn.row, slot)
        elif isinstance(msg, Touch):
            directory.touch(msg.digests)
        elif isinstance(msg, Bye):
            # nothing in flight, no pin held (the client's word, for its own row only):
            # the row goes now instead of waiting for the process to exit
            directory.release_client(conn.row)
            conn.row = None
            conn.refused = True  # closed once this batch is answered
        elif isinstance(msg, Probe):
            keys = [_block_key(k) for k in msg.keys]
            if self.redis_service is None:
                self._send(conn, Probed(msg.id, [0] * len(keys)))
            else:
                self.redis_service.probe(
                    keys, self._replier(conn, lambda ids, i=msg.id: Probed(i, ids)))
        elif isinstance(msg, Restore):
            items = [_restore_item(item, self.slot_bytes) for item in msg.items]
            if self.redis_service is None:
                self._send(conn, Restored(msg.id, [None] * len(items)))
            else:
                self.redis_service.restore(items, self._replier(
                    conn, lambda where, i=msg.id: Restored(i, where)))

    def _hello(self, conn: _Conn, msg: Hello) -> None:
        directory = self.directory
        assert directory is not None
        if conn.row is not None:
            raise ProtocolError("second hello")
        if msg.version != PROTOCOL_VERSION:
            self._refuse(conn, f"protocol version {msg.version}; this daemon speaks "
                               f"{PROTOCOL_VERSION} (upgrade kvtier on both sides)")
            return
        conn.client_id = bytes(msg.client_id[:32])
        row = self._reclaim_row(conn)
        reused = row is not None
        if row is None:
            held = self._rows_of(conn.pid)
            if held >= MAX_ROWS_PER_PROCESS:
                self._refuse(conn, f"process {conn.pid} already holds {held} client rows "
                                   f"(at most {MAX_ROWS_PER_PROCESS})")
                return
            row = directory.attach_client()
        if row is None:
            self._refuse(conn, f"all {self.max_clients} client rows are taken")
            return
        conn.row, conn.label, conn.subscribed = row, msg.label[:200], msg.subscribe
        conn.presence = msg.subscribe and msg.presence
        conn.snapshot = ([(d, w.slot, w.save_id, w.length) for d, w in directory.entries.items()]
                         if msg.subscribe else [])
        first, conn.snapshot = conn.snapshot[:SNAPSHOT_CHUNK], conn.snapshot[SNAPSHOT_CHUNK:]
        presence, synced = (self.redis_service.presence_snapshot()
                            if conn.presence and self.redis_service is not None else (None, False))
        self._send(conn, Welcome(PROTOCOL_VERSION, self.instance, self.segment_path,
                                 self.pins_path, row, self.num_slots, self.slot_bytes,
                                 first, redis=self.redis_service is not None,
                                 presence=presence.tobytes() if presence is not None else b"",
                                 presence_synced=synced, more=bool(conn.snapshot),
                                 leased=directory.leased_to(row) if reused else []))

    def _reclaim_row(self, conn: _Conn) -> int | None:
        """The quarantined row of this client (same process, same client id), taken out of
        quarantine with its leases and pins; None when it has none."""
        if not conn.client_id:
            return None
        for pidfd, q in self._waiting_exit.items():
            if q.pid == conn.pid and q.client_id == conn.client_id:
                del self._waiting_exit[pidfd]
                assert self._selector is not None
                self._selector.unregister(pidfd)
                os.close(pidfd)
                self.quarantined_rows -= 1
                self.rows_reused += 1
                return q.row
        return None

    def _rows_of(self, pid: int) -> int:
        live = sum(1 for c in self._conns.values() if c.pid == pid and c.row is not None)
        return live + sum(1 for q in self._waiting_exit.values() if q.pid == pid)

    def _current(self, instance: str) -> bool:
        """Whether a request names this daemon run (else it is counted and ignored: its
        slots were leased from an earlier run, and may be anyone's in this one)."""
        if instance == self.instance:
            return True
        self.stale_requests += 1
        return False

    def _commit(self, conn: _Conn, msg: Commit) -> None:
        directory = self.directory
        assert directory is not None and conn.row is not None
        if msg.redis and len(msg.redis) != len(msg.saves):
            raise ProtocolError(f"commit of {len(msg.saves)} saves names "
                                f"{len(msg.redis)} Redis keys")
        if not self._current(msg.instance):
            self._send(conn, Committed([], [slot for _, slot, _, _ in msg.saves]))
            return
        targets = [(_block_key(t[0]), t[1], t[2]) if t is not None else None
                   for t in msg.redis] if msg.redis else [None] * len(msg.saves)
        kept: list[int] = []
        dropped: list[int] = []
        behind: list[WriteItem] = []
        for (digest, slot, save_id, length), target in zip(msg.saves, targets, strict=True):
            ok = directory.commit(conn.row, slot, digest, save_id, length)
            (kept if ok else dropped).append(slot)
            if ok and target is not None and self.redis_service is not None:
                # held until the Redis service has read it back: eviction cannot skip the write
                directory.pin_for_copy(digest)
                behind.append((digest, Location(slot, save_id, length), *target))
        self._send(conn, Committed(kept, dropped))
        if self.redis_service is not None:
            self.redis_service.write_behind(behind)

    def _push_presence(self, digests: Any, synced: bool) -> None:
        """Send what the presence feed learned to every subscriber (on the loop)."""
        message = Presence(digests.tobytes(), synced)
        for conn in list(self._conns.values()):
            if conn.presence:
                self._send(conn, message)
                self._flush(conn)

    def _post(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop thread (from the Redis service's threads)."""
        self._posted.append(fn)
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _replier(self, conn: _Conn, build: Callable[[Any], ToClient]) -> Callable[[Any], None]:
        """A reply to ``conn``, run on the loop: sent if it is still connected, after the
        mirror changes the request made (so a reply never runs ahead of its entries)."""
        def reply(answer: Any) -> None:
            with self.lock:
                self._broadcast()
                if self._conns.get(conn.sock.fileno()) is conn:
                    self._send(conn, build(answer))
                    self._flush(conn)
        return reply

    def _refuse(self, conn: _Conn, reason: str) -> None:
        self.refused += 1
        log.warning("host tier: refusing client pid %d: %s", conn.pid, reason)
        self._send(conn, Refused(reason))
        conn.refused = True

    def _broadcast(self) -> None:
        assert self.directory is not None
        events = self.directory.drain_events()
        if not events:
            return
        added = [(d, w.slot, w.save_id, w.length) for d, w in events if w is not None]
        removed = [d for d, w in events if w is None]
        # a client applies ``removed`` before ``added``: right unless a digest was added
        # and then removed in this batch, which is then sent event by event
        messages = [Changes(added, removed)] if not _reordered(events) else [
            Changes([(digest, where.slot, where.save_id, where.length)] if where else [],
                    [] if where else [digest]) for digest, where in events]
        frames = [frame(m) for m in messages]
        for conn in list(self._conns.values()):
            if not conn.subscribed:
                continue
            for data in frames:
                if conn.snapshot:  # after the snapshot, in order
                    conn.deferred.append(data)
                    conn.deferred_bytes += len(data)
                else:
                    conn.outbox += data
            self._flush(conn)

    def _send(self, conn: _Conn, message: ToClient) -> None:
        conn.outbox += frame(message)

    def _feed_snapshot(self, conn: _Conn) -> None:
        """Top up a subscriber's outbox with its snapshot, a chunk at a time, then the
        updates that waited behind it."""
        while conn.snapshot and len(conn.outbox) < _SNAPSHOT_LOW_WATER:
            chunk, conn.snapshot = conn.snapshot[:SNAPSHOT_CHUNK], conn.snapshot[SNAPSHOT_CHUNK:]
            self._send(conn, Changes(chunk, []))
        if not conn.snapshot and conn.deferred:
            conn.outbox += b"".join(conn.deferred)
            conn.deferred, conn.deferred_bytes = [], 0

    def _flush(self, conn: _Conn) -> None:
        assert self._selector is not None
        self._feed_snapshot(conn)
        if conn.outbox:
            try:
                sent = conn.sock.send(conn.outbox)
                del conn.outbox[:sent]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._close(conn)
                return
        behind = len(conn.outbox) + conn.deferred_bytes
        if behind > MAX_BACKLOG:
            log.warning("host tier: client pid %d (%s) is %d bytes behind; disconnecting",
                        conn.pid, conn.label, behind)
            self.backlog_disconnects += 1
            self._close(conn)
            return
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbox or conn.snapshot
                                       else 0)
        self._selector.modify(conn.sock, want, conn)

    def _close(self, conn: _Conn) -> None:
        with self.lock:  # the counters stats() reads change in one step
            self._close_locked(conn)

    def _close_locked(self, conn: _Conn) -> None:
        assert self._selector is not None
        if self._conns.pop(conn.sock.fileno(), None) is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()
        if conn.pidfd is None:
            if conn.row is not None:
                self.quarantined_rows += 1
            return
        if conn.row is None:
            os.close(conn.pidfd)
        elif _exited(conn.pidfd):
            os.close(conn.pidfd)
            self._release(conn.row)
        else:
            self._waiting_exit[conn.pidfd] = _Quarantined(conn.pid, conn.row, conn.client_id)
            self.quarantined_rows += 1
            self._selector.register(conn.pidfd, selectors.EVENT_READ, None)

    def _process_exited(self, pidfd: int) -> None:
        assert self._selector is not None
        quarantined = self._waiting_exit.pop(pidfd)
        self._selector.unregister(pidfd)
        os.close(pidfd)
        with self.lock:
            self.quarantined_rows -= 1
            self._release(quarantined.row)

    def _release(self, row: int) -> None:
        with self.lock:
            assert self.directory is not None
            self.directory.release_client(row)
            self._broadcast()


def _block_key(t: KeyTuple) -> BlockKey:
    """A client's Redis key, checked (a bad one is the client's protocol error)."""
    try:
        fingerprint, group, block_hash, num_tokens, kind = t
        key = BlockKey(fingerprint, group, bytes(block_hash), num_tokens, BlockKind(kind))
        validate_key(key)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"not a Redis key: {exc}") from None
    return key


def _exited(pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` has exited (the pidfd polls readable)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def _restore_item(item: Any, slot_bytes: int) -> RestoreItem:
    """A client's restore item, checked at the wire (a bad one is its protocol error,
    before any slot is leased for it)."""
    try:
        digest, key, save_id, length = item
    except (TypeError, ValueError):
        raise ProtocolError(f"not a restore item: {item!r:.80}") from None
    if not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES:
        raise ProtocolError(f"restore digest of {len(digest)} bytes, not {DIGEST_BYTES}")
    if not 0 <= save_id < _U64 or not 0 <= length <= slot_bytes:
        raise ProtocolError(f"restore of save {save_id} with {length} bytes (slots hold "
                            f"{slot_bytes})")
    return bytes(digest), _block_key(key), save_id, length


def _reordered(events: list[tuple[bytes, Any]]) -> bool:
    """Whether applying all removals before all additions would differ from the order."""
    added_first: set[bytes] = set()
    for digest, where in events:
        if where is not None:
            added_first.add(digest)
        elif digest in added_first:
            return True
    return False


def _remove_stale(path: str, *, socket_only: bool = False) -> None:
    """Remove a file an earlier run left; refuse to remove anything unexpected."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if socket_only and not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(f"{path} exists and is not a socket")
    if not socket_only and not stat.S_ISREG(st.st_mode):
        raise FileExistsError(f"{path} exists and is not a regular file")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not this daemon's uid "
                              f"{os.geteuid()}: remove it (as its owner), or give this "
                              f"daemon another --host-tier-name / --host-tier-socket")
    os.unlink(path)
