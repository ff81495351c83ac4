"""Wait for kvtier's background work in a real engine: events, not sleeps.

kvtier's worker hands Redis writes to a background writer and counts each outcome when it
next reports, so what vLLM's metrics show right after ``generate`` may lag behind what the
workers did. This module lets a test wait for the event itself:

* :class:`KvtierWorkerProbe` is mixed into vLLM's worker (``worker_extension_cls``, the way
  RLHF frameworks extend workers); ``kvtier_drain`` waits until the worker's Redis writer
  has an outcome for every write it took (``RedisTier.flush``) and every host-tier write is
  committed (``TieredWorker.flush_host``), applies those outcomes, and returns the worker's
  cumulative counters.
* :func:`drain` asks every worker (``LLM.collective_rpc``), then steps the engine until
  vLLM's exported ``vllm:kvtier_*`` counters carry at least what the workers counted. The
  workers' step reports travel with those counters, so the scheduler half has applied them
  too (slots unpinned, saves accounted).
* :func:`fresh_gauges` makes the CPU-tier gauges (refreshed at most once per
  ``GAUGE_REFRESH_S`` by the scheduler, a wall-clock throttle in the product) describe the
  tier as it is now.

Each wait has a deadline that only a hung engine reaches; it then fails, naming what it
waited for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

#: ``worker_extension_cls`` value for engines the tests start.
PROBE_CLS = "tests.support.worker_probe.KvtierWorkerProbe"
#: ``TieredScheduler.refresh_gauges``' minimum interval (its default).
GAUGE_REFRESH_S = 1.0
DEADLINE_S = 300.0  # only a hung engine or Redis writer gets there


class KvtierWorkerProbe:
    """Worker-side methods reached through ``LLM.collective_rpc("kvtier_drain", ...)``."""

    def kvtier_drain(self, timeout_s: float) -> dict[str, int]:
        """Every Redis write this worker took has its outcome applied; its counters."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        from connector.vllm_connector.stats import COUNTER_NAMES

        if not has_kv_transfer_group():
            return {}
        half = getattr(get_kv_transfer_group(), "worker", None)
        if half is None:
            return {}
        if half.redis is not None:
            if not half.flush_redis(timeout_s):
                raise TimeoutError(f"kvtier's Redis writer still had writes after {timeout_s} s")
            half._follow_redis_events()  # outage/recovery counts, as each step report does
        if half.host is not None and not half.flush_host(timeout_s):
            raise TimeoutError(f"kvtier's host-tier commits still ran after {timeout_s} s")
        half.collect()  # this thread is the one that runs the steps: same as a report
        snapshot = half.counters.snapshot()
        return {name: int(snapshot[name]) for name in COUNTER_NAMES}

    def kvtier_queue_spin_s(self) -> float:
        """How long this worker's shared-memory queue readers spin after a read (vLLM's
        default, or the tests' shorter one: tests/support/idle_wait.py)."""
        from vllm.distributed.device_communicators import shm_broadcast

        (busy_loop_s,) = shm_broadcast.SpinCondition.__init__.__defaults__
        return float(busy_loop_s)

    def kvtier_stop_before_host_commits(self) -> int:
        """Fault injection for "an engine killed mid-save": from now on this worker's
        host-tier saves stop where a SIGKILL would find them between the copy and the
        commit: payload written into the leased slot (its seqlock left odd), nothing
        committed to the daemon. Returns this worker's pid (to kill it next)."""
        import os

        from vllm.distributed.kv_transfer import get_kv_transfer_group

        half = get_kv_transfer_group().worker
        assert half is not None and half.host is not None, "no host tier in this worker"

        def begun_never_committed(*_: Any) -> None:
            return None

        half._commit_host = begun_never_committed
        return os.getpid()


    def kvtier_skip_host_commits(self, rank: int) -> int:
        """Fault injection for "a rank that skipped its save": from now on TP rank
        ``rank``'s host-tier saves are given back to the daemon uncommitted (its copies
        never become entries); the other ranks save as usual. Returns this worker's rank."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        half = get_kv_transfer_group().worker
        assert half is not None and half.host is not None, "no host tier in this worker"
        if half.tp_rank == rank:
            host = half.host

            def skipped(lease: Any, *_: Any) -> None:
                host.abandon(lease)

            half._commit_host = skipped
        return int(half.tp_rank)


def drain(llm: Any, exported: Callable[[], dict[str, Any]], poke: Callable[[], None],
          deadline_s: float = DEADLINE_S) -> dict[str, Any]:
    """Wait until every save the engine planned so far has its outcome in vLLM's metrics.

    ``exported()`` reads the ``vllm:kvtier_*`` counters by short name; ``poke()`` runs one
    tiny request (the engine steps: a finished request's tail is saved, reports flow).
    Returns the last ``exported()`` reading.
    """
    poke()  # saves planned by the last step (a finishing request's tail) run now
    per_worker = llm.collective_rpc("kvtier_drain", args=(deadline_s,))
    want: dict[str, int] = {}
    for counts in per_worker:
        for name, value in counts.items():
            want[name] = want.get(name, 0) + value
    deadline = time.monotonic() + deadline_s
    while True:
        poke()  # the workers' next step ships what the drain applied
        have = exported()
        behind = {n: (have.get(n, 0), v) for n, v in want.items() if have.get(n, 0) < v}
        if not behind:
            return have
        if time.monotonic() > deadline:
            raise AssertionError(f"vLLM's kvtier metrics never caught up with the workers' "
                                 f"counters (exported, counted): {behind}")


def fresh_gauges(poke: Callable[[], None]) -> None:
    """Call at rest (after :func:`drain`): the scheduler refreshes the CPU-tier gauges at most
    once per ``GAUGE_REFRESH_S`` of wall time, so a step begun that long after the tier came
    to rest carries a refresh taken at rest. The wait creates that condition (the throttle
    open); it orders no event, and a busy machine only makes it longer."""
    time.sleep(GAUGE_REFRESH_S)
    poke()
