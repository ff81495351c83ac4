"""Issue 43 items 2, 8, 9 and 11: the host tier's leases belong to one daemon run, rows do
not leak while a process lives, a large snapshot goes out in chunks, and bad restores are
refused before anything is leased.

A real ``kvtier daemon --cpu-bytes`` process (and, for the snapshot, a ``HostTierServer``
in this process with small bounds), real Unix sockets and /dev/shm; clients in this process
and in child processes. Every wait is on an event (a client's state, the daemon's /stats,
a reply on the socket); no sleeps order anything.
"""

from __future__ import annotations

import os
import signal
import socket
import uuid
from pathlib import Path
from typing import Any

import pytest

from offload_tiers.host_tier import server as server_mod
from offload_tiers.host_tier.client import HostTierClient, new_save_id
from offload_tiers.host_tier.protocol import (
    PROTOCOL_VERSION,
    Commit,
    Committed,
    Hello,
    Lease,
    Leased,
    Refused,
    Restore,
    ToClient,
    ToDaemon,
    Welcome,
    decode_to_client,
    frame,
    split_frames,
)
from offload_tiers.host_tier.server import HostTierServer
from offload_tiers.shared_segment import digest
from rigs.daemon_proc import HostTierDaemon
from tests.daemon.test_host_tier_daemon import SLOT, WAIT_S, client, daemon, sock_path

__all__ = ["daemon", "sock_path"]  # the fixtures this module shares with its neighbour

class Raw:
    """A hand-driven connection: send messages, read replies in order."""

    def __init__(self, sock: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(WAIT_S)
        self.sock.connect(str(sock))
        self.inbox = bytearray()
        self.replies: list[ToClient] = []

    def send(self, message: ToDaemon) -> None:
        self.sock.sendall(frame(message))

    def reply(self) -> ToClient | None:
        """The next reply; None once the daemon closed the connection."""
        while not self.replies:
            data = self.sock.recv(1 << 20)
            if not data:
                return None
            self.inbox += data
            self.replies += [decode_to_client(b) for b in split_frames(self.inbox)]
        return self.replies.pop(0)

    def hello(self, **kw: Any) -> Welcome:
        self.send(Hello(PROTOCOL_VERSION, os.getpid(), "raw", **kw))
        welcome = self.reply()
        assert isinstance(welcome, Welcome), welcome
        return welcome

    def close(self) -> None:
        self.sock.close()


def test_a_commit_naming_another_daemon_run_frees_nothing(
        daemon: HostTierDaemon, sock_path: Path) -> None:
    """Item 2, the daemon's side: a commit of another run is refused whole, and the slot
    it names (leased to this connection in this run) stays leased: never freed under its
    holder, never leased to anyone else."""
    raw = Raw(sock_path)
    try:
        welcome = raw.hello()
        raw.send(Lease(1))
        leased = raw.reply()
        assert isinstance(leased, Leased) and len(leased.slots) == 1
        before = daemon.tier()
        raw.send(Commit("an-earlier-run", [(digest(b"k"), leased.slots[0], 7, 10)]))
        assert raw.reply() == Committed([], leased.slots)
        tier = daemon.tier()
        assert tier["stale_requests"] == 1
        assert tier["leased_slots"] == before["leased_slots"]  # still this row's
        assert tier["free_slots"] == before["free_slots"]
        assert tier["commits_rejected"] == before["commits_rejected"]
        assert welcome.instance != "an-earlier-run"
    finally:
        raw.close()


def test_a_write_in_flight_across_a_daemon_restart_is_never_committed(
        daemon: HostTierDaemon, sock_path: Path) -> None:
    """Item 2, the client's side: a save written into a slot leased from daemon run 1 is
    committed after the daemon restarted (run 2, same name). The client drops it
    (counted) and its new pool; run 2's books agree with what the client holds, so no
    slot ends up with two writers."""
    c = client(sock_path, subscribe=True)
    try:
        lease = c.take_slots(1)
        assert lease.segment is not None and len(lease.slots) == 1
        save_id = new_save_id()
        lease.segment.write(lease.slots[0], digest(b"old run"), save_id, b"x" * 64)
        first = c.instance
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait()
        again = HostTierDaemon(sock_path, daemon.name, slot_bytes=SLOT).start()
        try:
            assert c.wait_until(lambda c: c.available and c.instance != first
                                and len(c._pool) >= 1, WAIT_S), c.last_error
            c.commit(lease, [(digest(b"old run"), lease.slots[0], save_id, 64)])
            assert c.counters.commits_stale == 1
            # a later save on the same connection: once it is in the mirror, anything sent
            # before it was handled
            assert c.write(digest(b"new run"), b"y" * 64)
            assert c.wait_until(lambda c: digest(b"new run") in c.mirror, WAIT_S)
            tier = again.tier()
            assert tier["entries"] == 1 and tier["commits_rejected"] == 0
            assert digest(b"old run") not in c.mirror
            assert tier["leased_slots"] == len(c._pool)  # the daemon's books = the client's
        finally:
            again.kill()
            again.remove_files()
    finally:
        c.close()


def test_a_client_cut_off_again_and_again_keeps_one_row(
        daemon: HostTierDaemon, sock_path: Path) -> None:
    """Item 8: a live client whose connection the daemon closes five times (protocol
    errors) gets its own row back on each reconnect, with its leases: one row, not six,
    whatever the number of reconnects; its pool is the daemon's word for its leases."""
    before = daemon.tier()
    c = client(sock_path)
    try:
        row = c._attached.row if c._attached else None
        for n in range(1, 6):
            sock = c._sock
            assert sock is not None
            sock.sendall(b"\x00\x00\x00\x03bad")  # not a message: the daemon hangs up
            assert c.wait_until(lambda c, n=n: c.counters.connects == n + 1
                                and c.available, WAIT_S), c.last_error
            assert c._attached is not None and c._attached.row == row
        tier = daemon.tier()
        assert tier["protocol_errors"] == before["protocol_errors"] + 5
        assert tier["rows_reused"] == before["rows_reused"] + 5
        assert tier["quarantined_clients"] == 0
        assert tier["clients"] == before["clients"] + 1
        assert c.wait_until(lambda c: len(c._pool) == c.lease_batch, WAIT_S)
        assert daemon.tier()["leased_slots"] == before["leased_slots"] + c.lease_batch
    finally:
        c.close()


def test_a_clean_close_releases_the_row_at_once(daemon: HostTierDaemon,
                                                sock_path: Path) -> None:
    """Item 8: a client that closes with no write in flight and no pin says so; its row
    and leases come back now, not when its process exits (this one does not)."""
    before = daemon.tier()
    c = client(sock_path)
    c.close()
    tier = daemon.wait_for(lambda s: s["host_tier"]["clients"] == before["clients"],
                           what="the row's release")["host_tier"]
    assert tier["quarantined_clients"] == 0
    assert tier["leased_slots"] == before["leased_slots"]


def test_one_process_holds_a_bounded_number_of_rows(daemon: HostTierDaemon,
                                                    sock_path: Path) -> None:
    """Item 8: rows one process may hold at once are bounded; the next hello is refused
    with the reason, and every other process is still served."""
    conns = [Raw(sock_path) for _ in range(server_mod.MAX_ROWS_PER_PROCESS + 1)]
    try:
        for raw in conns[:-1]:
            raw.hello()
        conns[-1].send(Hello(PROTOCOL_VERSION, os.getpid(), "one too many"))
        refused = conns[-1].reply()
        assert isinstance(refused, Refused)
        assert f"process {os.getpid()} already holds" in refused.reason
    finally:
        for raw in conns:
            raw.close()


def test_a_restore_with_a_bad_item_is_refused_before_any_slot_is_leased(
        tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """Item 11: a restore whose digest has the wrong length, or whose save id is out of
    range, is a protocol error at the wire: that connection closes, no slot is leased."""
    with HostTierDaemon(tmp_path / "run" / "host.sock", f"bad-{uuid.uuid4().hex[:12]}",
                        slot_bytes=SLOT, redis_url=redis_url,
                        redis_prefix=key_prefix).running() as proc:
        key = ("f" * 16, 0, b"h" * 16, 16, 0)
        for item in [(b"short", key, 1, 100), (digest(b"k"), key, -1, 100),
                     (digest(b"k"), key, 1, SLOT + 1)]:
            before = proc.tier()
            raw = Raw(proc.sock)
            try:
                raw.hello()
                raw.send(Restore(1, [item]))
                assert raw.reply() is None  # closed
            finally:
                raw.close()
            tier = proc.wait_for(lambda s, b=before: s["host_tier"]["protocol_errors"]
                                 == b["protocol_errors"] + 1, what="the error")["host_tier"]
            assert tier["leased_slots"] == before["leased_slots"]
            assert tier["redis_restores_asked"] == 0


def test_a_snapshot_larger_than_the_backlog_reaches_the_subscriber_in_chunks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 9: a subscriber whose snapshot is larger than the backlog bound gets all of it
    (in bounded chunks) instead of being disconnected at its welcome, every time."""
    monkeypatch.setattr(server_mod, "SNAPSHOT_CHUNK", 10)
    monkeypatch.setattr(server_mod, "_SNAPSHOT_LOW_WATER", 512)
    entries = 16000  # ~0.5 MB of snapshot: past the socket's buffer and the backlog bound
    batch = server_mod.MAX_LEASE
    server = HostTierServer(name=f"snap-{uuid.uuid4().hex[:12]}", cpu_bytes=3 * entries * 64,
                            slot_bytes=64, socket_path=str(tmp_path / "run" / "host.sock"))
    server.start()
    writer = reader = None
    try:
        writer = HostTierClient(server.socket_path, label="writer", lease_batch=batch,
                                subscribe=True, retry_s=0.05).start()
        want = [digest(b"e%d" % i) for i in range(entries)]
        for start in range(0, entries, batch):
            chunk = want[start:start + batch]
            n = len(chunk)
            assert writer.wait_until(lambda c, n=n: len(c._pool) >= n, WAIT_S)
            for key in chunk:
                assert writer.write(key, b"v" * 64)
        # every commit made: the reader's welcome carries all of them
        assert writer.wait_until(lambda c: set(want) <= c.mirror.keys(), WAIT_S)
        monkeypatch.setattr(server_mod, "MAX_BACKLOG", 2048)  # read by the loop's flush
        reader = HostTierClient(server.socket_path, label="reader", subscribe=True,
                                lease_batch=0, retry_s=0.05).start()
        assert reader.wait_until(lambda c: set(want) <= c.mirror.keys(), WAIT_S), \
            reader.last_error
        assert reader.counters.connects == 1 and reader.counters.disconnects == 0
        assert server.stats()["backlog_disconnects"] == 0
    finally:
        for c in (writer, reader):
            if c is not None:
                c.close()
        server.stop()


def test_a_client_of_an_older_protocol_is_refused_with_the_reason(
        daemon: HostTierDaemon, sock_path: Path) -> None:
    """Protocol 3 changed commits (the daemon run they name), hellos and welcomes: a
    protocol-2 client gets a refusal that names both versions, then the connection ends."""
    raw = Raw(sock_path)
    try:
        raw.send(Hello(PROTOCOL_VERSION - 1, os.getpid(), "old kvtier"))
        refused = raw.reply()
        assert isinstance(refused, Refused)
        assert f"protocol version {PROTOCOL_VERSION - 1}" in refused.reason
        assert f"speaks {PROTOCOL_VERSION}" in refused.reason
        assert raw.reply() is None
    finally:
        raw.close()
    assert PROTOCOL_VERSION == 3
