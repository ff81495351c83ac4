"""Threads named at the OS level too, so ``top -H``, ``ps -L`` and ``/proc/PID/task/TID/comm``
tell kvtier's threads apart (a vLLM worker's threads all read ``VLLM::Worker`` otherwise)."""

from __future__ import annotations

import threading

__all__ = ["name_current_thread", "name_native_thread"]


def name_native_thread(thread: threading.Thread) -> None:
    """Give ``thread`` its Python name at the OS level too (``top -H``, ``ps -L``,
    ``/proc/PID/task/TID/comm``; 15 bytes at most): without it every thread of a vLLM worker
    reads ``VLLM::Worker``. Linux only; nothing when it cannot."""
    if thread.native_id is None:
        return
    try:
        with open(f"/proc/self/task/{thread.native_id}/comm", "wb") as comm:
            comm.write(thread.name.encode()[:15])
    except OSError:  # not Linux, or the thread just ended
        pass


def name_current_thread() -> None:
    """:func:`name_native_thread` for the calling thread (a pool's initializer)."""
    name_native_thread(threading.current_thread())
