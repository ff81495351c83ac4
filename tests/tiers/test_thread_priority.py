"""Threads nothing waits on run at a higher niceness than the threads that started them.

The Redis writer (write-behind) and the presence feed yield the CPU to the engine's own
threads (``offload_tiers/thread_priority.py``); each thread's niceness is read back from
``/proc/self/task/TID/stat``, not from the call that set it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from offload_tiers import thread_priority
from offload_tiers.redis.client import ClientFactory
from offload_tiers.redis.presence_feed import PresenceFeed
from offload_tiers.redis.url import parse_redis_url
from offload_tiers.redis.write_behind import Item, WriteBehind
from tests.tiers.faults import wait_until

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux /proc")


def niceness(tid: int) -> int:
    """A thread's niceness as the kernel reports it (field 19 of its stat line)."""
    with open(f"/proc/self/task/{tid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[16])


@pytest.fixture(autouse=True)
def unset() -> Iterator[None]:
    """Each test starts from 0 (a connector built earlier in this process may have set it)."""
    saved = thread_priority.background_nice()
    thread_priority.set_background_nice(0)
    yield
    thread_priority.set_background_nice(saved)


def test_a_process_starts_with_no_background_niceness() -> None:
    """The storage tiers alone (daemon, native tier, LMCache adapter) change no thread's
    priority; the vLLM connector sets its ``background_nice``."""
    out = subprocess.run(
        [sys.executable, "-c", "from offload_tiers import thread_priority as t; "
                               "print(t.background_nice())"],
        capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2])
    assert out.stdout.strip() == "0"


def _writer_niceness() -> int:
    """Start a writer, wait until its thread has written one item, read its niceness."""
    written = threading.Event()

    def sink(batch: Sequence[Item]) -> list[bool]:
        written.set()
        return [True] * len(batch)

    writer = WriteBehind(sink, max_items=4, max_bytes=1 << 20, batch_items=1)
    try:
        assert writer.submit(Item(b"k", b"v", 1, None))
        assert written.wait(30)
        tid = writer._thread.native_id
        assert tid is not None
        return niceness(tid)
    finally:
        writer.close()


def test_the_writer_thread_runs_at_the_background_niceness() -> None:
    mine = niceness(threading.get_native_id())
    thread_priority.set_background_nice(thread_priority.BACKGROUND_NICE)
    assert _writer_niceness() == min(19, mine + thread_priority.BACKGROUND_NICE)
    assert niceness(threading.get_native_id()) == mine  # the caller's own is unchanged


def test_background_nice_zero_leaves_the_writer_at_the_callers_niceness() -> None:
    assert _writer_niceness() == niceness(threading.get_native_id())


def test_the_presence_feed_thread_runs_at_the_background_niceness(redis_url: str) -> None:
    thread_priority.set_background_nice(7)
    mine = niceness(threading.get_native_id())
    factory = ClientFactory(parse_redis_url(redis_url), timeout_s=5.0)
    feed = PresenceFeed(factory, f"kvtier-nice-{uuid.uuid4().hex[:8]}").start()
    try:
        assert wait_until(lambda: feed.synced)
        tid = feed._thread.native_id if feed._thread is not None else None
        assert tid is not None
        assert niceness(tid) == min(19, mine + 7)
    finally:
        feed.close()


@pytest.mark.parametrize("bad", [-1, 20])
def test_a_niceness_outside_0_to_19_is_refused(bad: int) -> None:
    with pytest.raises(ValueError, match="0..19"):
        thread_priority.set_background_nice(bad)
    assert thread_priority.background_nice() == 0  # unchanged
