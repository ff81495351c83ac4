"""connector/demo/thread_times.py: CPU time by thread, read from /proc."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from connector.demo.thread_times import (
    all_processes,
    busiest,
    process_tree,
    thread_deltas,
    thread_times,
)
from offload_tiers.thread_names import name_current_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

BURN_S = 0.03


def _burn(ran: list[float], burnt: threading.Event, release: threading.Event) -> None:
    """Run on the CPU until this thread has used ``BURN_S`` of it, record how much, and
    stay alive (in /proc) until released."""
    name_current_thread()
    t0 = time.thread_time()
    while time.thread_time() - t0 < BURN_S:
        pass
    ran.append(time.thread_time() - t0)
    burnt.set()
    release.wait()


def test_a_named_threads_cpu_time_is_counted_under_its_name() -> None:
    before = thread_times(all_processes())
    ran: list[float] = []
    burnt, release = threading.Event(), threading.Event()
    worker = threading.Thread(target=_burn, args=(ran, burnt, release), name="kvtier-burn")
    worker.start()
    try:
        assert burnt.wait(600)
        after = thread_times([os.getpid()])
    finally:
        release.set()
        worker.join()
    burn = [(p, t) for p, t in after if t.startswith("kvtier-burn @")]
    assert len(burn) == 1, sorted(after)
    spent = thread_deltas(before, after)
    key = f"{burn[0][0]} / {burn[0][1]}"
    assert spent[key] >= ran[0] * 0.99  # the scheduler's run time: at least the CPU time
    assert key in busiest(spent, least_s=BURN_S * 0.9)
    assert any(t.startswith("MainThread") or "(main)" in t for _, t in after)


def test_the_process_tree_holds_a_child_and_busiest_sorts_and_filters() -> None:
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        assert process_tree(os.getpid())[0] == os.getpid()
        assert child.pid in process_tree(os.getpid())
    finally:
        child.communicate(b"")
    assert list(busiest({"a": 0.001, "b": 0.5, "c": 0.0001})) == ["b", "a"]
