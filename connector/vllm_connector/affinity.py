"""kvtier's threads in a vLLM CPU worker run on the cores vLLM reserved, not on the cores of
the worker's OpenMP compute.

vLLM's CPU worker binds its main thread and OpenMP threads to its cores (every core the
process may use but ``VLLM_CPU_NUM_OF_RESERVED_CPU``, or ``VLLM_CPU_OMP_THREADS_BIND``), and
a thread inherits its creator's binding: kvtier's Redis writer, fetch threads, host-tier
client and prefault thread all ran on the compute cores, so their CPU time came out of the
forward step (on this 2-core machine: the one core the worker computes on).

:func:`spare_cpus` names the cores of this engine's process that no worker of the engine
computes on: the cores the worker's parent (vLLM's engine core, never bound) may use, less
the binding of every rank — known from an explicit ``VLLM_CPU_OMP_THREADS_BIND`` list
(``"0-3|4-7"``), or, when the engine is one rank, from the bindings of this process's
threads: vLLM binds each OpenMP thread to one core and the main thread to the first, so
with its auto binding on 2 cores and a connector (no core left to reserve) OpenMP runs on
both and no core is spare (with several ranks bound automatically the others' cores are
unknown: nothing is moved). Where nothing is spare, kvtier's threads keep the binding they
inherit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

from offload_tiers.thread_names import name_current_thread, name_native_thread

log = logging.getLogger(__name__)

#: Thread names of kvtier's own threads (every one starts so).
THREAD_PREFIX = "kvtier"


def parse_cpu_list(text: str) -> set[int]:
    """``"0-3,6"`` -> {0, 1, 2, 3, 6}; ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if first < 0 or last < first:
            raise ValueError(f"not a CPU range: {part!r}")
        cpus.update(range(first, last + 1))
    return cpus


def bound_cpus(bind: str | None, ranks: int, own: set[int]) -> set[int] | None:
    """The cores every rank's OpenMP threads are bound to: the union of an explicit
    ``VLLM_CPU_OMP_THREADS_BIND`` (ranks separated by ``|``), or ``own`` for a single rank
    bound automatically; None when unknown."""
    if bind and bind not in ("auto", "nobind", "all"):
        try:
            return set().union(*(parse_cpu_list(rank) for rank in bind.split("|")))
        except ValueError:
            return None
    return set(own) if ranks == 1 else None


def rank_cpus() -> tuple[set[int], set[int]] | None:
    """(this rank's compute cores, the process's allowance); None when this thread is not
    bound (nothing to avoid) or off Linux. vLLM binds each OpenMP thread to one core and
    this one to the first: the rank computes on all of theirs (auto binding on 2 cores with
    a connector: [0, 1], this thread on 0). Call from the worker's main thread."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        allowed = os.sched_getaffinity(os.getppid())
        own = os.sched_getaffinity(0)
    except OSError:
        return None
    if not own < allowed:
        return None
    return own | threads_bound_within(allowed), allowed


def spare_cpus(ranks: int) -> set[int] | None:
    """Cores of this process's allowance that no rank computes on (see the module); None
    when there are none, when they are unknown, or off Linux. Call from the worker's main
    thread after vLLM bound it."""
    found = rank_cpus()
    if found is None:
        return None
    own, allowed = found
    bound = bound_cpus(os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), ranks, own)
    if bound is None:
        return None  # the others' cores unknown
    return (allowed - bound) or None


def threads_bound_within(allowed: set[int]) -> set[int]:
    """The cores of every thread of this process, but kvtier's, bound to fewer cores than
    ``allowed`` (vLLM's OpenMP threads); empty off Linux."""
    cores: set[int] = set()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return cores
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                if comm.read().startswith(THREAD_PREFIX):
                    continue
            cpus = os.sched_getaffinity(int(tid))
        except OSError:  # the thread just ended
            continue
        if cpus < allowed:
            cores |= cpus
    return cores


def move_threads(cpus: set[int]) -> int:
    """Bind every live kvtier thread of this process to ``cpus``; how many were moved.
    Threads they start inherit it."""
    moved = 0
    for thread in threading.enumerate():
        if thread.name.startswith(THREAD_PREFIX) and thread.native_id is not None:
            try:
                os.sched_setaffinity(thread.native_id, cpus)
                moved += 1
            except OSError:  # the thread just ended
                continue
            name_native_thread(thread)
    return moved


class SpareCores:
    """Where this worker's kvtier threads run: :meth:`pin_current` is a thread initializer
    (for pools whose threads the main thread starts later); :meth:`fetching` places one
    Redis fetch."""

    def __init__(self) -> None:
        self.cpus: set[int] | None = None
        self.compute: set[int] | None = None  # this rank's OpenMP cores (vLLM's binding)
        self._lock = threading.Lock()
        self._on_compute: set[int] = set()  # native ids of threads fetching on ``compute``

    def adopt(self, ranks: int) -> None:
        """Find the spare cores (after vLLM bound this thread) and move kvtier's threads
        there; nothing when there are none."""
        self.cpus = spare_cpus(ranks)
        if self.cpus:
            found = rank_cpus()
            self.compute = found[0] if found else None
            moved = move_threads(self.cpus)
            log.info("kvtier: its threads run on CPUs %s, outside the worker's OpenMP "
                     "cores (%d moved)", sorted(self.cpus), moved)

    @contextlib.contextmanager
    def fetching(self, idle: bool) -> Iterator[None]:
        """On an I/O thread, around a Redis fetch planned in a step with no forward
        (``idle``): the thread runs on this rank's compute cores until the fetch ends or the
        next forward starts (:meth:`forward_starts`), then on the spare ones again.

        A restore is its request's critical path, and with no forward the compute cores only
        run vLLM's wait for the next step, which yields. On the spare cores the fetch shares
        a core with everything else kvtier and vLLM put there, and with a local
        ``redis-server`` (ad hoc on 2 cores, 2026-12-05: 48 MiB from a local Redis in an
        idle engine took the fetch thread 94-98 ms on the spare core, 56-58 ms on the
        compute core). A fetch planned beside a forward stays on the spare cores."""
        if not idle or not self.cpus or not self.compute:
            yield
            return
        tid = threading.get_native_id()
        with self._lock:
            try:
                os.sched_setaffinity(0, self.compute)
                self._on_compute.add(tid)
            except OSError:
                pass
        try:
            yield
        finally:
            with self._lock:
                if tid in self._on_compute:
                    self._on_compute.discard(tid)
                    with contextlib.suppress(OSError):
                        os.sched_setaffinity(0, self.cpus)

    def forward_starts(self) -> None:
        """Main thread, first thing in a step with a forward: fetches still running on the
        compute cores move to the spare ones, off the forward's OpenMP threads."""
        if not self._on_compute:
            return
        with self._lock:
            assert self.cpus is not None
            for tid in self._on_compute:
                with contextlib.suppress(OSError):  # the thread just ended
                    os.sched_setaffinity(tid, self.cpus)
            self._on_compute.clear()

    def pin_current(self) -> None:
        name_current_thread()
        if self.cpus:
            try:
                os.sched_setaffinity(0, self.cpus)
            except OSError:
                log.debug("kvtier: could not bind an I/O thread to %s", sorted(self.cpus))
