"""kvtier's threads in a CPU worker leave the worker's OpenMP cores: the spare cores are
found from the parent's allowance and the ranks' binding, and real threads are moved."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from connector.vllm_connector.affinity import (
    SpareCores,
    bound_cpus,
    move_threads,
    parse_cpu_list,
    spare_cpus,
    threads_bound_within,
)
from offload_tiers.thread_names import name_native_thread


def test_cpu_lists_parse_as_vllm_writes_them() -> None:
    assert parse_cpu_list("0-3,6") == {0, 1, 2, 3, 6}
    assert parse_cpu_list("5") == {5}
    with pytest.raises(ValueError):
        parse_cpu_list("3-1")


def test_the_bound_cores_are_every_rank_s_or_unknown() -> None:
    assert bound_cpus("0|1", ranks=2, own={0}) == {0, 1}  # TP=2 on 2 cores: none spare
    assert bound_cpus("0-2|4-6", ranks=2, own={0, 1, 2}) == {0, 1, 2, 4, 5, 6}
    assert bound_cpus(None, ranks=1, own={0}) == {0}
    assert bound_cpus("auto", ranks=2, own={0}) is None  # the other rank's cores: unknown
    assert bound_cpus("0-x", ranks=1, own={0}) is None


@pytest.fixture
def bound_to_first_cpu() -> Iterator[tuple[set[int], int]]:
    """This thread bound to one core, as vLLM binds its worker's main thread."""
    allowed = os.sched_getaffinity(os.getppid())
    if len(allowed) < 2 or os.sched_getaffinity(0) != allowed:
        pytest.skip("needs 2 CPUs, with this process allowed as many as its parent")
    before = os.sched_getaffinity(0)
    first = min(allowed)
    os.sched_setaffinity(0, {first})
    try:
        yield allowed, first
    finally:
        os.sched_setaffinity(0, before)


def test_kvtier_threads_move_to_the_spare_cores(
        bound_to_first_cpu: tuple[set[int], int], monkeypatch: pytest.MonkeyPatch) -> None:
    allowed, first = bound_to_first_cpu
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    spare = spare_cpus(ranks=1)
    assert spare == allowed - {first}
    assert spare_cpus(ranks=2) is None  # auto-bound ranks: the other's cores unknown
    go = threading.Event()
    ours = threading.Thread(target=go.wait, name="kvtier-test-io")
    theirs = threading.Thread(target=go.wait, name="other-io")
    ours.start()
    theirs.start()
    try:
        assert os.sched_getaffinity(ours.native_id) == {first}  # inherited from its creator
        assert move_threads(spare) >= 1
        assert os.sched_getaffinity(ours.native_id) == spare
        assert os.sched_getaffinity(theirs.native_id) == {first}  # not kvtier's: untouched
        assert os.sched_getaffinity(0) == {first}
        assert _os_name(ours) == "kvtier-test-io"  # named for top -H / ps -L as it moves
        assert _os_name(theirs) != "other-io"
    finally:
        go.set()
        ours.join()
        theirs.join()


def test_pool_threads_started_later_run_on_the_spare_cores(
        bound_to_first_cpu: tuple[set[int], int], monkeypatch: pytest.MonkeyPatch) -> None:
    allowed, first = bound_to_first_cpu
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", str(first))
    cores = SpareCores()
    cores.adopt(ranks=4)  # an explicit list names every rank's cores: the count is moot
    assert cores.cpus == allowed - {first}
    with ThreadPoolExecutor(1, thread_name_prefix="kvtier-io",
                            initializer=cores.pin_current) as pool:
        assert pool.submit(os.sched_getaffinity, 0).result() == cores.cpus
        assert pool.submit(lambda: _os_name(threading.current_thread())).result() == \
            "kvtier-io_0"


def test_cores_of_other_bound_threads_are_not_spare(
        bound_to_first_cpu: tuple[set[int], int], monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's auto binding pins each OpenMP thread to one core, the main thread to the
    first: an OpenMP thread on another core makes that core the rank's too."""
    allowed, first = bound_to_first_cpu
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    other = max(allowed)
    go, bound = threading.Event(), threading.Event()

    def on_the_other_core() -> None:
        os.sched_setaffinity(0, {other})
        bound.set()
        go.wait()

    # a kvtier thread's binding says nothing of vLLM's
    kv = threading.Thread(target=on_the_other_core, name="kvtier-bound")
    kv.start()
    assert bound.wait(600)
    name_native_thread(kv)
    try:
        assert spare_cpus(ranks=1) == allowed - {first}
        bound.clear()
        omp = threading.Thread(target=on_the_other_core, name="omp-worker")
        omp.start()
        assert bound.wait(600)
        try:
            assert threads_bound_within(allowed) >= {first, other}
            assert spare_cpus(ranks=1) == (allowed - {first, other} or None)
        finally:
            go.set()
            omp.join()
    finally:
        go.set()
        kv.join()


def test_a_fetch_planned_without_a_forward_runs_on_the_compute_cores_then_moves_back(
        bound_to_first_cpu: tuple[set[int], int], monkeypatch: pytest.MonkeyPatch) -> None:
    allowed, first = bound_to_first_cpu
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", str(first))
    cores = SpareCores()
    cores.adopt(ranks=1)
    assert cores.compute == {first} and cores.cpus == allowed - {first}

    def placed(idle: bool) -> tuple[set[int], set[int]]:
        with cores.fetching(idle):
            during = os.sched_getaffinity(0)
        return during, os.sched_getaffinity(0)

    with ThreadPoolExecutor(1, thread_name_prefix="kvtier-io",
                            initializer=cores.pin_current) as pool:
        assert pool.submit(placed, True).result() == ({first}, cores.cpus)
        assert pool.submit(placed, False).result() == (cores.cpus, cores.cpus)
    inside, release = threading.Event(), threading.Event()
    seen: dict[str, set[int]] = {}

    def watched() -> None:  # an I/O thread: on the spare cores, then a fetch
        cores.pin_current()
        seen["spare"] = os.sched_getaffinity(0)
        with cores.fetching(True):
            seen["before"] = os.sched_getaffinity(0)
            inside.set()
            release.wait()
            seen["moved"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=watched, name="kvtier-io-test")
    thread.start()
    assert inside.wait(600)
    cores.forward_starts()
    release.set()
    thread.join()
    # a forward started during the fetch: moved off the compute cores at once
    assert seen == {"spare": cores.cpus, "before": {first}, "moved": cores.cpus}
    unbound = SpareCores()  # no spare cores found: nothing moves
    assert unbound.compute is None
    with unbound.fetching(True):
        assert os.sched_getaffinity(0) == {first}


def _os_name(thread: threading.Thread) -> str:
    with open(f"/proc/self/task/{thread.native_id}/comm") as comm:
        return comm.read().strip()


def test_a_long_thread_name_is_cut_to_what_linux_keeps() -> None:
    done = threading.Event()
    thread = threading.Thread(target=done.wait, name="kvtier-redis-writer")
    thread.start()
    try:
        name_native_thread(thread)
        assert _os_name(thread) == "kvtier-redis-wr"  # 15 bytes
    finally:
        done.set()
        thread.join()
    name_native_thread(thread)  # ended: nothing to name, and no error


def test_an_unbound_worker_moves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.sched_getaffinity(0) != os.sched_getaffinity(os.getppid()):
        pytest.skip("this process is bound already")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    cores = SpareCores()
    cores.adopt(ranks=1)
    assert cores.cpus is None
