"""Who the host tier trusts (issue 43 items 5 and 6), with real processes and real uids.

The tests run as root; a second user is a forked child that ``setuid``s to nobody (65534)
or another unused uid. A daemon refuses a socket directory it does not own alone; a client
refuses a daemon of another uid (unless it trusts the daemon's group) and a segment or pin
table that is not the daemon's own; in group mode the files are the group's from the first
instant, and a member of another uid attaches.
"""

# ruff: noqa: S103  (permissive modes are what these tests throw at the host tier)
from __future__ import annotations

import grp  # imported before forking: a child of another uid cannot
import logging
import os
import pwd  # noqa: F401
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from offload_tiers.host_tier import trust
from offload_tiers.host_tier.client import HostTierClient
from offload_tiers.host_tier.pins import PinTable
from offload_tiers.host_tier.server import HostTierServer
from offload_tiers.shared_segment import SharedSegment, default_path, digest
from rigs.daemon_proc import REPO
from tests.support.as_user import NOBODY, OTHER_UID, THIRD_UID, Say, as_user

SLOT = 4096
WAIT_S = 30
try:  # "users": a group root and nobody are not in by default
    GROUP = grp.getgrnam("users").gr_gid
except KeyError:
    GROUP = -1
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to be another uid"),
    pytest.mark.skipif(GROUP < 0, reason="needs the group 'users'"),
]


def _name() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def _remove_segment(name: str) -> None:
    for suffix in ("", ".pins", ".lock"):
        Path(default_path(name + suffix)).unlink(missing_ok=True)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory under /tmp owned by nobody (a daemon of that uid makes its socket
    directory in it); removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="kvtier-trust-", dir="/tmp"))
    os.chmod(path, 0o755)
    os.chown(path, NOBODY, NOBODY)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _daemon_body(sock: Path, name: str, *, group: int | None = None, mode: int | None = None
                 ) -> Callable[[Say, Callable[[], None]], None]:
    if mode is None:
        mode = 0o600 if group is None else 0o660

    def body(say: Say, stopped: Callable[[], None]) -> None:
        server = HostTierServer(name=name, cpu_bytes=8 * SLOT, slot_bytes=SLOT,
                                socket_path=str(sock), mode=mode, group=group)
        server.start()
        say({"pid": os.getpid(), "uid": os.geteuid()})
        stopped()
        server.stop()
    return body


def _client_body(sock: Path, *, group: int | str | None = None, write: bool = False
                 ) -> Callable[[Say, Callable[[], None]], None]:
    def body(say: Say, stopped: Callable[[], None]) -> None:
        warnings: list[str] = []

        class Catch(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                warnings.append(record.getMessage())

        logging.getLogger("kvtier.host_tier").addHandler(Catch(logging.WARNING))
        trusting = {"group": group} if group is not None else {}
        c = HostTierClient(str(sock), label="other uid", lease_batch=1, retry_s=0.02,
                           **trusting).start()
        c.wait_until(lambda c: (c.available and c.slots_at_hand > 0) or bool(c.last_error),
                     WAIT_S)
        wrote = False
        if write and c.available:
            payload = b"group member's KV" * 100
            wrote = c.write(digest(b"member"), payload)
        # several more tries (every 20 ms): the refusal is still logged once
        c.wait_until(lambda c: c.available or c.counters.attempts >= 10, WAIT_S)
        report = {"available": c.available, "connects": c.counters.connects,
                  "last_error": c.last_error, "warnings": warnings, "wrote": wrote}
        c.close()
        say(report)
    return body


# ---------------------------------------------------------------- 43.5: the daemon's side
def _start_daemon(sock: Path, name: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "connector.daemon.cli", "--cpu-bytes", str(8 * SLOT),
         "--slot-bytes", str(SLOT), "--host-tier-socket", str(sock), "--host-tier-name", name,
         "--http", "127.0.0.1:0"],
        cwd=REPO, capture_output=True, text=True, timeout=60)


def test_a_daemon_refuses_a_socket_directory_it_does_not_own(tmp_path: Path) -> None:
    """A root daemon refuses, naming the directory, its owner and mode and the fix: a
    directory owned by nobody, one others may write, one its group may write, a symbolic
    link, and a directory inside one that others may write without the sticky bit.
    Nothing is created in /dev/shm."""
    cases: dict[str, tuple[Path, str]] = {}
    nobody = tmp_path / "nobody"
    nobody.mkdir(mode=0o700)
    os.chown(nobody, NOBODY, NOBODY)
    cases["owned by nobody"] = (nobody, f"owner uid {NOBODY}")
    wide = tmp_path / "wide"
    wide.mkdir()
    os.chmod(wide, 0o777)
    cases["world-writable"] = (wide, "writable by others")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o770)
    os.chown(shared, 0, GROUP)
    cases["group-writable"] = (shared, f"writable by group {GROUP}")
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    cases["symlink"] = (link, "is a symbolic link")
    open_above = tmp_path / "open"
    open_above.mkdir()
    os.chmod(open_above, 0o777)
    (open_above / "run").mkdir(mode=0o700)
    cases["ancestor"] = (open_above / "run", "writable by others without the sticky bit")
    for what, (directory, said) in cases.items():
        name = _name()
        try:
            proc = _start_daemon(directory / "host.sock", name)
            assert proc.returncode == 1, (what, proc.stdout, proc.stderr)
            assert said in proc.stderr, (what, proc.stderr)
            assert "--host-tier-socket" in proc.stderr, (what, proc.stderr)
            assert not list(directory.iterdir()), what
            for suffix in ("", ".pins", ".lock"):
                assert not Path(default_path(name + suffix)).exists(), (what, suffix)
        finally:
            _remove_segment(name)
    # a directory it makes is 0700 and its own
    made = tmp_path / "made" / "run"
    server = HostTierServer(name=_name(), cpu_bytes=8 * SLOT, slot_bytes=SLOT,
                            socket_path=str(made / "host.sock"))
    server.start()
    try:
        st = made.lstat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o700)
    finally:
        server.stop()


# ---------------------------------------------------------------- 43.5: the client's side
def test_a_client_refuses_a_daemon_of_another_uid(shared_dir: Path) -> None:
    """A daemon runs as nobody and opens its socket, segment and pin table to everyone
    (as one that wants another user's engine to attach would); a client of another uid
    refuses it (SO_PEERCRED), never attaches, and says why once; a client of nobody's own
    uid refuses its files open to others, and attaches to nobody's daemon that keeps them
    0600."""
    sock = shared_dir / "run" / "host.sock"
    name, private = _name(), _name()
    try:
        with as_user(NOBODY, NOBODY, [NOBODY],
                     _daemon_body(sock, name, mode=0o666)) as daemon:
            started = daemon.read()
            assert started["uid"] == NOBODY
            os.chmod(sock.parent, 0o711)  # and its directory: the other uid reaches it
            with as_user(OTHER_UID, OTHER_UID, [OTHER_UID], _client_body(sock)) as other:
                refused = other.read()
            assert not refused["available"] and refused["connects"] == 0, refused
            assert f"runs as uid {NOBODY} (pid {started['pid']}" in refused["last_error"]
            assert str(sock) in refused["last_error"]
            assert "UntrustedError" in refused["last_error"]
            said = [w for w in refused["warnings"] if "not using the host tier" in w]
            assert len(said) == 1, refused["warnings"]
            with as_user(NOBODY, NOBODY, [NOBODY], _client_body(sock)) as same:
                opened = same.read()
            assert not opened["available"] and opened["connects"] == 0, opened
            assert "is open to other users" in opened["last_error"], opened
        sock = shared_dir / "private" / "host.sock"
        with as_user(NOBODY, NOBODY, [NOBODY], _daemon_body(sock, private)) as daemon:
            daemon.read()
            with as_user(NOBODY, NOBODY, [NOBODY], _client_body(sock, write=True)) as same:
                welcomed = same.read()
            assert welcomed["available"] and welcomed["wrote"], welcomed
    finally:
        _remove_segment(name)
        _remove_segment(private)


def _swap(path: str, *, uid: int = 0, gid: int = 0, mode: int = 0o600,
          pins: bool = False) -> None:
    """Replace ``path`` with a well-formed table of the same shape owned by uid:gid with
    ``mode`` (what another user, or a careless one, could put there)."""
    other = f"{path}.swap"
    if pins:
        src = PinTable.attach(path)
        PinTable.create(other, src.rows, src.num_slots).close()
        src.close()
    else:
        seg = SharedSegment.attach(path)
        SharedSegment.create(other, seg.num_slots, seg.slot_bytes).close()
        seg.close()
    os.chown(other, uid, gid)
    os.chmod(other, mode)
    os.rename(other, path)


@pytest.mark.parametrize(("what", "swap", "said"), [
    ("segment of another uid", {"uid": NOBODY}, "is not owned by the daemon's uid 0"),
    ("segment open to others", {"mode": 0o604}, "is open to other users"),
    ("pin table shared with a group", {"mode": 0o660, "gid": GROUP, "pins": True},
     f"is shared with group {GROUP}; this engine trusts no group"),
])
def test_a_client_refuses_a_segment_or_pin_table_not_the_daemons(
        tmp_path: Path, what: str, swap: dict[str, Any], said: str) -> None:
    """The daemon is trusted (root), but a file its welcome names is not its own: the
    client checks the descriptor it maps, refuses with the path and the fix, never
    attaches."""
    name = _name()
    sock = tmp_path / "run" / "host.sock"
    server = HostTierServer(name=name, cpu_bytes=8 * SLOT, slot_bytes=SLOT,
                            socket_path=str(sock))
    server.start()
    try:
        path = server.pins_path if swap.get("pins") else server.segment_path
        _swap(path, **swap)
        c = HostTierClient(str(sock), lease_batch=1, retry_s=0.02).start()
        try:
            assert c.wait_until(lambda c: c.available or bool(c.last_error), WAIT_S)
            assert not c.available and c.counters.connects == 0, what
            assert said in c.last_error and path in c.last_error, c.last_error
            assert "restart the daemon" in c.last_error, c.last_error
        finally:
            c.close()
        if swap.get("pins"):  # trusting the group: the same table is accepted
            c = HostTierClient(str(sock), lease_batch=1, retry_s=0.02, group=GROUP).start()
            try:
                assert c.wait_until(lambda c: c.available, WAIT_S), c.last_error
            finally:
                c.close()
    finally:
        server.stop()
        _remove_segment(name)


# ---------------------------------------------------------------- 43.6: group mode
def test_group_mode_files_are_the_groups_from_the_first_instant(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every state the segment, the pin table, the socket and its new directory pass
    through while the daemon creates them (seen around each chmod/chown the daemon makes):
    nothing for others, group bits only with the target group; at the end 0660 (the
    directory 0710) and the target group's."""
    seen: list[tuple[str, int, int]] = []  # (what, mode, gid)

    def spy(fn: Callable[..., Any], by_fd: bool) -> Callable[..., Any]:
        def call(target: Any, *args: Any, **kwargs: Any) -> Any:
            def look(when: str) -> None:
                st = os.fstat(target) if by_fd else os.lstat(target)
                seen.append((f"{fn.__name__} {when} {target}", st.st_mode, st.st_gid))
            look("before")
            out = fn(target, *args, **kwargs)
            look("after")
            return out
        return call

    for fn_name, by_fd in (("fchmod", True), ("fchown", True), ("chmod", False),
                           ("chown", False)):
        monkeypatch.setattr(os, fn_name, spy(getattr(os, fn_name), by_fd))
    name = _name()
    sock = tmp_path / "run" / "host.sock"
    server = HostTierServer(name=name, cpu_bytes=8 * SLOT, slot_bytes=SLOT,
                            socket_path=str(sock), mode=0o660, group=GROUP)
    try:
        server.start()
        monkeypatch.undo()
        for what, mode, gid in seen:
            assert not mode & 0o007, (what, oct(mode))
            assert not mode & 0o070 or gid == GROUP, (what, oct(mode), gid)
        for path in (server.segment_path, server.pins_path, str(sock)):
            st = os.lstat(path)
            assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, GROUP), path
        st = sock.parent.lstat()
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o710, GROUP)
        assert len(seen) >= 8  # both tables and the directory went through the spy
    finally:
        monkeypatch.undo()
        server.stop()
        _remove_segment(name)


def test_a_group_member_of_another_uid_attaches_in_group_mode(shared_dir: Path) -> None:
    """A daemon of nobody with --host-tier-group users (its primary group another one); a
    client of a third uid in that group, trusting it, attaches and writes; the same
    client not trusting the group refuses the daemon; a uid outside the group cannot reach
    the socket."""
    sock = shared_dir / "run" / "host.sock"
    name = _name()
    try:
        with as_user(NOBODY, OTHER_UID, [OTHER_UID, GROUP],
                     _daemon_body(sock, name, group=GROUP)) as daemon:
            daemon.read()
            st = sock.parent.lstat()  # members reach the socket, others do not
            assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (NOBODY, GROUP, 0o710)
            for path in (default_path(name), default_path(name + ".pins"), str(sock)):
                st = os.lstat(path)
                assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (
                    NOBODY, GROUP, 0o660), path
            with as_user(THIRD_UID, GROUP, [GROUP],
                         _client_body(sock, group="users", write=True)) as member:
                welcomed = member.read()
            assert welcomed["available"] and welcomed["wrote"], welcomed
            with as_user(THIRD_UID, GROUP, [GROUP], _client_body(sock)) as untrusting:
                refused = untrusting.read()
            assert not refused["available"] and refused["connects"] == 0, refused
            assert f"runs as uid {NOBODY}" in refused["last_error"], refused
            with as_user(THIRD_UID, THIRD_UID, [THIRD_UID],
                         _client_body(sock, group=GROUP)) as outsider:
                unreachable = outsider.read()
            assert not unreachable["available"], unreachable
            assert "Permission denied" in unreachable["last_error"], unreachable
    finally:
        _remove_segment(name)


def test_resolve_group_names_an_unknown_group() -> None:
    assert trust.resolve_group("users") == GROUP == trust.resolve_group(str(GROUP))
    with pytest.raises(ValueError, match="no-such-group"):
        trust.resolve_group("no-such-group")
