"""The host tier end to end: a real ``kvtier daemon --cpu-bytes`` process, real Unix
sockets and /dev/shm, clients in this process and in child processes that get SIGKILLed.

Every wait is on the event itself (a client's mirror or connection state, the daemon's
/stats, a child's "ready" line); no sleeps order anything.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from offload_tiers.host_tier.client import HostTierClient
from offload_tiers.shared_segment import digest
from rigs.daemon_proc import REPO, HostTierDaemon

SLOT = 4096
WAIT_S = 60  # bounds a hung wait only; nothing is ordered by it


@pytest.fixture
def sock_path(tmp_path: Path) -> Path:
    return tmp_path / "run" / "host.sock"


@pytest.fixture
def daemon(sock_path: Path) -> Iterator[HostTierDaemon]:
    with HostTierDaemon(sock_path, f"test-{uuid.uuid4().hex[:12]}",
                        slot_bytes=SLOT).running() as proc:
        yield proc


def client(sock: Path, **kw: Any) -> HostTierClient:
    c = HostTierClient(str(sock), label="test", lease_batch=2, retry_s=0.05, **kw).start()
    assert c.wait_until(lambda c: c.available and len(c._pool) >= 1, WAIT_S), c.last_error
    return c


def child(sock: Path, body: str) -> tuple[subprocess.Popen[str], list[str]]:
    """A Python child process running ``body`` with a client ``c`` connected; returns
    once it printed ``ready``, with the lines it printed before."""
    code = textwrap.dedent(f"""
        import sys
        from offload_tiers.host_tier.client import HostTierClient
        from offload_tiers.shared_segment import digest
        c = HostTierClient({str(sock)!r}, label="child", lease_batch=2, retry_s=0.05).start()
        assert c.wait_until(lambda c: c.available and len(c._pool) >= 2, 60), c.last_error
    """) + textwrap.dedent(body) + "\nprint('ready', flush=True)\nsys.stdin.read()\n"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    lines = []
    while (line := proc.stdout.readline().strip()) != "ready":
        assert line, f"the child exited ({proc.wait()}) before it was ready"
        lines.append(line)
    return proc, lines


def test_two_engines_share_one_copy_and_the_files_are_private(
        daemon: HostTierDaemon, sock_path: Path) -> None:
    a = client(sock_path)
    b = client(sock_path, subscribe=True)
    try:
        payload = bytes(range(256)) * 8
        assert a.write(digest(b"prefix-1"), payload)
        assert b.wait_until(lambda c: digest(b"prefix-1") in c.mirror, WAIT_S)
        where = b.lookup(digest(b"prefix-1"))
        assert where is not None and where.length == len(payload)
        out = bytearray(len(payload))
        assert b.read_into(digest(b"prefix-1"), where, out) and bytes(out) == payload
        # the second engine stores the same prefix: one set of slots
        assert b.write(digest(b"prefix-1"), payload)
        tier = daemon.wait_for(lambda s: s["host_tier"]["duplicates_dropped"] == 1,
                               what="the duplicate")["host_tier"]
        assert tier["entries"] == 1 and tier["commits"] == 1
        assert "kvtier_host_tier_entries 1.0" in daemon.get("/metrics")
        thp = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
        if thp.exists():  # asked for; the kernel's setting reported
            assert f"[{tier['huge_pages']}]" in thp.read_text()
        else:
            assert tier["huge_pages"] == "unknown"
        for path in (sock_path, Path(f"/dev/shm/kvtier-{daemon.name}"),
                     Path(f"/dev/shm/kvtier-{daemon.name}.pins")):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert stat.S_IMODE(sock_path.parent.stat().st_mode) == 0o700
    finally:
        a.close()
        b.close()


def test_a_writer_killed_mid_save_leaves_nothing_served(
        daemon: HostTierDaemon, sock_path: Path) -> None:
    proc, printed = child(sock_path, """
        [slot] = c.take_slots(1).slots
        row = c.segment.begin_write(slot)
        row[:8] = list(b"halfdone")  # never committed
        print(slot, flush=True)
    """)
    slot = int(printed[0])
    proc.kill()
    proc.wait()
    tier = daemon.wait_for(lambda s: s["host_tier"]["clients_released"] >= 1,
                           what="the killed writer's release")["host_tier"]
    assert tier["leases_reclaimed"] >= 1 and tier["entries"] == 0
    assert tier["abandoned_writes"] == 1  # the one write it began
    reader = client(sock_path, subscribe=True)
    try:
        head = reader.segment.header(slot)
        assert head.seq % 2 == 0 and head.flags == 0  # invalidated, not "being written"
        assert reader.mirror == {}
    finally:
        reader.close()


def test_a_killed_readers_pins_are_released(daemon: HostTierDaemon, sock_path: Path) -> None:
    proc, _ = child(sock_path, "c.pin([0, 1, 2])")
    proc.kill()
    proc.wait()
    tier = daemon.wait_for(lambda s: s["host_tier"]["pins_reclaimed"] == 3,
                           what="the pins' release")["host_tier"]
    assert tier["clients_released"] >= 1


def test_a_live_client_cut_off_keeps_its_leases_until_it_exits(
        daemon: HostTierDaemon, sock_path: Path) -> None:
    """The daemon closes a connection that breaks the protocol; the process may still be
    copying into the slots it leased, so they are not reused until it exits."""
    before = daemon.tier()
    proc, _ = child(sock_path, """
        c._sock.sendall(b"\\x00\\x00\\x00\\x03bad")  # not a message: the daemon hangs up
        assert c.wait_until(lambda c: not c.available, 60)
    """)
    tier = daemon.wait_for(lambda s: s["host_tier"]["protocol_errors"] == 1,
                           what="the protocol error")["host_tier"]
    assert tier["quarantined_clients"] == 1
    assert tier["leased_slots"] >= before["leased_slots"] + 2
    assert tier["clients_released"] == before["clients_released"]
    proc.kill()
    proc.wait()
    tier = daemon.wait_for(lambda s: s["host_tier"]["quarantined_clients"] == 0,
                           what="the exit")["host_tier"]
    assert tier["leases_reclaimed"] >= before["leases_reclaimed"] + 2


def test_garbage_on_the_socket_closes_that_connection_only(
        daemon: HostTierDaemon, sock_path: Path) -> None:
    good = client(sock_path, subscribe=True)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(str(sock_path))
            raw.sendall(struct.pack(">I", 5) + b"\xc1junk")
            assert raw.recv(1) == b""  # closed by the daemon
        assert daemon.tier()["protocol_errors"] == 1
        assert good.write(digest(b"still"), b"served")
        assert good.wait_until(lambda c: digest(b"still") in c.mirror, WAIT_S)
    finally:
        good.close()


def test_daemon_killed_then_back_engines_miss_then_reattach(
        daemon: HostTierDaemon, sock_path: Path) -> None:
    c = client(sock_path, subscribe=True)
    try:
        assert c.write(digest(b"before"), b"x" * 64)
        assert c.wait_until(lambda c: digest(b"before") in c.mirror, WAIT_S)
        first = c.instance
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait()
        assert c.wait_until(lambda c: not c.available, WAIT_S)
        assert c.lookup(digest(b"before")) is None
        assert c.take_slots(1).slots == () and not c.write(digest(b"during"), b"y")
        assert c.counters.slots_short >= 1
        again = HostTierDaemon(sock_path, daemon.name, slot_bytes=SLOT).start()  # same name
        try:
            assert c.wait_until(lambda c: c.available and c.instance != first, WAIT_S)
            assert c.mirror == {}  # a new run: an empty tier
            assert c.wait_until(lambda c: len(c._pool) >= 1, WAIT_S)
            assert c.write(digest(b"after"), b"z" * 64)
            assert c.wait_until(lambda c: digest(b"after") in c.mirror, WAIT_S)
            assert c.counters.disconnects == 1 and c.counters.connects == 2
        finally:
            again.kill()
    finally:
        c.close()


def test_bad_host_tier_settings_fail_with_the_setting_named(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "connector.daemon.cli", "--cpu-bytes", "1k", "--slot-bytes",
         "2k", "--host-tier-socket", str(tmp_path / "s")],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "cpu_bytes" in proc.stderr and "slot_bytes" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "connector.daemon.cli"], cwd=REPO,
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ))
    assert proc.returncode == 2 and "publishers" in proc.stderr and "cpu_bytes" in proc.stderr


def test_the_daemon_s_redis_writer_keeps_a_short_linger(tmp_path: Path, redis_url: str,
                                                        key_prefix: str) -> None:
    """The host tier's shared slots stay held until written: its writer does not wait the
    connector's 200 ms for more stores."""
    from connector.daemon.config import DaemonConfig
    from connector.daemon.parts import build_parts
    from offload_tiers.redis.settings import SHORT_WRITE_LINGER_S, WRITE_LINGER_S

    cfg = DaemonConfig(cpu_bytes=64 << 20, redis_url=redis_url, redis_prefix=key_prefix,
                       host_tier_socket=str(tmp_path / "s"),
                       host_tier_name=f"test-{uuid.uuid4().hex[:8]}")
    parts = build_parts(cfg)  # not started: no segment, no socket
    server = parts.host_tier
    assert server is not None and parts.presence_feed is not None
    try:
        assert server._redis._writer._linger_s == SHORT_WRITE_LINGER_S < WRITE_LINGER_S
    finally:
        parts.presence_feed.close()
        server._redis.close()
