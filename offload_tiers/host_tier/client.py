"""An engine process's side of the host tier: look-ups from a local mirror, bytes in shm.

Nothing a caller does here waits on the daemon. Look-ups read ``mirror`` (a dict the
reader thread keeps equal to the daemon's directory, a message behind); pins are counter
writes in shared memory; slots to write come from a pool leased ahead of need; commits,
lease requests and touches go to a writer thread's queue. A daemon that is gone makes
every look-up a miss and every save a skipped one until a later connection is welcomed
(the thread retries every ``retry_s``); a new daemon run means a new segment and an empty
mirror.

A mirror entry can be stale (evicted or reused since): every read is checked against the
slot's own header and checksum (:meth:`SharedSegment.read_into`), so a stale entry is a
failed read, never wrong bytes.

Slots taken for writing come as a :class:`SlotLease`: the daemon run, the row and the
segment they were leased in. A commit or an abandon is sent only on a connection to that
same run and row; one that outlived its run (the daemon restarted under a write in
flight) is dropped, counted (``commits_stale``): in the new run those slot numbers may be
leased to another client. A reconnect to the same run gets the same row back (the daemon
knows this client by ``client_id`` and its pid), so the pool and the writes in flight stay
good; a new run drops the pool. A client that closes with no write in flight and no pin
says ``Bye`` and its row is released at once.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from offload_tiers._types import BytesLike
from offload_tiers.host_tier.directory import Location
from offload_tiers.host_tier.pins import PinTable
from offload_tiers.host_tier.protocol import (
    PROTOCOL_VERSION,
    Abandon,
    Bye,
    Changes,
    Commit,
    Committed,
    Hello,
    KeyTuple,
    Lease,
    Leased,
    Presence,
    Probe,
    Probed,
    ProtocolError,
    RedisWrite,
    Refused,
    Restore,
    Restored,
    ToDaemon,
    Touch,
    Welcome,
    decode_to_client,
    frame,
    split_frames,
)
from offload_tiers.host_tier.trust import (
    TrustedDaemon,
    UntrustedError,
    address_of,
    check_daemon,
    resolve_group,
)
from offload_tiers.presence import unpack_digests
from offload_tiers.shared_segment import SharedSegment

log = logging.getLogger("kvtier.host_tier")


@dataclass(slots=True)
class ClientCounters:
    attempts: int = 0  # connection tries that ended (refused, failed, or closed later)
    connects: int = 0
    disconnects: int = 0
    refusals: int = 0
    slots_leased: int = 0
    slots_short: int = 0  # asked for by take_slots and not in the pool
    commits_sent: int = 0
    commits_kept: int = 0
    commits_dropped: int = 0
    reads_ok: int = 0
    reads_failed: int = 0  # a mirror entry the slot no longer held
    commits_stale: int = 0  # saves of a lease from an earlier daemon run or row: not sent
    slots_abandoned: int = 0  # leased slots given back unwritten (a failed copy or commit)
    requests: int = 0  # probes and restores asked of the daemon's Redis
    requests_unanswered: int = 0  # not answered in time, or the connection went

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Pins:
    """Pins taken by :meth:`HostTierClient.pin`; valid for the connection that took them."""

    table: PinTable
    row: int
    slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SlotLease:
    """Slots taken from the pool to write: valid for the daemon run and row that leased
    them (:meth:`HostTierClient.commit` / :meth:`HostTierClient.abandon` check)."""

    instance: str
    row: int
    segment: SharedSegment | None
    slots: tuple[int, ...]


class _Attached:
    """One welcomed connection's daemon run: its segment, pin table and row. Each file is
    checked on the descriptor that is mapped (:mod:`offload_tiers.host_tier.trust`): the
    checked daemon's own, open to no one else (to the trusted group only, in group mode)."""

    def __init__(self, welcome: Welcome, daemon: TrustedDaemon | None) -> None:
        if daemon is None:
            raise ProtocolError("a welcome from a daemon that was not checked")
        self.instance = welcome.instance
        self.segment = _attach_segment(welcome.segment_path, daemon)
        try:
            self.pins = PinTable.attach(welcome.pins_path, check=daemon.check_fd)
        except BaseException:
            self.segment.close()
            raise
        self.row = welcome.row
        self.redis = welcome.redis
        if (self.segment.num_slots, self.segment.slot_bytes) != (welcome.num_slots,
                                                                 welcome.slot_bytes):
            self.segment.close()
            self.pins.close()
            raise ProtocolError(f"segment {welcome.segment_path} does not match the welcome")


def _attach_segment(path: str, daemon: TrustedDaemon) -> SharedSegment:
    """The segment at ``path``, refused (:class:`UntrustedError`) unless the file is the
    daemon's own: checked on a descriptor before a byte is read, and the mapping checked to
    be of that very file."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        daemon.check_fd(fd, path)
        segment = SharedSegment.attach(path)
        try:
            daemon.check_mapping(address_of(segment.memory()), fd, path)
        except BaseException:
            segment.close()
            raise
    finally:
        os.close(fd)
    return segment


class HostTierClient:
    """A connection to ``kvtier daemon``'s host tier at ``socket_path``."""

    def __init__(self, socket_path: str, *, label: str = "", subscribe: bool = False,
                 lease_batch: int = 64, retry_s: float = 1.0, presence: bool = False,
                 presence_window: int = 1 << 20, group: int | str | None = None) -> None:
        """``lease_batch``: slots kept leased ahead of need (0: this client never writes,
        e.g. a scheduler half, and leases none). ``group`` (a name or gid): also trust a
        daemon that runs in this group, and its files shared with it (the daemon's
        ``--host-tier-group``); else only a daemon of this uid or root is trusted."""
        self.socket_path = socket_path
        self.label = label
        self.subscribe = subscribe
        # a subscriber that takes the daemon's presence feed (take_presence); at most
        # ``presence_window`` digests wait untaken (the oldest go: a summary keeps no more)
        self.presence = presence and subscribe
        self.presence_window = presence_window
        self.lease_batch = lease_batch
        self.retry_s = retry_s
        self.group = resolve_group(group)
        self._daemon: TrustedDaemon | None = None  # the checked peer of this connection
        self._refusal_logged = ""
        self.counters = ClientCounters()
        self.mirror: dict[bytes, Location] = {}
        self.last_error = ""
        self._attached: _Attached | None = None
        self._pool: deque[int] = deque()
        self._lease_pending = False
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._closed = threading.Event()
        self._sock: socket.socket | None = None
        self._writer: threading.Thread | None = None
        self._thread: threading.Thread | None = None
        self._request_ids = itertools.count(1)
        # the daemon's presence feed, for a subscriber: digests not yet taken, and synced
        self._presence: deque[np.ndarray] = deque()
        self._presence_count = 0
        self.presence_synced = False
        self._replies: dict[int, Probed | Restored | None] = {}  # id -> answer (None: waiting)
        self.client_id = os.urandom(16)  # the daemon gives a reconnect this client's row back
        self._pool_of: tuple[str, int] | None = None  # (run, row) the pool was leased in
        self._taken: set[int] = set()  # slots taken and not yet committed or abandoned
        self._pins_held = 0

    # ------------------------------------------------------------ lifecycle
    def start(self) -> HostTierClient:
        self._thread = threading.Thread(target=self._run, name="kvtier-host-tier-client",
                                        daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Send what is queued (commits of finished saves), then disconnect; with no write
        in flight and no pin held, the daemon is told to release this client's row now."""
        with self._cond:
            if self._attached is not None and not self._taken and not self._pins_held:
                self._send(Bye())
        self._closed.set()
        writer = self._writer
        if writer is not None:
            self._outbox.put(None)
            writer.join()
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @property
    def available(self) -> bool:
        return self._attached is not None

    @property
    def redis(self) -> bool:
        """The daemon writes commits behind to Redis and answers probes and restores."""
        attached = self._attached
        return attached is not None and attached.redis

    @property
    def slots_at_hand(self) -> int:
        """Leased slots not yet taken (what the next saves can use without waiting)."""
        return len(self._pool)

    @property
    def segment(self) -> SharedSegment | None:
        attached = self._attached
        return attached.segment if attached else None

    @property
    def instance(self) -> str | None:
        attached = self._attached
        return attached.instance if attached else None

    def wait_until(self, predicate: Callable[[HostTierClient], bool],
                   timeout: float | None = None) -> bool:
        """Block until ``predicate(self)`` holds after some message (or now); False on
        timeout. For callers that must act on an event (tests, start-up), never in a step."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self), timeout)

    # ------------------------------------------------------------ reads
    def lookup(self, digest: bytes) -> Location | None:
        return self.mirror.get(digest) if self._attached is not None else None

    def pin(self, slots: Iterable[int]) -> Pins | None:
        """Pin ``slots`` in this connection's row (None when not connected)."""
        attached = self._attached
        if attached is None:
            return None
        pins = Pins(attached.pins, attached.row, tuple(slots))
        pins.table.pin(pins.row, pins.slots)
        self._pins_held += 1
        return pins

    def unpin(self, pins: Pins | None) -> None:
        if pins is not None:
            pins.table.unpin(pins.row, pins.slots)
            self._pins_held -= 1

    def read_into(self, digest: bytes, where: Location, out: BytesLike) -> bool:
        """Copy the save ``where`` names into ``out``; False (counted) unless the slot
        still holds exactly that save of ``digest``."""
        segment = self.segment
        ok = segment is not None and segment.read_into(where.slot, digest, where.save_id, out)
        if ok:
            self.counters.reads_ok += 1
        else:
            self.counters.reads_failed += 1
        return ok

    def touch(self, digests: list[bytes]) -> None:
        if digests and self._attached is not None:
            self._send(Touch(digests))

    # ------------------------------------------------------------ writes
    def take_slots(self, n: int) -> SlotLease:
        """Up to ``n`` leased slots to write now (fewer when the pool is short: counted),
        with the run, row and segment they belong to; asks the daemon for more in the
        background. Every slot taken ends in :meth:`commit` or :meth:`abandon`."""
        taken: list[int] = []
        with self._cond:
            attached = self._attached
            if attached is not None:
                while self._pool and len(taken) < n:
                    taken.append(self._pool.popleft())
                short = n - len(taken)
                if self.lease_batch > 0 and len(self._pool) < self.lease_batch // 2 \
                        and not self._lease_pending:
                    self._lease_pending = True
                    self._send(Lease(self.lease_batch + short))
            self.counters.slots_short += n - len(taken)
            self._taken.update(taken)
            if attached is None:
                return SlotLease("", -1, None, ())
            return SlotLease(attached.instance, attached.row, attached.segment, tuple(taken))

    def commit(self, lease: SlotLease, saves: list[tuple[bytes, int, int, int]],
               redis: list[RedisWrite | None] | None = None) -> None:
        """Tell the daemon these (digest, slot, save id, length) saves, in slots of
        ``lease``, are written and committed there (``SharedSegment.commit_write`` done);
        ``redis``, one per save, where the daemon writes each behind to Redis (None: not
        there). The lease's slots not among ``saves`` are given back (:meth:`abandon`).
        Dropped, counted, unless this connection is to the lease's run and row."""
        done = {slot for _, slot, _, _ in saves}
        with self._cond:
            self._taken.difference_update(lease.slots)
            if not self._current(lease):
                self.counters.commits_stale += len(saves)
                return
            if saves:
                self.counters.commits_sent += len(saves)
                self._send(Commit(lease.instance, saves, redis or []))
            rest = [slot for slot in lease.slots if slot not in done]
            if rest:
                self.counters.slots_abandoned += len(rest)
                self._send(Abandon(lease.instance, rest))

    def abandon(self, lease: SlotLease) -> None:
        """Give every slot of ``lease`` back unwritten (a copy or a commit that failed):
        the daemon invalidates and frees them now, not when this process exits."""
        self.commit(lease, [])

    def _current(self, lease: SlotLease) -> bool:
        attached = self._attached
        return attached is not None and (attached.instance, attached.row) == (lease.instance,
                                                                              lease.row)

    # ------------------------------------------------------------ the daemon's Redis
    def probe(self, keys: list[KeyTuple], timeout: float) -> list[int] | None:
        """Which save of each key Redis holds (0: none), asked of the daemon; None when it
        did not answer within ``timeout`` (or has no Redis). Blocks: I/O threads only."""
        reply = self._request(lambda i: Probe(i, keys), timeout)
        return reply.save_ids if isinstance(reply, Probed) else None

    def restore(self, items: list[tuple[bytes, KeyTuple, int, int]], timeout: float
                ) -> list[Location | None] | None:
        """Have the daemon read values from Redis into host-tier slots: per item (host
        digest, Redis key, Redis save id, payload length), where it now lies or None.
        None when the daemon did not answer within ``timeout``. Blocks: I/O threads only."""
        reply = self._request(lambda i: Restore(i, items), timeout)
        if not isinstance(reply, Restored):
            return None
        return [None if w is None else Location(w[1], w[2], w[3]) for w in reply.where]

    def take_presence(self) -> np.ndarray:
        """Key-name digests the daemon learned Redis holds, since the last call (a new
        connection starts with the daemon's whole window of them)."""
        with self._cond:
            parts, self._presence, self._presence_count = list(self._presence), deque(), 0
        return np.concatenate(parts) if parts else np.zeros(0, dtype="<u8")

    def _learn(self, digests: np.ndarray) -> None:
        if not len(digests):
            return
        self._presence.append(digests)
        self._presence_count += len(digests)
        while self._presence_count - len(self._presence[0]) >= self.presence_window:
            self._presence_count -= len(self._presence.popleft())

    def _request(self, build: Callable[[int], ToDaemon], timeout: float
                 ) -> Probed | Restored | None:
        with self._cond:
            if not self.redis:
                return None
            rid = next(self._request_ids)
            self._replies[rid] = None
            self.counters.requests += 1
            self._send(build(rid))
            self._cond.wait_for(lambda: self._replies.get(rid, False) is not None, timeout)
            reply = self._replies.pop(rid, None)
            if reply is None:
                self.counters.requests_unanswered += 1
            return reply

    def write(self, digest: bytes, payload: BytesLike) -> bool:
        """One save of ``payload`` under ``digest`` in a leased slot; False when no slot
        was at hand or it does not fit."""
        lease = self.take_slots(1)
        if lease.segment is None or not lease.slots:
            self.commit(lease, [])
            return False
        save_id = new_save_id()
        try:
            lease.segment.write(lease.slots[0], digest, save_id, payload)
        except BaseException:
            self.abandon(lease)
            raise
        self.commit(lease, [(digest, lease.slots[0], save_id, memoryview(payload).nbytes)])
        return True

    # ------------------------------------------------------------ connection
    def _send(self, message: ToDaemon) -> None:
        self._outbox.put(frame(message))

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                self._serve_once()
            except UntrustedError as exc:  # a miss, never attached; said once per reason
                self.last_error = f"{type(exc).__name__}: {exc}"
                if self.last_error != self._refusal_logged:
                    self._refusal_logged = self.last_error
                    log.warning("kvtier: not using the host tier: %s", exc)
            except (OSError, ProtocolError, ValueError) as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
            with self._cond:  # an event a caller can wait for (wait_until)
                self.counters.attempts += 1
                self._cond.notify_all()
            self._closed.wait(self.retry_s)

    def _serve_once(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        writer: threading.Thread | None = None
        self._outbox = queue.SimpleQueue()
        try:
            sock.connect(self.socket_path)
            # believe nothing it says before knowing who it is (SO_PEERCRED)
            self._daemon = check_daemon(sock, self.socket_path, group=self.group)
            self._sock = sock
            if self._closed.is_set():
                # close() ran before this socket was published, so it shut none down: leave
                # now, or recv below would wait for a daemon that never speaks (close() joins
                # this thread). close() sets the flag, then reads _sock; this thread publishes
                # _sock, then reads the flag: one of the two always sees the other.
                return
            sock.sendall(frame(Hello(PROTOCOL_VERSION, os.getpid(), self.label,
                                     self.subscribe, self.presence, self.client_id)))
            inbox = bytearray()
            while not self._attached:
                if not self._receive(sock, inbox):
                    return
            writer = threading.Thread(target=self._write_loop, args=(sock, self._outbox),
                                      name="kvtier-host-tier-send", daemon=True)
            writer.start()
            self._writer = writer
            with self._cond:  # a row given back may have come with its pool
                if 0 < self.lease_batch and len(self._pool) < self.lease_batch:
                    self._send(Lease(self.lease_batch - len(self._pool)))
                    self._lease_pending = True
            while self._receive(sock, inbox):
                pass
        finally:
            self._sock = None
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            if writer is not None:
                self._outbox.put(None)
                writer.join()
                self._writer = None
            self._detach()

    def _receive(self, sock: socket.socket, inbox: bytearray) -> bool:
        data = sock.recv(1 << 20)
        if not data:
            return False
        inbox += data
        messages = [decode_to_client(body) for body in split_frames(inbox)]
        with self._cond:
            for message in messages:
                self._apply(message)
            self._cond.notify_all()
        return True

    def _apply(self, message: Any) -> None:
        if isinstance(message, Welcome):
            if message.version != PROTOCOL_VERSION:
                raise ProtocolError(f"daemon speaks protocol {message.version}, this client "
                                    f"{PROTOCOL_VERSION}")
            self.mirror = {d: Location(slot, save_id, length)
                           for d, slot, save_id, length in message.entries}
            self._attached = _Attached(message, self._daemon)
            if self._pool_of != (message.instance, message.row):
                # a new run (or row): the old pool's slot numbers may be anyone's now
                self._pool.clear()
                self._pool_of = (message.instance, message.row)
            elif message.leased:
                # this client's row given back: its leases are the daemon's word (a Leased
                # lost with the old connection included), less the writes still in flight
                self._pool = deque(s for s in message.leased if s not in self._taken)
            self._presence.clear()
            self._presence_count = 0
            self._learn(unpack_digests(message.presence))
            self.presence_synced = message.presence_synced
            self.counters.connects += 1
            self.last_error = ""
        elif isinstance(message, Changes):
            for digest in message.removed:
                self.mirror.pop(digest, None)
            for digest, slot, save_id, length in message.added:
                self.mirror[digest] = Location(slot, save_id, length)
        elif isinstance(message, Leased):
            self._pool.extend(message.slots)
            self._lease_pending = False
            self.counters.slots_leased += len(message.slots)
        elif isinstance(message, Committed):
            self.counters.commits_kept += len(message.kept)
            self.counters.commits_dropped += len(message.dropped)
        elif isinstance(message, Presence):
            self._learn(unpack_digests(message.digests))
            self.presence_synced = message.synced
        elif isinstance(message, (Probed, Restored)):
            if message.id in self._replies:  # else: its asker gave up waiting
                self._replies[message.id] = message
        elif isinstance(message, Refused):
            self.counters.refusals += 1
            raise ProtocolError(f"the daemon refused this client: {message.reason}")

    def _detach(self) -> None:
        with self._cond:
            if self._attached is not None:
                self.counters.disconnects += 1
            # the pool stays until the next welcome: the same run gives this client its
            # row (and so its leases) back; a new run drops it (see _apply)
            self._attached = None
            self.mirror = {}
            self._lease_pending = False
            self._replies.clear()  # a waiting request wakes to no answer
            self.presence_synced = False
            self._cond.notify_all()

    @staticmethod
    def _write_loop(sock: socket.socket, outbox: queue.SimpleQueue[bytes | None]) -> None:
        while (data := outbox.get()) is not None:
            try:
                sock.sendall(data)
            except OSError:
                return


def new_save_id() -> int:
    """A random 64-bit save id (non-zero)."""
    return int.from_bytes(os.urandom(8), "little") or 1
