"""Whom the host tier trusts, checked where it matters (ARCHITECTURE.md, "Trust on the host").

The daemon's side (:func:`prepare_socket_dir`): the directory it binds its socket in is its
own (owned by its uid, no symlink), writable by no one else (by the target group only in
group mode), and reached through directories no one else can rename (writable by root or
the daemon's uid only, or sticky like ``/tmp``). It creates a missing one 0700 (0710 with
the target group in group mode: members can reach the socket, not list the directory).

The client's side (:func:`check_daemon`, :meth:`TrustedDaemon.check_fd`,
:meth:`TrustedDaemon.check_mapping`): the process serving the socket (``SO_PEERCRED``)
runs as this client's own uid or as root (root reads every process's memory anyway:
refusing it would protect nothing), or, when the client names a group (group mode), in that
group: the group's members can write the segment, so the client trusts them with its KV.
Each file the daemon's welcome names is checked on the descriptor that is mapped, not on
the path: owned by the daemon's uid, nothing for others, group bits only for the group the
client trusts. Anything else is an :class:`UntrustedError` that names the path and the fix.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import pwd
import socket
import stat
import struct
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvtier.host_tier")

_PEERCRED = struct.Struct("3i")  # pid, uid, gid
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13
_SOCKET_DIR_FIX = ("remove it (the daemon recreates it, 0700) or choose --host-tier-socket "
                   "in a directory you own")


class UntrustedError(PermissionError):
    """A directory, file or peer the host tier does not trust; the message names the path,
    what was found and the fix."""


def resolve_group(group: int | str | None) -> int | None:
    """A group given by name or gid, as a gid; ``ValueError`` for an unknown name."""
    if group is None or isinstance(group, int):
        return group
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"host tier group {group!r} is not a group on this host") from None


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


def _who(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, group {st.st_gid}, mode {_mode(st)}"


# ---------------------------------------------------------------- the daemon's side
def prepare_socket_dir(socket_path: str, *, group: int | None = None) -> str:
    """Create (if missing) and check the directory the socket ``socket_path`` is bound in;
    returns it. :class:`UntrustedError` for a directory this daemon does not own alone."""
    parent = os.path.dirname(os.path.abspath(socket_path))
    uid = os.geteuid()
    try:
        st = os.lstat(parent)
    except FileNotFoundError:
        _make_dir(parent, group)
        st = os.lstat(parent)
    check_dir(parent, st, uid=uid, group=group)
    _check_ancestors(parent, uid)
    if group is not None:
        unreachable = _unreachable_by(parent, group)
        if unreachable:
            log.warning("host tier: members of group %d cannot reach %s: %s", group,
                        socket_path, unreachable)
    return parent


def _make_dir(path: str, group: int | None) -> None:
    """``path`` and its missing parents; ``path`` itself 0700 (0710 in ``group``), set on
    the directory opened without following a link, before anyone else can use it."""
    above = os.path.dirname(path)
    if not os.path.lexists(above):
        os.makedirs(above, mode=0o755, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return  # made meanwhile: checked as found
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if group is not None:
            os.fchown(fd, -1, group)
        os.fchmod(fd, 0o700 if group is None else 0o710)
    finally:
        os.close(fd)


def check_dir(path: str, st: os.stat_result, *, uid: int, group: int | None) -> None:
    """Refuse a socket directory (``st`` from ``lstat``) that is not ``uid``'s own."""
    if stat.S_ISLNK(st.st_mode):
        raise UntrustedError(f"host tier socket directory {path} is a symbolic link: "
                             f"{_SOCKET_DIR_FIX}")
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedError(f"host tier socket directory {path} is not a directory: "
                             f"{_SOCKET_DIR_FIX}")
    if st.st_uid != uid:
        raise UntrustedError(f"host tier socket directory {path} ({_who(st)}) is not owned "
                             f"by this daemon's uid {uid}: {_SOCKET_DIR_FIX}")
    if st.st_mode & stat.S_IWOTH:
        raise UntrustedError(f"host tier socket directory {path} ({_who(st)}) is writable by "
                             f"others: {_SOCKET_DIR_FIX}")
    if st.st_mode & stat.S_IWGRP and (group is None or st.st_gid != group):
        allowed = ("" if group is None
                   else f" (only the host tier's group {group} may write it)")
        raise UntrustedError(f"host tier socket directory {path} ({_who(st)}) is writable by "
                             f"group {st.st_gid}{allowed}: {_SOCKET_DIR_FIX}")


def _check_ancestors(path: str, uid: int) -> None:
    """No one but root and ``uid`` can rename anything on the way to ``path``: each
    directory above it is theirs and, when others may write it, sticky."""
    here = os.path.realpath(os.path.dirname(path))
    while True:
        st = os.stat(here)
        if st.st_uid not in (0, uid):
            raise UntrustedError(f"{here}, above the host tier socket directory {path}, "
                                 f"belongs to uid {st.st_uid} ({_who(st)}), who could replace "
                                 f"it: choose --host-tier-socket in a directory you own")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            raise UntrustedError(f"{here}, above the host tier socket directory {path}, is "
                                 f"writable by others without the sticky bit ({_who(st)}): "
                                 f"choose --host-tier-socket in a directory you own")
        if here == "/":
            return
        here = os.path.dirname(here)


def _unreachable_by(path: str, group: int) -> str:
    """Why members of ``group`` cannot search their way to ``path`` (empty: they can)."""
    here = os.path.realpath(path)
    while True:
        st = os.stat(here)
        if not (st.st_mode & stat.S_IXOTH
                or (st.st_gid == group and st.st_mode & stat.S_IXGRP)):
            return f"{here} is {_who(st)}"
        if here == "/":
            return ""
        here = os.path.dirname(here)


# ---------------------------------------------------------------- the client's side
@dataclass(frozen=True, slots=True)
class TrustedDaemon:
    """The process serving a host-tier socket, checked: its credentials, and the group this
    client trusts (None: its own uid and root only)."""

    socket_path: str
    pid: int
    uid: int
    gid: int
    group: int | None

    def check_fd(self, fd: int, path: str) -> os.stat_result:
        """Refuse a file the daemon's welcome names unless the descriptor ``fd`` is a
        regular file owned by the daemon's uid that others cannot open (group bits only
        for the trusted group)."""
        st = os.fstat(fd)
        fix = (f"it must be the daemon's (uid {self.uid}) own file, mode 0600 (0660 with "
               f"the group this engine trusts): stop whatever made it, remove it and restart "
               f"the daemon of {self.socket_path}")
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedError(f"host tier file {path} is not a regular file: {fix}")
        if st.st_uid != self.uid:
            raise UntrustedError(f"host tier file {path} ({_who(st)}) is not owned by the "
                                 f"daemon's uid {self.uid}: {fix}")
        if st.st_mode & 0o007:
            raise UntrustedError(f"host tier file {path} ({_who(st)}) is open to other "
                                 f"users: {fix}")
        if st.st_mode & 0o070 and (self.group is None or st.st_gid != self.group):
            hint = ("this engine trusts no group (set host_tier_group to trust its members)"
                    if self.group is None else f"this engine trusts group {self.group} only")
            raise UntrustedError(f"host tier file {path} ({_who(st)}) is shared with group "
                                 f"{st.st_gid}; {hint}: {fix}")
        return st

    def check_mapping(self, address: int, fd: int, path: str) -> None:
        """Refuse unless the mapping at ``address`` is of the file open as ``fd`` (checked
        with :meth:`check_fd`): the file checked is the file mapped."""
        st = self.check_fd(fd, path)
        if mapped_file(address) != (st.st_dev, st.st_ino):
            raise UntrustedError(f"host tier file {path} was replaced while it was mapped: "
                                 f"restart the daemon of {self.socket_path}")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process on the other end of a Unix socket."""
    return _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                            _PEERCRED.size))


def _peer_groups(sock: socket.socket) -> set[int]:
    """The supplementary groups of the peer (empty where the kernel cannot tell)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * 256)
    except OSError:
        return set()
    return set(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))


def _member(uid: int, gid: int, group: int, groups: set[int]) -> bool:
    if gid == group or group in groups:
        return True
    with contextlib.suppress(KeyError):
        user = pwd.getpwuid(uid)
        return user.pw_gid == group or user.pw_name in grp.getgrgid(group).gr_mem
    return False


def check_daemon(sock: socket.socket, socket_path: str, *,
                 group: int | None = None) -> TrustedDaemon:
    """The daemon connected on ``sock``, if this process trusts it: it runs as this
    process's uid or root, or (``group`` given) in ``group``. :class:`UntrustedError`
    otherwise."""
    pid, uid, gid = peer_credentials(sock)
    own = os.geteuid()
    if uid not in (own, 0) and not (group is not None
                                    and _member(uid, gid, group, _peer_groups(sock))):
        trusts = f"its own uid {own} and root" + (f" and group {group}" if group is not None
                                                  else "")
        raise UntrustedError(
            f"the host tier daemon on {socket_path} runs as uid {uid} (pid {pid}, group "
            f"{gid}); this engine trusts {trusts}: run `kvtier daemon` as uid {own} (or "
            f"point host_tier_socket at your own daemon's socket), or, to share a daemon, "
            f"run it with --host-tier-group and set host_tier_group to that group")
    return TrustedDaemon(socket_path, pid, uid, gid, group)


def mapped_file(address: int) -> tuple[int, int]:
    """(st_dev, st_ino) of the file mapped at ``address`` in this process."""
    with open("/proc/self/maps") as fh:
        for line in fh:
            fields = line.split(maxsplit=5)
            start, _, end = fields[0].partition("-")
            if int(start, 16) <= address < int(end, 16):
                major, _, minor = fields[3].partition(":")
                return os.makedev(int(major, 16), int(minor, 16)), int(fields[4])
    raise LookupError(f"nothing is mapped at {address:#x}")


def address_of(array: Any) -> int:
    """The address of a NumPy array's first byte (somewhere inside its mapping)."""
    return int(array.__array_interface__["data"][0])
