"""Run a function in a forked child as another uid (the tests run as root).

The child is this test process forked: it has every module this process imported (the
interpreter's own files may be unreadable to the other uid, so import what the body needs
before forking). It reports JSON objects on a pipe (``say``) and stops when the parent
closes its end of another (``stopped``); it always ends with ``os._exit``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

#: Uids and gids with no other use on a test machine (nobody, nogroup and below).
NOBODY = 65534
OTHER_UID = 65533
THIRD_UID = 65532

Say = Callable[[dict[str, Any]], None]


class Child:
    def __init__(self, pid: int, out_fd: int, stop_fd: int) -> None:
        self.pid = pid
        self._out = os.fdopen(out_fd, "rb", buffering=0)
        self._stop_fd: int | None = stop_fd
        self._buf = b""

    def read(self, timeout: float = 60.0) -> dict[str, Any]:
        """The child's next report; raises if it ended or said nothing in ``timeout``."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._out], [], [], left)[0]:
                raise TimeoutError(f"child {self.pid} said nothing in {timeout} s")
            chunk = os.read(self._out.fileno(), 65536)
            if not chunk:
                raise EOFError(f"child {self.pid} ended without a report")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        report = json.loads(line)
        if "error" in report:
            raise AssertionError(f"child {self.pid} failed:\n{report['error']}")
        return report

    def stop(self, timeout: float = 30.0) -> int:
        """Tell it to stop (its ``stopped`` wait returns) and reap it; its exit status."""
        if self._stop_fd is not None:
            os.close(self._stop_fd)
            self._stop_fd = None
        pidfd = os.pidfd_open(self.pid)
        try:  # the exit itself, not a poll; the bound only ends a child that hangs
            if not select.select([pidfd], [], [], timeout)[0]:
                os.kill(self.pid, signal.SIGKILL)
        finally:
            os.close(pidfd)
        _, status = os.waitpid(self.pid, 0)
        self._out.close()
        return os.waitstatus_to_exitcode(status)


@contextlib.contextmanager
def as_user(uid: int, gid: int, groups: list[int],
            body: Callable[[Say, Callable[[], None]], None]) -> Iterator[Child]:
    """``body(say, stopped)`` in a child running as ``uid``/``gid`` with ``groups``;
    ``stopped()`` blocks until the parent is done with it. Reaped on exit."""
    out_r, out_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(out_r)
            os.close(stop_w)

            def say(report: dict[str, Any]) -> None:
                os.write(out_w, json.dumps(report).encode() + b"\n")

            def stopped() -> None:
                os.read(stop_r, 1)

            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            body(say, stopped)
        except BaseException:
            code = 1
            with contextlib.suppress(BaseException):
                os.write(out_w, json.dumps({"error": traceback.format_exc()}).encode() + b"\n")
        os._exit(code)
    os.close(out_w)
    os.close(stop_r)
    child = Child(pid, out_r, stop_w)
    try:
        yield child
    finally:
        child.stop()
