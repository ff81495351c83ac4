"""Engines started by the engine host's fork server go idle sooner between steps.

vLLM's workers and engine core read each other through shared-memory queues
(``vllm.distributed.device_communicators.shm_broadcast``). A reader spins on the queue
(``sched_yield`` in a loop) for ``busy_loop_s`` = 1 s after every read before it waits on
the queue's ZMQ notification, both vLLM's own code paths. A test engine steps, then the test
checks Redis or another engine, then steps again: each gap costs the worker and the engine
core up to a core-second of spinning each, on a 2-core machine where the other pytest worker
is starting an engine. Imported by the fork server after vLLM (``fast_start.PRELOAD``), this
sets the spin to :data:`BUSY_LOOP_S` for the engines forked from it; the engines the demo,
the OpenAI-server tests and the benchmarks start as users do keep vLLM's second. Outputs do
not depend on it (``tests/e2e/test_fast_start.py`` compares forked engines with spawned
ones, tokens and logprobs exactly).
"""

from __future__ import annotations

from vllm.distributed.device_communicators import shm_broadcast

#: How long a queue reader spins after a read before it waits on the notification socket.
BUSY_LOOP_S = 0.02


def _patch() -> None:
    init = shm_broadcast.SpinCondition.__init__
    defaults = init.__defaults__
    assert defaults == (1,), f"vLLM's SpinCondition changed: defaults {defaults}"
    init.__defaults__ = (BUSY_LOOP_S,)


_patch()
