"""bench_stall's CPU ledger: each thread's run time goes to one role (pure logic), and a
round's readings come from the machine's real ``/proc`` (this process's own burn is counted
as the client's)."""

from __future__ import annotations

import sys
import time

import pytest

from benchmarks.bench_stall import CPU_ROLES, CpuLedger, _role

MEASURED, OTHER, PROXY = 100, 200, 300


@pytest.mark.parametrize(("process", "thread", "pid", "role"), [
    ("VLLM::EngineCor", "VLLM::EngineCor (main)", MEASURED, "engine core"),
    ("VLLM::Worker", "VLLM::Worker (main)", MEASURED, "worker main"),
    ("VLLM::Worker", "VLLM::Worker", MEASURED, "worker compute"),
    ("VLLM::Worker", "kvtier-writer", MEASURED, "kvtier threads"),
    ("VLLM::EngineCor", "kvtier-presence", MEASURED, "kvtier threads"),
    ("python", "python (main)", MEASURED, "api server"),
    ("VLLM::Worker", "VLLM::Worker (main)", OTHER, "other servers"),
    ("python", "python (main)", PROXY, "proxy"),
    ("redis-server", "redis-server (main)", 400, "redis-server"),
    ("postgres", "postgres (main)", 500, "rest of the machine"),
])
def test_each_thread_has_one_role(process: str, thread: str, pid: int, role: str) -> None:
    assert _role(process, thread, pid, {MEASURED}, {OTHER}, {PROXY}) == role
    assert role in CPU_ROLES


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_rounds_cpu_comes_from_proc_and_this_process_is_the_client() -> None:
    ledger = CpuLedger({}, None)  # no server: nothing is measured, no step counted
    ledger.start("none")
    start = time.thread_time()
    while time.thread_time() - start < 0.2:  # burn 0.2 CPU-seconds on this thread
        pass
    burnt = time.thread_time() - start
    reading = ledger.stop("none")
    cpu = reading["cpu_s"]
    assert set(cpu) == set(CPU_ROLES)
    assert cpu["client"] >= burnt * 0.95  # schedstat and thread_time count the same runs
    assert all(v >= 0 for v in cpu.values())
    assert reading["steps"] == 0 and reading["wall_s"] > 0
