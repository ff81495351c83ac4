"""One daemon per host-tier name and socket (issue 43 item 7), with real ``kvtier daemon``
processes: a second one refuses, naming the first one's PID; a stop removes only the files
its own run created; a start that fails removes what it had created."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from offload_tiers.host_tier.client import HostTierClient
from offload_tiers.shared_segment import default_path, digest
from rigs.daemon_proc import REPO, HostTierDaemon

SLOT = 4096
WAIT_S = 60


def _files(name: str, sock: Path) -> list[Path]:
    """Every file a daemon of ``name`` on ``sock`` makes."""
    return [Path(default_path(name)), Path(default_path(f"{name}.pins")),
            Path(default_path(f"{name}.lock")), sock, Path(f"{sock}.lock")]


def _identity(path: Path) -> tuple[int, int]:
    st = path.lstat()
    return st.st_dev, st.st_ino


def _run_daemon(sock: Path, name: str) -> subprocess.CompletedProcess[str]:
    """A daemon expected to exit at start (bounded: one that serves instead times out)."""
    return subprocess.run(
        [sys.executable, "-m", "connector.daemon.cli", "--cpu-bytes", str(8 * SLOT),
         "--slot-bytes", str(SLOT), "--host-tier-socket", str(sock), "--host-tier-name", name,
         "--http", "127.0.0.1:0"],
        cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.fixture
def name() -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    for suffix in ("", ".pins", ".lock"):
        Path(default_path(name + suffix)).unlink(missing_ok=True)


def _serves(sock: Path) -> bool:
    c = HostTierClient(str(sock), label="test", lease_batch=1, retry_s=0.05).start()
    try:
        if not c.wait_until(lambda c: c.available and c.slots_at_hand > 0, WAIT_S):
            return False
        return c.write(digest(b"still serving"), b"kv" * 100)
    finally:
        c.close()


def test_a_second_daemon_on_one_name_or_socket_refuses_naming_the_first(
        tmp_path: Path, name: str) -> None:
    """Same name and socket, same name on another socket, same socket under another name:
    each second daemon exits 1 naming the first one's PID and the flag to change; the
    first one's files are the same files, and it still serves; stopped, it leaves none."""
    sock = tmp_path / "run" / "host.sock"
    first = HostTierDaemon(sock, name, slot_bytes=SLOT)
    with first.running():
        assert first.proc is not None
        pid = first.proc.pid
        data = [Path(default_path(name)), Path(default_path(f"{name}.pins")), sock]
        before = {p: _identity(p) for p in data}
        other_name = f"test-{uuid.uuid4().hex[:12]}"
        seconds = [(sock, name, "--host-tier-name"),
                   (tmp_path / "elsewhere" / "host.sock", name, "--host-tier-name"),
                   (sock, other_name, "--host-tier-socket")]
        try:
            for second_sock, second_name, flag in seconds:
                proc = _run_daemon(second_sock, second_name)
                assert proc.returncode == 1, (second_sock, second_name, proc.stderr)
                assert f"another kvtier daemon (pid {pid})" in proc.stderr, proc.stderr
                assert flag in proc.stderr, proc.stderr
                # no segment, pin table or lock file of its own left behind
                assert [p for p in _files(second_name, second_sock)
                        if p.exists() and p not in _files(name, sock)] == [], second_name
        finally:
            for suffix in ("", ".pins", ".lock"):
                Path(default_path(other_name + suffix)).unlink(missing_ok=True)
        assert {p: _identity(p) for p in data} == before
        assert _serves(sock)
        assert first.terminate() == 0
        assert [p for p in _files(name, sock) if p.exists()] == []


def test_a_stop_leaves_files_someone_else_put_in_place(tmp_path: Path, name: str) -> None:
    """The daemon's segment, pin table and socket are replaced under it (another run's
    files, as far as it can tell): its stop leaves them where they are."""
    sock = tmp_path / "run" / "host.sock"
    daemon = HostTierDaemon(sock, name, slot_bytes=SLOT)
    with daemon.running():
        for path in (Path(default_path(name)), Path(default_path(f"{name}.pins"))):
            replacement = path.with_name(path.name + ".new")
            replacement.write_bytes(b"someone else's")
            os.rename(replacement, path)
        sock.unlink()
        stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stranger.bind(str(sock))
        try:
            assert daemon.terminate() == 0
            for path in (Path(default_path(name)), Path(default_path(f"{name}.pins"))):
                assert path.read_bytes() == b"someone else's", path
            assert sock.exists()
            assert b"left " in daemon.output and b"not the file this daemon run" in \
                daemon.output
            # what it did create and still finds in place is gone
            assert not Path(default_path(f"{name}.lock")).exists()
            assert not Path(f"{sock}.lock").exists()
        finally:
            stranger.close()


def test_a_start_that_fails_after_creating_the_segment_leaves_nothing(
        tmp_path: Path, name: str) -> None:
    """The socket path is taken by a regular file: the daemon has made its segment and pin
    table when it finds out; it exits 1 and removes them (and its locks)."""
    sock = tmp_path / "run" / "host.sock"
    sock.parent.mkdir(mode=0o700)
    sock.write_text("not a socket")
    proc = _run_daemon(sock, name)
    assert proc.returncode == 1, proc.stderr
    assert f"{sock} exists and is not a socket" in proc.stderr
    assert [p for p in _files(name, sock) if p.exists()] == [sock]
    assert sock.read_text() == "not a socket"
