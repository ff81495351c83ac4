"""Threads that nothing waits on yield the CPU to their process's own threads.

kvtier's Redis writer (write-behind: no step waits on it) and presence feed (a hint for
look-ups: a late one means a probe, never a wrong block) run at a higher niceness than the
engine's threads they live beside. At equal niceness a background thread that is running
can keep its core until its time slice ends, even when the engine thread it shares the core with
(on a CPU host, the engine core; on any host, the worker between forwards) wakes with a
step to run. Threads that a step or a request waits on (the saver, Redis fetches) keep
their process's priority: a step must not wait on a thread it starved. What it measured:
docs/benchmarks-e2e.md ("one session, one scheduling group").

The niceness is a process-wide setting, 0 until a caller sets it: the vLLM connector sets
its ``background_nice`` (default :data:`BACKGROUND_NICE`); the storage tiers alone (the
daemon, the native tier, the LMCache adapter) leave their threads as they are.

Linux sets niceness per thread (``setpriority(PRIO_PROCESS, tid)``); raising it needs no
privilege. Elsewhere, or where the OS refuses, nothing changes.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

#: The vLLM connector's default ``background_nice`` (0: none; 19: the most).
BACKGROUND_NICE = 10
MAX_NICE = 19

_background_nice = 0


def set_background_nice(nice: int) -> None:
    """This process's background threads started from now on add ``nice`` (0..19)."""
    global _background_nice
    if not 0 <= nice <= MAX_NICE:
        raise ValueError(f"background niceness must be within 0..{MAX_NICE}, got {nice}")
    _background_nice = nice


def background_nice() -> int:
    """The niceness this process's background threads add when they start."""
    return _background_nice


def lower_current_thread() -> None:
    """Raise the calling thread's niceness by this process's background niceness (nothing
    for 0, or where the OS refuses)."""
    if not _background_nice or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, current + _background_nice))
    except OSError as exc:
        log.debug("kvtier: could not lower a background thread's priority: %s", exc)
