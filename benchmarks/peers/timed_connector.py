"""kvtier's connector, and vLLM's native OffloadingConnector, with every vLLM hook timed, per
process (benchmarks only).

Loaded by ``benchmarks/profile_hooks.py`` as ``kv_connector_module_path``
``benchmarks.peers.timed_connector`` (``TimedTieredConnector`` or ``TimedNativeConnector``);
never by users. Each process (the engine core and
every worker) accumulates, per hook, its calls, wall time and thread CPU time, and writes
them as JSON to ``$KVTIER_HOOK_TIMES_DIR/<pid>.json`` every :data:`DUMP_EVERY` calls. With
``KVTIER_HOOK_CPROFILE=1`` the hooks also run under one ``cProfile`` profiler per process
(only inside hooks), written to ``<pid>.prof`` beside it: where a hook's time goes, function
by function (cProfile's own cost inflates every figure, so read shares, not microseconds).

With ``KVTIER_HOOK_CALLS=1`` every call is also appended, as it returns, to
``<pid>.calls`` beside them: one :data:`CALL_RECORD` per call (start as epoch seconds, the
calling thread's CPU time at the start, wall and thread-CPU seconds of the call, the hook's
index in :data:`HOOKS`; for ``build_connector_meta`` the step's scheduled tokens and
requests), so that a benchmark can cut them by its own time windows and rebuild each step
(``benchmarks/hook_steps.py``). One ``write`` of 56 bytes per call.
"""

from __future__ import annotations

import cProfile
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from benchmarks.peers.timed_hooks import CALL_RECORD, HOOKS
from connector import TieredOffloadingConnector

DUMP_EVERY = 200

_times: dict[str, list[int]] = {}  # hook -> [calls, wall ns, thread CPU ns]
_calls = [0]
_profiler = cProfile.Profile() if os.environ.get("KVTIER_HOOK_CPROFILE") == "1" else None
_calls_fd: dict[int, int | None] = {}  # pid -> its file (a forked child opens its own)


def _record_call(hook: int, start: float, cpu_start: float, wall: float, cpu: float,
                 tokens: int = 0, requests: int = 0) -> None:
    """Append one call to ``<pid>.calls`` (``KVTIER_HOOK_CALLS=1``)."""
    pid = os.getpid()
    if pid not in _calls_fd:
        out = os.environ.get("KVTIER_HOOK_TIMES_DIR")
        fd = None
        if out and os.environ.get("KVTIER_HOOK_CALLS") == "1":
            fd = os.open(Path(out) / f"{pid}.calls", os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                         0o600)
        _calls_fd[pid] = fd
    fd = _calls_fd[pid]
    if fd is not None:
        os.write(fd, CALL_RECORD.pack(start, cpu_start, wall, cpu, float(hook), tokens,
                                      requests))


def _step_size(args: tuple[Any, ...]) -> tuple[int, int]:
    """``build_connector_meta(scheduler_output)``: the step's scheduled tokens and requests."""
    out = args[0] if args else None
    per_request = getattr(out, "num_scheduled_tokens", None) or {}
    return int(getattr(out, "total_num_scheduled_tokens", 0) or 0), len(per_request)


def _dump() -> None:
    out = os.environ.get("KVTIER_HOOK_TIMES_DIR")
    if out:
        path = Path(out) / f"{os.getpid()}.json"
        path.write_text(json.dumps({"pid": os.getpid(), "hooks": _times}))
        if _profiler is not None:
            _profiler.dump_stats(str(Path(out) / f"{os.getpid()}.prof"))


def _timed(name: str, hook: Callable[..., Any]) -> Callable[..., Any]:
    index = HOOKS.index(name)
    sized = name == "build_connector_meta"

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        epoch = time.time()
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        if _profiler is not None:
            _profiler.enable()
        try:
            return hook(self, *args, **kwargs)
        finally:
            if _profiler is not None:
                _profiler.disable()
            took, ran = time.perf_counter_ns() - wall, time.thread_time_ns() - cpu
            entry = _times.setdefault(name, [0, 0, 0])
            entry[0] += 1
            entry[1] += took
            entry[2] += ran
            _record_call(index, epoch, cpu / 1e9, took / 1e9, ran / 1e9,
                         *(_step_size(args) if sized else (0, 0)))
            _calls[0] += 1
            if _calls[0] % DUMP_EVERY == 0:
                _dump()
    return timed


class TimedTieredConnector(TieredOffloadingConnector):
    """TieredOffloadingConnector, every hook in :data:`HOOKS` timed."""


class TimedNativeConnector(OffloadingConnector):
    """vLLM's OffloadingConnector, every hook in :data:`HOOKS` it defines timed (the same
    wrapper: the two are compared per step)."""


for _name in HOOKS:
    setattr(TimedTieredConnector, _name, _timed(_name, getattr(TieredOffloadingConnector, _name)))
    if hasattr(OffloadingConnector, _name):
        setattr(TimedNativeConnector, _name, _timed(_name, getattr(OffloadingConnector, _name)))
