"""CPU time by thread, of a process tree or of the whole machine, from ``/proc`` (Linux).

Used around a phase of a benchmark: what each of the engine's threads (vLLM's engine core
and workers, kvtier's named threads, ``offload_tiers/thread_names.py``) ran meanwhile, and
what else did (``redis-server`` on the same host). Off Linux every reading is empty.
"""

from __future__ import annotations

import os


def process_tree(root: int) -> list[int]:
    """``root`` and every descendant process (by ``/proc/PID/task/PID/children``)."""
    out = [root]
    for pid in out:
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                out.extend(int(child) for child in f.read().split())
        except OSError:
            continue
    return out


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def all_processes() -> list[int]:
    """Every process of the machine (this PID namespace)."""
    return [int(name) for name in os.listdir("/proc") if name.isdigit()] \
        if os.path.isdir("/proc") else []


#: One thread's reading: (process name, thread name with its CPU binding, seconds run).
Reading = tuple[str, str, float]


def thread_times(pids: list[int]) -> dict[int, Reading]:
    """Each thread of ``pids`` by thread id: its process's name, its own name with its CPU
    binding (``(main)`` marks a process's main thread) and the seconds it has run
    (``/proc/PID/task/TID/schedstat``, ns)."""
    out: dict[int, Reading] = {}
    for pid in pids:
        try:
            process = _read(f"/proc/{pid}/comm").strip()
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            base = f"/proc/{pid}/task/{tid}"
            try:
                name = _read(f"{base}/comm").strip()
                cpus = next(line.split()[1] for line in _read(f"{base}/status").splitlines()
                            if line.startswith("Cpus_allowed_list"))
                ran = int(_read(f"{base}/schedstat").split()[0]) / 1e9
            except (OSError, StopIteration, IndexError, ValueError):
                continue  # the thread just ended
            if int(tid) == pid:
                name += " (main)"
            out[int(tid)] = (process, f"{name} @{cpus}", ran)
    return out


def thread_deltas(before: dict[int, Reading], after: dict[int, Reading]) -> dict[str, float]:
    """Seconds each thread ran between two :func:`thread_times`, matched by thread id (names
    and bindings change: a kernel worker's name says what it is doing), summed by its
    names in ``after`` as ``"process / thread @cpus"``; a thread new in ``after`` counts
    whole."""
    out: dict[str, float] = {}
    for tid, (process, thread, ran) in after.items():
        key = f"{process} / {thread}"
        out[key] = out.get(key, 0.0) + ran - (before[tid][2] if tid in before else 0.0)
    return out


def busiest(deltas: dict[str, float], least_s: float = 0.0005) -> dict[str, float]:
    """The threads of :func:`thread_deltas` that ran at least ``least_s``, busiest first."""
    return dict(sorted(((k, v) for k, v in deltas.items() if v >= least_s),
                       key=lambda kv: -kv[1]))
