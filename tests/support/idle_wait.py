"""Engines the tests start go idle sooner between steps.

vLLM's workers and engine core read each other through shared-memory queues
(``vllm.distributed.device_communicators.shm_broadcast``). A reader spins on the queue
(``sched_yield`` in a loop) for ``busy_loop_s`` = 1 s after every read before it waits on
the queue's ZMQ notification, both vLLM's own code paths. A test engine steps, then the test
checks Redis or another engine, then steps again: each gap costs the worker and the engine
core up to a core-second of spinning each, on a 2-core machine where the other pytest worker
is starting an engine. :func:`install` sets the spin to :data:`BUSY_LOOP_S` in this process
(now, or when vLLM's module is first imported). The engine host's fork server imports this
module after vLLM (``fast_start.PRELOAD``); every other process a test starts (the OpenAI
servers, the demo's engines, the exit scripts, and the processes vLLM spawns from them)
gets it from ``tests/support/spawned/sitecustomize.py`` on the ``PYTHONPATH`` that
``tests/conftest.py`` sets. Benchmarks and users keep vLLM's second. Outputs do not depend
on it (``tests/e2e/test_fast_start.py`` compares forked engines with engines vLLM spawns
without it, tokens and logprobs exactly).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

#: How long a queue reader spins after a read before it waits on the notification socket.
BUSY_LOOP_S = 0.02
#: vLLM's default, asserted before it is changed (a vLLM that changed it is looked at again).
VLLM_BUSY_LOOP_S = 1
MODULE = "vllm.distributed.device_communicators.shm_broadcast"


def _patch(module: ModuleType) -> None:
    init = module.SpinCondition.__init__
    if init.__defaults__ == (BUSY_LOOP_S,):
        return  # installed twice (a forked process, or the fork server's preload)
    assert init.__defaults__ == (VLLM_BUSY_LOOP_S,), \
        f"vLLM's SpinCondition changed: defaults {init.__defaults__}"
    init.__defaults__ = (BUSY_LOOP_S,)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds vLLM's module as the path finder does and patches it once it has run."""

    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> Any:
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Patch vLLM's spin now if it is imported, else when it is."""
    module = sys.modules.get(MODULE)
    if module is not None:
        _patch(module)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


install()
