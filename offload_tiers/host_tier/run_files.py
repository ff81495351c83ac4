"""The files one run of the host-tier daemon owns: its locks, and what it created.

One daemon per name and per socket: a run holds an exclusive ``flock`` on a lock file for
each (``/dev/shm/kvtier-<name>.lock`` for the segment and pin table, ``<socket>.lock``
beside the socket) for its lifetime, with its PID in it; a second run refuses, naming that
PID. The lock files are created 0600 without following a link and must be this user's.

A run removes only what it created: :class:`RunFiles` records each file's ``st_dev`` and
``st_ino`` when it is made and unlinks a path only while it still names that file (a file
someone put there since is left alone, and said so).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat

from offload_tiers.host_tier.trust import UntrustedError

log = logging.getLogger("kvtier.host_tier")


class DaemonRunning(OSError):
    """Another daemon run holds the lock; the message names its PID and the fix."""


class RunLock:
    """An exclusive lock on ``path`` held for one daemon run (``what`` and ``fix`` word the
    refusal: what the lock guards, and how to start this one anyway)."""

    def __init__(self, path: str, what: str, fix: str) -> None:
        self.path = path
        self.what = what
        self.fix = fix
        self._fd: int | None = None
        self._identity: tuple[int, int] | None = None

    def acquire(self) -> None:
        # the holder unlinks the file when it stops: a lock taken on a file no longer at
        # the path is no lock; take it again on the file that is there
        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                    raise UntrustedError(
                        f"lock file {self.path} (owner uid {st.st_uid}, mode "
                        f"{stat.S_IMODE(st.st_mode):04o}) is not this user's (uid "
                        f"{os.geteuid()}) regular file: remove it, or {self.fix}")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                    raise DaemonRunning(
                        f"another kvtier daemon (pid {pid}) serves {self.what}: it holds "
                        f"{self.path}; stop it (kill {pid}), or {self.fix}") from None
                try:
                    now = os.lstat(self.path)
                except FileNotFoundError:
                    now = None
                if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                    os.close(fd)
                    continue
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise
            self._fd, self._identity = fd, (st.st_dev, st.st_ino)
            return
        raise DaemonRunning(f"{self.path} kept being replaced while this daemon locked it")

    def release(self) -> None:
        """Remove the lock file (while still holding it), then let go."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        assert self._identity is not None
        remove_if_same(self.path, self._identity)
        os.close(fd)


def identity(path: str) -> tuple[int, int]:
    """(st_dev, st_ino) of ``path`` itself (a link is not followed)."""
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def remove_if_same(path: str, ident: tuple[int, int]) -> bool:
    """Unlink ``path`` if it still names the file ``ident``; else leave it (logged)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if (st.st_dev, st.st_ino) != ident:
        log.warning("host tier: left %s in place: it is not the file this daemon run "
                    "created (someone replaced it)", path)
        return False
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return True


class RunFiles:
    """Files this run created, by identity; :meth:`remove` unlinks those still in place."""

    def __init__(self) -> None:
        self.created: dict[str, tuple[int, int]] = {}

    def add(self, path: str, ident: tuple[int, int] | None = None) -> None:
        self.created[path] = ident if ident is not None else identity(path)

    def remove(self) -> None:
        while self.created:
            path, ident = self.created.popitem()
            remove_if_same(path, ident)


def share_file(path: str, ident: tuple[int, int], *, mode: int, group: int | None) -> None:
    """Give the file this run created at ``path`` (private so far) its group, then its
    ``mode``, on a descriptor of that very file: it is never open to any other group."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != ident:
            raise UntrustedError(f"{path} was replaced after this daemon created it")
        if group is not None:
            os.fchown(fd, -1, group)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
