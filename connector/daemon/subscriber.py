"""ZMQ side of the daemon: one SUB (+ optional replay DEALER) per publisher and DP rank.

Frames are ``[topic, seq (8 bytes big-endian), payload]``. Sequence numbers start at 0 per
publisher; a first seq > 0 is a gap (a connecting PUB loses its first message). On a gap the
daemon asks the publisher's replay ROUTER for everything from the missing seq, buffers live
batches meanwhile (bounded), applies the replayed ones in order, then the buffered ones.
What replay cannot deliver is counted as unrepaired. At most one replay is in flight per
source, so gap storms cannot turn into replay storms. seq 0 after a higher seq is a
publisher restart: the media listed in ``clear_on_restart`` are cleared for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from connector.daemon.config import DaemonConfig, PublisherConfig, offset_endpoint
from connector.daemon.ingest import Ingestor
from connector.events.wire import DecodeError

__all__ = ["Source", "SourceCounters", "Subscriber"]

log = logging.getLogger("kvtier.daemon")
END_SEQ = -1


@dataclass
class SourceCounters:
    """What happened on one source's sockets."""

    received: int = 0
    applied: int = 0
    gaps: int = 0
    missing_batches: int = 0  # gap batches replay could not deliver (or no replay socket)
    repaired_batches: int = 0
    duplicates: int = 0
    restarts: int = 0
    replays_requested: int = 0
    replays_completed: int = 0
    replay_timeouts: int = 0
    idle_probes: int = 0  # replay asks while idle: repairs lost batches no later one reveals
    probe_timeouts: int = 0
    replay_overflows: int = 0
    malformed_frames: int = 0
    decode_errors: int = 0
    errors_by_reason: dict[str, int] = field(default_factory=dict)


class Source:
    """One publisher endpoint at one DP rank: sockets, sequence state, replay state machine."""

    def __init__(self, ctx: zmq.Context, cfg: PublisherConfig, rank: int,
                 daemon: DaemonConfig, ingest: Callable[[Source, bytes], None],
                 on_restart: Callable[[Source], None] | None = None) -> None:
        self.cfg = cfg
        self.rank = rank
        self.endpoint = offset_endpoint(cfg.endpoint, rank)
        self.replay_endpoint = (offset_endpoint(cfg.replay_endpoint, rank)
                                if cfg.replay_endpoint else None)
        self.name = cfg.source_name
        self.topic = cfg.topic.encode()
        self.counters = SourceCounters()
        self._ctx = ctx
        self._daemon = daemon
        self._ingest = ingest
        self._on_restart = on_restart or (lambda src: None)
        self.expected: int | None = None
        self.replaying = False
        self._replay_deadline = 0.0
        self._probing = False
        self._last_activity = time.monotonic()
        self._probe_interval = daemon.replay_idle_probe_s
        self._pending: list[tuple[int, bytes]] = []
        self.binds = not ("*" in self.endpoint or "::" in self.endpoint
                          or self.endpoint.startswith(("ipc://", "inproc://")))
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, daemon.hwm)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.dealer: zmq.Socket | None = None
        try:
            if self.binds:
                self.sub.bind(self.endpoint)
            else:
                self.sub.connect(self._connectable(self.endpoint))
            if self.replay_endpoint:
                self._open_dealer()
        except zmq.ZMQError:
            self.close()  # an unclosed socket would make Context.term() hang
            raise

    def _connectable(self, endpoint: str) -> str:
        return endpoint.replace("*", self._daemon.connect_host)

    def _open_dealer(self) -> None:
        assert self.replay_endpoint is not None
        self.dealer = self._ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(self._connectable(self.replay_endpoint))

    def close(self) -> None:
        self.sub.close(linger=0)
        if self.dealer is not None:
            self.dealer.close(linger=0)

    def _error(self, reason: str) -> None:
        c = self.counters
        c.errors_by_reason[reason] = c.errors_by_reason.get(reason, 0) + 1

    # -- frames ----------------------------------------------------------------------------

    def on_live(self, frames: list[bytes]) -> None:
        """A message from the SUB socket."""
        self.counters.received += 1
        self._last_activity = time.monotonic()
        if len(frames) != 3 or len(frames[1]) != 8:
            self.counters.malformed_frames += 1
            self._error("frames")
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if seq < 0:
            self.counters.malformed_frames += 1
            self._error("negative_seq")
            return
        if self.replaying:
            if len(self._pending) >= self._daemon.max_pending_batches:
                self.counters.replay_overflows += 1
                self._finish_replay()
                self._handle(seq, frames[2])
                return
            self._pending.append((seq, frames[2]))
            return
        self._handle(seq, frames[2])

    def on_replay(self, frames: list[bytes]) -> None:
        """A message from the replay DEALER: ``[b"", topic, seq, payload]``."""
        if len(frames) != 4 or len(frames[2]) != 8:
            self.counters.malformed_frames += 1
            self._error("replay_frames")
            return
        seq = int.from_bytes(frames[2], "big", signed=True)
        if not self.replaying:
            return  # late answer to a replay that timed out: live stream has moved on
        if seq == END_SEQ:
            if self._probing:
                self._probe_interval = self._daemon.replay_idle_probe_s
            else:
                self.counters.replays_completed += 1
            self._finish_replay()
            return
        if seq < 0:
            self.counters.malformed_frames += 1
            self._error("negative_seq")
            return
        expected = self.expected or 0
        if seq < expected:
            self.counters.duplicates += 1
            return
        if seq > expected:
            self.counters.missing_batches += seq - expected
        self.counters.repaired_batches += 1
        self._apply(seq, frames[3])

    def tick(self, now: float) -> None:
        """Called every poll round: time out a replay that never finished; when the stream
        has been idle, probe the replay buffer for batches lost with nothing after them."""
        if self.replaying:
            if now > self._replay_deadline:
                if self._probing:  # engine gone or replay socket down: back off
                    self.counters.probe_timeouts += 1
                    self._probe_interval = min(self._probe_interval * 2, 60.0)
                else:
                    self.counters.replay_timeouts += 1
                    log.warning("replay from %s timed out", self.name)
                if self.dealer is not None:  # drop stale answers with the old socket
                    self.dealer.close(linger=0)
                    self._open_dealer()
                self._finish_replay()
            return
        if (self.dealer is not None and self._probe_interval > 0
                and now - self._last_activity >= self._probe_interval):
            self._last_activity = now
            if self.request_replay(self.expected or 0, probe=True):
                self.counters.idle_probes += 1

    def request_replay(self, start: int, probe: bool = False) -> bool:
        """Ask for every buffered batch from ``start``; False when there is no replay socket."""
        if self.dealer is None:
            return False
        try:
            self.dealer.send_multipart((b"", start.to_bytes(8, "big")), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        if not probe:
            self.counters.replays_requested += 1
        self._probing = probe
        self.replaying = True
        self._replay_deadline = time.monotonic() + self._daemon.replay_timeout_s
        if self.expected is None:
            self.expected = start
        return True

    # -- sequence logic -------------------------------------------------------------------

    def _handle(self, seq: int, payload: bytes) -> None:
        c = self.counters
        expected = self.expected
        if expected is None:
            expected = self.expected = 0
        if seq == expected:
            self._apply(seq, payload)
            return
        if seq > expected:
            c.gaps += 1
            if self.request_replay(expected):
                self._pending.append((seq, payload))
                return
            c.missing_batches += seq - expected
            self._apply(seq, payload)
            return
        if seq == 0:
            c.restarts += 1
            log.warning("publisher %s restarted (seq 0 after %d)", self.name, expected - 1)
            self._on_restart(self)
            self._apply(seq, payload)
            return
        c.duplicates += 1

    def _finish_replay(self) -> None:
        self.replaying = False
        self._probing = False
        self._last_activity = time.monotonic()
        pending = sorted(self._pending, key=lambda item: item[0])
        self._pending = []
        if pending:
            expected = self.expected or 0
            first = pending[0][0]
            if first > expected:  # replay could not fill the hole: never ask again for it
                self.counters.missing_batches += first - expected
                self.expected = first
        for i, (seq, payload) in enumerate(pending):
            if self.replaying:
                self._pending.extend(pending[i:])
                return
            self._handle(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.expected = seq + 1
        self.counters.applied += 1
        self._ingest(self, payload)


class Subscriber:
    """The ingest thread: polls every source's sockets and feeds the :class:`Ingestor`."""

    def __init__(self, cfg: DaemonConfig, ingestor: Ingestor, lock: threading.Lock,
                 ctx: zmq.Context | None = None) -> None:
        self.cfg = cfg
        self.ingestor = ingestor
        self.lock = lock
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.sources: list[Source] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            for pcfg in cfg.publishers:
                for rank in range(pcfg.dp_size):
                    src = Source(self.ctx, pcfg, rank, cfg, self._ingest_payload,
                                 self._on_restart)
                    self.sources.append(src)
        except zmq.ZMQError:
            self.close()
            raise

    def _ingest_payload(self, src: Source, payload: bytes) -> None:
        with self.lock:
            try:
                self.ingestor.ingest(src.name, src.rank, payload)
            except DecodeError:
                src.counters.decode_errors += 1
                src._error("decode")
            except Exception:  # a bug must not kill the stream: count and keep going
                src.counters.decode_errors += 1
                src._error("internal")
                log.exception("failed to ingest a batch from %s", src.name)

    def _on_restart(self, src: Source) -> None:
        with self.lock:
            self.ingestor.restarted(src.name, src.rank, self.cfg.clear_on_restart)

    def start(self) -> None:
        if self.cfg.replay_on_start:
            for src in self.sources:
                src.request_replay(0)
        self._thread = threading.Thread(target=self._run, name="kvtier-ingest", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        dealers: dict[zmq.Socket, Source] = {}
        subs = {src.sub: src for src in self.sources}
        for sock in subs:
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            for src in self.sources:  # dealers are re-created on replay timeouts
                if src.dealer is not None and src.dealer not in dealers:
                    for old in [s for s, o in dealers.items() if o is src]:
                        poller.unregister(old)
                        del dealers[old]
                    dealers[src.dealer] = src
                    poller.register(src.dealer, zmq.POLLIN)
            if not subs and not dealers:
                # No event source (a daemon serving only the host tier): zmq's poll returns
                # at once with nothing to poll, and this loop would take a whole core.
                self._stop.wait(0.1)
                ready = {}
            else:
                try:
                    ready = dict(poller.poll(100))
                except zmq.ZMQError:
                    if self._stop.is_set():
                        break
                    raise
            for sock in ready:
                src = subs.get(sock)
                on = src.on_live if src is not None else None
                if src is None:
                    src = dealers.get(sock)
                    if src is None or sock is not src.dealer:
                        continue
                    on = src.on_replay
                for _ in range(256):  # drain, but stay fair between sockets
                    try:
                        frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    on(frames)
            now = time.monotonic()
            for src in self.sources:
                src.tick(now)
            self.expire(time.time())

    def expire(self, now: float) -> int:
        """Drop index entries whose TTL ran out (STORAGE with ``storage_ttl_s``)."""
        with self.lock:  # look-ups expire entries too
            return self.ingestor.expire(now)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.close()

    def close(self) -> None:
        for src in self.sources:
            src.close()
        if self._own_ctx:
            self.ctx.term()
