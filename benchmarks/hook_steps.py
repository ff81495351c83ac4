"""Steps rebuilt from the timed connector's per-call records: where a slow step's time went.

``benchmarks/peers/timed_connector.py`` (``KVTIER_HOOK_CALLS=1``) appends every hook call of
every process to ``<pid>.calls``. In the worker, one step's calls run in one thread, in
vLLM's order: ``handle_preemptions`` first, then the forward, then the rest. So a step is:

  pre      ``handle_preemptions`` (and ``start_load_kv`` when a load is synchronous)
  forward  the longest gap between two of the step's calls: the runner's input preparation
           and the model (the thread's CPU time over it says how long it ran; the rest it
           waited: for the GIL, a core, OpenMP)
  post     ``start_load_kv`` (vLLM calls it after the forward when no load is synchronous),
           ``wait_for_save`` and the result hooks, to the step's last hook's end

In the engine core, the scheduler's hooks between two ``build_connector_meta`` calls are one
step's, and the time from one ``build_connector_meta`` to the next is the engine's whole
step (schedule, forward, output): what every running request waits between two tokens.
Each such *engine step* is sorted by what vLLM scheduled in it (its tokens and requests,
recorded with the call):

  decode   every scheduled request got one token
  chunk    a prefill of at least :data:`CHUNK_TOKENS` tokens rode along (a long prompt's
           chunk)
  mixed    the rest (a short prefill, such as a restored prompt's new suffix)

so that two connectors' steps are compared at the same work, whatever their schedules
made of the window (a connector that admits the other requests later has fewer chunk
steps beside the decoding stream, and a lower pooled ITL p99 for it). :func:`summarize`
cuts every kind by time windows (a benchmark's measured rounds) and reports their
distributions and what the slowest 1 % of worker steps spent where.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.peers.timed_hooks import CALL_RECORD, HOOKS

START, CPU_START, WALL, CPU, HOOK, TOKENS, REQUESTS = range(7)
FIELDS = 7
#: Prefill tokens in a step that make it a ``chunk`` step.
CHUNK_TOKENS = 128
STEP_KINDS = ("decode", "mixed", "chunk")
_LOAD = HOOKS.index("start_load_kv")
_SAVE = HOOKS.index("wait_for_save")
_PREEMPT = HOOKS.index("handle_preemptions")
_META = HOOKS.index("build_connector_meta")


def read_calls(path: Path) -> np.ndarray:
    """One process's calls, ``(n, 7)`` in :data:`CALL_RECORD`'s field order (a record cut
    short by the process's end is dropped)."""
    raw = path.read_bytes()
    raw = raw[:len(raw) - len(raw) % CALL_RECORD.size]
    return np.frombuffer(raw, dtype="<f8").reshape(-1, FIELDS)


def worker_steps(calls: np.ndarray) -> np.ndarray:
    """Per worker step (the calls from one ``handle_preemptions`` to the next): columns
    start (epoch s), pre, forward, forward's CPU, post (s). The forward is the longest gap
    between two of the step's calls (vLLM calls ``start_load_kv`` after it when no load of
    the step is synchronous, before it otherwise)."""
    starts = np.flatnonzero(calls[:, HOOK].astype(int) == _PREEMPT)
    rows = []
    for i, j in zip(starts, [*starts[1:], len(calls)], strict=True):
        step = calls[i:j]
        if len(step) < 2:
            continue
        ends = step[:, START] + step[:, WALL]
        gaps = step[1:, START] - ends[:-1]
        m = int(np.argmax(gaps))
        rows.append((step[0, START], ends[m] - step[0, START], gaps[m],
                     step[m + 1, CPU_START] - (step[m, CPU_START] + step[m, CPU]),
                     ends[-1] - step[m + 1, START]))
    return np.array(rows, dtype=float).reshape(-1, 5)


def scheduler_steps(calls: np.ndarray) -> np.ndarray:
    """Per engine-core step: columns start (epoch s), wall of the scheduler's hooks from one
    ``build_connector_meta`` to the next (s)."""
    metas = np.flatnonzero(calls[:, HOOK].astype(int) == _META)
    rows = [(calls[i, START], float(calls[i:j, WALL].sum()))
            for i, j in zip(metas, [*metas[1:], len(calls)], strict=True)]
    return np.array(rows, dtype=float).reshape(-1, 2)


def engine_steps(calls: np.ndarray) -> np.ndarray:
    """Per engine step: columns start (epoch s), time to the next ``build_connector_meta``
    (s), scheduled tokens, scheduled requests (the process's last step, with no next, is
    left out)."""
    metas = np.flatnonzero(calls[:, HOOK].astype(int) == _META)
    if len(metas) < 2:
        return np.zeros((0, 4))
    at = calls[metas]
    return np.column_stack([at[:-1, START], np.diff(at[:, START]), at[:-1, TOKENS],
                            at[:-1, REQUESTS]])


def step_kind(tokens: np.ndarray, requests: np.ndarray) -> np.ndarray:
    """Each step's kind in :data:`STEP_KINDS` (by the tokens beyond one per request)."""
    prefill = tokens - requests
    return np.where(prefill <= 0, "decode",
                    np.where(prefill >= CHUNK_TOKENS, "chunk", "mixed"))


def in_windows(steps: np.ndarray, windows: list[tuple[float, float]]) -> np.ndarray:
    """The steps that start inside any window."""
    keep = np.zeros(len(steps), dtype=bool)
    for lo, hi in windows:
        keep |= (steps[:, 0] >= lo) & (steps[:, 0] <= hi)
    return steps[keep]


def _ms(values: np.ndarray) -> dict[str, float]:
    if not len(values):
        return {}
    return {"p50": 1e3 * float(np.percentile(values, 50)),
            "p99": 1e3 * float(np.percentile(values, 99)),
            "max": 1e3 * float(values.max()), "mean": 1e3 * float(values.mean())}


def summarize(times_dir: Path, windows: list[tuple[float, float]]) -> dict[str, Any]:
    """The worker's and the engine core's steps inside ``windows`` (every process's
    ``.calls`` under ``times_dir``): distributions in ms, and the slowest 1 % of worker
    steps (by pre + forward + post) split into their parts (means, ms)."""
    out: dict[str, Any] = {}
    for path in sorted(times_dir.glob("*.calls")):
        calls = read_calls(path)
        hooks = set(calls[:, HOOK].astype(int).tolist())
        if _LOAD in hooks:
            steps = in_windows(worker_steps(calls), windows)
            if not len(steps):
                continue
            total = steps[:, 1] + steps[:, 2] + steps[:, 4]
            off_cpu = steps[:, 2] - steps[:, 3]
            slow = total >= np.percentile(total, 99)
            out["worker"] = {
                "steps": len(steps), "step_ms": _ms(total), "pre_ms": _ms(steps[:, 1]),
                "forward_ms": _ms(steps[:, 2]), "forward_off_cpu_ms": _ms(off_cpu),
                "post_ms": _ms(steps[:, 4]),
                "slowest_1pct": {"steps": int(slow.sum()),
                                 "step_ms": 1e3 * float(total[slow].mean()),
                                 "pre_ms": 1e3 * float(steps[slow, 1].mean()),
                                 "forward_ms": 1e3 * float(steps[slow, 2].mean()),
                                 "forward_off_cpu_ms": 1e3 * float(off_cpu[slow].mean()),
                                 "post_ms": 1e3 * float(steps[slow, 4].mean())}}
        elif _META in hooks:
            steps = in_windows(scheduler_steps(calls), windows)
            if len(steps):
                out["scheduler"] = {"steps": len(steps), "hooks_ms": _ms(steps[:, 1])}
            engine = in_windows(engine_steps(calls), windows)
            kinds = step_kind(engine[:, 2], engine[:, 3])
            out["engine_steps"] = {kind: {"steps": int((kinds == kind).sum()),
                                          **_ms(engine[kinds == kind, 1])}
                                   for kind in STEP_KINDS if (kinds == kind).any()}
    return out


def render(by_config: dict[str, dict[str, Any]]) -> list[str]:
    """Table lines: per config, the worker's step parts and the scheduler's hooks."""
    lines = [f"  {'config':<13} {'part':<22} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
             f"{'slowest 1% mean':>16}"]
    for config, data in by_config.items():
        worker, slow = data.get("worker", {}), data.get("worker", {}).get("slowest_1pct", {})
        for part, key in (("worker step", "step_ms"), ("  pre (hooks)", "pre_ms"),
                          ("  forward", "forward_ms"),
                          ("  forward off-CPU", "forward_off_cpu_ms"),
                          ("  post (hooks)", "post_ms")):
            d = worker.get(key)
            if d:
                lines.append(f"  {config:<13} {part:<22} {d['p50']:>8.2f} {d['p99']:>8.2f} "
                             f"{d['max']:>8.2f} {slow.get(key, float('nan')):>16.2f}")
        sched = data.get("scheduler", {}).get("hooks_ms")
        if sched:
            lines.append(f"  {config:<13} {'scheduler hooks':<22} {sched['p50']:>8.2f} "
                         f"{sched['p99']:>8.2f} {sched['max']:>8.2f}")
        for kind, d in data.get("engine_steps", {}).items():
            lines.append(f"  {config:<13} {f'engine step, {kind}':<22} {d['p50']:>8.2f} "
                         f"{d['p99']:>8.2f} {d['max']:>8.2f} {d['steps']:>10} steps")
    return lines
