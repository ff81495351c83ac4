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
from offload_tiers.thread_names import name_current_thread, name_native_thread

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


def test_a_named_threads_cpu_time_is_counted_under_its_name_even_once_renamed() -> None:
    before = thread_times(all_processes())
    ran: list[float] = []
    burnt, release = threading.Event(), threading.Event()
    worker = threading.Thread(target=_burn, args=(ran, burnt, release), name="kvtier-burn")
    worker.start()
    try:
        assert burnt.wait(600)
        early = thread_times([os.getpid()])
        worker.name = "kvtier-renamed"  # a thread's name may change between readings
        name_native_thread(worker)
        after = thread_times([os.getpid()])
    finally:
        release.set()
        worker.join()
    assert worker.native_id is not None
    assert early[worker.native_id][1].startswith("kvtier-burn @")
    process, thread, _ = after[worker.native_id]
    assert thread.startswith("kvtier-renamed @")
    spent = thread_deltas(early, after)  # the burn was before both: next to nothing since
    assert spent[f"{process} / {thread}"] < ran[0] / 2
    spent = thread_deltas(before, after)  # started after ``before``: counted whole
    assert spent[f"{process} / {thread}"] >= ran[0] * 0.99  # run time >= its CPU time
    assert f"{process} / {thread}" in busiest(spent, least_s=BURN_S * 0.9)
    assert any("(main)" in t for _, t, _ in after.values())


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
