"""The rigs' servers run in a process group of their own, in the caller's session.

The group lets ``stop()`` end an engine's whole process tree. The session decides the
kernel's autogroup: a server busy decoding in a session of its own kept the benchmark's
client, ``redis-server`` and latency proxy off the CPU for seconds
(``rigs.openai_server.spawn_group``).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from rigs.openai_server import spawn_group


def _autogroup(pid: int | str) -> str | None:
    """The process's scheduling autogroup (``/autogroup-N nice 0``); None without them."""
    try:
        return Path(f"/proc/{pid}/autogroup").read_text().split()[0]
    except OSError:
        return None


def test_a_spawned_server_leads_its_own_group_in_the_callers_session() -> None:
    proc = spawn_group(["sleep", "60"])
    try:
        assert os.getpgid(proc.pid) == proc.pid
        assert os.getpgid(proc.pid) != os.getpgid(0)
        assert os.getsid(proc.pid) == os.getsid(0)
        assert _autogroup(proc.pid) == _autogroup("self")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
