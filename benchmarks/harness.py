"""What the benchmarks share: ratios, the result file, the machine's load, progress lines.

Rules it keeps:

- A benchmark runs as a module from the repository root, ``python -m benchmarks.NAME [args]``:
  the root is then on ``sys.path``, and ``benchmarks``, ``rigs`` and the product import as
  packages. No benchmark edits ``sys.path``; a child process a benchmark starts is started the
  same way (``-m``, the root as its working directory).
- Benchmarks never import ``tests``. Servers and processes on loopback (free ports,
  redis-server, the daemon, vLLM's OpenAI server) come from ``rigs``; this module holds only
  what is about measuring and reporting, and imports the standard library only (a peer's
  venv, without kvtier, runs some benchmarks' workers).
- ``--json PATH`` writes the result with :func:`write_result`; when, how, at which commit and
  under which load it was measured is stamped by ``python -m benchmarks.figures stamp``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def ratio(a: float | None, b: float | None, digits: int | None = 3) -> float | None:
    """``a / b`` rounded to ``digits`` (``None``: not rounded); ``None`` when either is
    missing or ``b`` is 0."""
    if a is None or b is None or not b:
        return None
    return a / b if digits is None else round(a / b, digits)


def best(fn: Callable[[], object], reps: int) -> float:
    """The fastest of ``reps`` calls of ``fn``, in seconds (the least disturbed by the rest of
    a shared machine)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def load_1m() -> float:
    """The machine's 1-minute load average, recorded beside the figures it may have bent."""
    return os.getloadavg()[0]


def write_result(path: str | Path | None, result: dict[str, Any]) -> None:
    """``result`` as indented JSON at ``path`` (its folder made if missing); nothing when
    ``path`` is None (no ``--json``)."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


def say(msg: str, tag: str | None = None) -> None:
    """A progress line on stderr (stdout carries the tables), flushed at once; with ``tag``,
    prefixed ``[tag HH:MM:SS]``."""
    prefix = f"[{tag} {time.strftime('%H:%M:%S')}] " if tag else ""
    print(prefix + msg, file=sys.stderr, flush=True)
