"""kvtier's connector with every vLLM hook timed, per process (benchmarks only).

Loaded by ``benchmarks/profile_hooks.py`` as ``kv_connector_module_path``
``benchmarks.peers.timed_connector``; never by users. Each process (the engine core and
every worker) accumulates, per hook, its calls, wall time and thread CPU time, and writes
them as JSON to ``$KVTIER_HOOK_TIMES_DIR/<pid>.json`` every :data:`DUMP_EVERY` calls.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from connector import TieredOffloadingConnector

#: The hooks timed: the scheduler half's and the worker half's, as vLLM calls them.
HOOKS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
    "update_connector_output", "request_finished", "request_finished_all_groups",
    "take_events", "get_kv_connector_stats", "handle_preemptions", "start_load_kv",
    "wait_for_save", "get_transfer_results", "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
)
DUMP_EVERY = 200

_times: dict[str, list[int]] = {}  # hook -> [calls, wall ns, thread CPU ns]
_calls = [0]


def _dump() -> None:
    out = os.environ.get("KVTIER_HOOK_TIMES_DIR")
    if out:
        path = Path(out) / f"{os.getpid()}.json"
        path.write_text(json.dumps({"pid": os.getpid(), "hooks": _times}))


def _timed(name: str, hook: Callable[..., Any]) -> Callable[..., Any]:
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        try:
            return hook(self, *args, **kwargs)
        finally:
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


for _name in HOOKS:
    setattr(TimedTieredConnector, _name, _timed(_name, getattr(TieredOffloadingConnector, _name)))
