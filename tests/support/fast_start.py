"""Engine processes started from a preloaded fork server instead of a fresh interpreter.

vLLM's CPU platform starts its engine core and workers with ``spawn``: each is a new Python
that imports vLLM and torch again (~8 s each on this machine, ~15 s of an engine's ~24 s
start). The engine host (:mod:`tests.support.engine_host`) starts one fork server per test
worker that has imported those modules once, and vLLM's ``spawn`` context is answered by
that server instead: the same processes (engine core and workers apart, vLLM's executors,
IPC and shutdown), each forked from a process that has imported but never run vLLM, so
its OpenMP runtime and torch state are as fresh as a spawned one's. What a spawned process
gets and a forked one would not, each process here gets too:

* the starting process's environment at ``start()`` (the server's is the host's at its
  start; a spec's settings, e.g. ``VLLM_CPU_OMP_THREADS_BIND``, are set later),
* the starting process's standard output and error (the spec's log, not the server's),
* the same server for its own children (the engine core's workers come from it too).

Only the host installs this; the demo, the OpenAI-server tests and the benchmarks start
vLLM as users do (``spawn``). ``KVTIER_TEST_SPAWN=1`` turns it off for the host, or for
one spec's engine (set in that spec's environment).
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing import context, forkserver, reduction
from typing import Any

#: Imported once by the server: what the engine core and a CPU worker import.
PRELOAD = [
    "tests.support.fast_start",
    "vllm.v1.engine.core",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.model_executor.models.llama",
    "tests.support.idle_wait",  # after vLLM: its queue readers go idle after 20 ms
]

_original_get_context = multiprocessing.get_context
#: (child pid, pid of the process that started it), for the host to know whose it is.
STARTED_LOG_ENV = "KVTIER_FAST_START_LOG"


def enabled() -> bool:
    """Whether engine processes start from the fork server: not while
    ``KVTIER_TEST_SPAWN=1`` (for the whole host, or for one spec's engine)."""
    return os.environ.get("KVTIER_TEST_SPAWN") != "1"


def install(preload: list[str] | None = None) -> int:
    """In the host: start the server (importing ``preload``, by default :data:`PRELOAD`)
    and answer ``spawn`` with it; the server's pid."""
    forkserver.set_forkserver_preload(PRELOAD if preload is None else preload)
    forkserver.ensure_running()
    multiprocessing.get_context = _get_context  # type: ignore[assignment]
    return int(forkserver._forkserver._forkserver_pid)  # type: ignore[attr-defined]


def _get_context(method: str | None = None) -> Any:
    return _FAST if method == "spawn" and enabled() else _original_get_context(method)


class _Stdio:
    """Standard output and error of the starting process, passed as descriptors."""

    def __reduce__(self) -> tuple[Any, tuple[Any, Any]]:
        return _Inherited, (reduction.DupFd(1), reduction.DupFd(2))


class _Inherited:
    def __init__(self, out: Any, err: Any) -> None:
        self.fds = (out.detach(), err.detach())


class FastProcess(context.ForkServerProcess):
    """A forkserver process carrying its starter's environment, stdio and server address."""

    def start(self) -> None:
        self._kvtier_env = dict(os.environ)
        self._kvtier_stdio: Any = _Stdio()
        self._kvtier_server = forkserver._forkserver._forkserver_address  # type: ignore[attr-defined]
        super().start()
        log = os.environ.get(STARTED_LOG_ENV)
        if log:
            with open(log, "a") as fh:
                fh.write(f"{self.pid} {os.getpid()}\n")

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._kvtier_env)
        out, err = self._kvtier_stdio.fds
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        _adopt_server(self._kvtier_server)
        _size_openmp_pool()
        super().run()


def _adopt_server(address: str) -> None:
    """In a child: start its own children from the same server (it holds the liveness
    pipe already; the address is all it lacks)."""
    server = forkserver._forkserver  # type: ignore[attr-defined]
    server._forkserver_address = address
    server.ensure_running = lambda: None  # the host's server; not this process's child
    multiprocessing.get_context = _get_context  # type: ignore[assignment]


def _size_openmp_pool() -> None:
    """OpenMP read ``OMP_NUM_THREADS`` when the server loaded it: size the pool as a
    spawned process's loader would from this process's own value."""
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))


class _FastContext(context.ForkServerContext):
    Process = FastProcess  # type: ignore[assignment]


_FAST = _FastContext()
