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

from connector import TieredOffloadingConnector

#: The hooks timed: the scheduler half's and the worker half's, as vLLM calls them.
HOOKS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
    "update_connector_output", "request_finished", "request_finished_all_groups",
    "take_events", "get_kv_connector_stats", "handle_preemptions", "start_load_kv",
    "wait_for_save", "get_transfer_results", "get_block_ids_with_load_errors",
    "build_connector_worker_meta", "get_kv_connector_kv_cache_events",
)
DUMP_EVERY = 200

_times: dict[str, list[int]] = {}  # hook -> [calls, wall ns, thread CPU ns]
_calls = [0]
_profiler = cProfile.Profile() if os.environ.get("KVTIER_HOOK_CPROFILE") == "1" else None


def _dump() -> None:
    out = os.environ.get("KVTIER_HOOK_TIMES_DIR")
    if out:
        path = Path(out) / f"{os.getpid()}.json"
        path.write_text(json.dumps({"pid": os.getpid(), "hooks": _times}))
        if _profiler is not None:
            _profiler.dump_stats(str(Path(out) / f"{os.getpid()}.prof"))


def _timed(name: str, hook: Callable[..., Any]) -> Callable[..., Any]:
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        if _profiler is not None:
            _profiler.enable()
        try:
            return hook(self, *args, **kwargs)
        finally:
            if _profiler is not None:
                _profiler.disable()
            entry = _times.setdefault(name, [0, 0, 0])
            entry[0] += 1
            entry[1] += time.perf_counter_ns() - wall
            entry[2] += time.thread_time_ns() - cpu
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
