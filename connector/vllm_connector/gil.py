"""A short thread switch interval while kvtier's I/O threads read Redis in vLLM's worker.

A Redis read needs the GIL briefly after every ``recv`` (to parse and hand the next buffer
to the kernel). CPython gives a thread waiting for the GIL its turn only when the holder
drops it: at the latest after the switch interval (5 ms by default). vLLM's worker thread
holds the GIL through its Python work between steps, so each of the reader's re-acquisitions
can wait up to 5 ms: measured beside a thread that holds the GIL in a Python loop,
256 reads of 192 KiB ran at 0.03 GB/s with 5 ms, 0.12 GB/s with 1 ms, 0.47 GB/s with
0.2 ms, 2.03 GB/s alone (``python -m benchmarks.bench_gil``). While any fetch is in flight
the interval is set to :data:`FETCH_SWITCH_INTERVAL_S`, then put back. It is process-wide:
it only makes the holder offer the GIL sooner when another thread waits for it.

Not used for the saver's gathers or the Redis writer's batches: with them inside it, the
worker's main thread waited less for the GIL inside ``handle_preemptions`` (profile_hooks),
but no-hit TTFT and pass walls were worse, engines alive together taking turns (2026-12-05,
ad hoc: Llama 10.06 ms against 9.76 ms, hybrid 74.5 ms against 72.9 ms): a thread that may
force the GIL from the main thread every 0.2 ms also cuts into the step's output path.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: The switch interval while a Redis fetch is in flight (CPython's default is 0.005 s).
FETCH_SWITCH_INTERVAL_S = 0.0002

_lock = threading.Lock()
_inside = 0
_saved = 0.0


@contextmanager
def short_switch_interval(interval_s: float = FETCH_SWITCH_INTERVAL_S) -> Iterator[None]:
    """Hold the interval at ``interval_s`` while any caller is inside (re-entrant across
    threads: the first in sets it, the last out restores the one before)."""
    global _inside, _saved
    with _lock:
        if _inside == 0:
            _saved = sys.getswitchinterval()
            sys.setswitchinterval(min(interval_s, _saved))
        _inside += 1
    try:
        yield
    finally:
        with _lock:
            _inside -= 1
            if _inside == 0:
                sys.setswitchinterval(_saved)
