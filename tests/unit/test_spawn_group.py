"""The rigs' servers run in a process group of their own, in the caller's session.

The group lets ``stop()`` end an engine's whole process tree. The session decides the
kernel's autogroup: a server busy decoding in a session of its own kept the benchmark's
client, ``redis-server`` and latency proxy off the CPU for seconds
(``rigs.openai_server.spawn_group``).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from rigs.openai_server import spawn_group


def _autogroup(pid: int | str) -> str | None:
    """The process's scheduling autogroup: ``/autogroup-N``, or ``""`` in the root group.

    A process whose session was never made by ``setsid`` since boot (a container's init
    and its children, for one) is in the root task group, and the kernel prints nothing.
    None where the kernel has no autogroups.
    """
    try:
        text = Path(f"/proc/{pid}/autogroup").read_text()
    except OSError:
        return None
    return text.split()[0] if text.strip() else ""


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


@pytest.mark.skipif(_autogroup("self") is None, reason="the kernel has no autogroups")
def test_a_child_in_a_session_of_its_own_gets_another_autogroup() -> None:
    """The control: what ``spawn_group`` avoids is visible to the check above."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        assert os.getsid(proc.pid) == proc.pid
        assert _autogroup(proc.pid) != _autogroup("self")
    finally:
        proc.kill()
        proc.wait()
