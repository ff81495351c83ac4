"""End-to-end benchmark: kvtier against vLLM's native offloading, on real CPU engines.

The demo's multi-turn shared-prefix workload (``connector.demo.workload``) runs through
vLLM 0.32 (CPU, vLLM's default multiprocess executors: caller, engine core and worker are
three processes) with a tiny Llama (one KV-cache group) and a tiny Mamba+attention hybrid
(partial prefix entries), under these configurations:

  (a) none          vLLM alone (its GPU prefix cache only)
  (n) null          a connector whose every hook is a no-op (benchmarks/peers/
                    null_connector.py): what vLLM itself spends on having any connector
  (b) native        vLLM's OffloadingConnector + CPUOffloadingManager, with a CPU transfer
                    worker written for this comparison (connector/native_tier/cpu_offload.py;
                    the stock worker refuses the CPU platform)
  (c) kvtier        TieredOffloadingConnector as deployed: CPU tier + Redis, background
                    writes (``write_mode: back``, the default); without a reachable Redis,
                    the CPU tier only (said in the output)
  (c') kvtier-cpu   the CPU tier only (``--with-cpu-only``: no Redis probes, no writes)
  (d) kvtier-redis  a new engine process on (c)'s Redis namespace: the restart
  (e) lmcache       LMCacheConnectorV1, if it can run on the CPU (else the reason is printed)

Each config's engine is its own child process (``benchmarks/e2e_engine.py``), started one
after the other and then kept alive together. Each runs ``cold`` (fresh engine) and
``reset`` (vLLM's GPU prefix cache dropped, tiers kept); then the configs take turns on
the no-hit passes, spread over ``--instances`` engines per config (default 2: the first
half of the passes on these engines, then a new engine per config for the rest, one engine
per config alive at a time). An engine of vLLM alone runs the same passes a few percent
faster or slower than another of vLLM alone for as long as it lives (2-6 % in ad hoc runs
of identical engines, docs/benchmarks-e2e.md), so one engine per config measures its
instance as much as its config. A no-hit pass (``NOHIT``) is 16 requests of 480 tokens +
16 answer tokens, one at a time, prompts that share nothing with anything stored, every
block of them saved: to the CPU tier and, for (c), to Redis. Pass k of every config runs
the same prompts, seconds apart, order rotated per pass, so load from elsewhere on the
machine falls on all configs alike; a pause before each pass lets the engine that ran
before stop spinning. (d) is a new engine after the others stopped. A restarted engine
without a persistent tier is a fresh engine, so (a)-(c) after a restart recompute what
they recomputed in ``cold``.

Every engine gets ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (``--reserved-cpus``): vLLM's default
reserves one more core whenever a kv_transfer_config is set, which on a 2-core machine
changes the worker's OpenMP threads (1 without a connector, 2 with one) and so the timing
of every step, whatever the connector does.

Token counts come from vLLM's own counters (``prompt_tokens_by_source``,
``prompt_tokens_cached_by_source``) and kvtier's ``vllm:kvtier_hit_tokens_{cpu,redis}``;
"recomputed" in the ratios is per request max(prompt - cached, 1), the tokens really run
(vLLM's admission counter misses the last token recomputed after a whole-prompt async hit).

Ratios (JSON ``ratios``):
  recomputed_vs_native_{hybrid,llama}  recomputed prefill tokens after the GPU-cache reset,
                                       kvtier / native (< 1: kvtier recomputes less)
  restart_recomputed_vs_native_{...}   after an engine restart, kvtier-redis / native
  overhead_no_hit_{llama,hybrid}       wall time of a no-hit pass, kvtier / none - 1: the
                                       median over passes of the paired ratio (same
                                       prompts, run in turn); ``overhead_no_hit``: the
                                       median over both models' paired ratios
  overhead_no_hit_tree_cpu[_{model}]   the same with CPU time of the engine's whole process
                                       tree (caller + engine core + worker, psutil; it
                                       counts vLLM's spin-waits, so it tracks wall time)
  native_/null_/cpu_only_overhead...   the same for (b), (n), (c')
  kvtier_vs_native_no_hit[_{model}]    kvtier's no-hit pass / native's of the same prompts,
                                       run in turn - 1: the two connectors compared
                                       directly (median over passes; pooled over models)
The detail (JSON ``detail``) adds fastest-pass ratios, each pass's TTFT sum (the time
before first tokens) beside its decode time, the quartiles of every config's paired
ratios (``nohit_paired_spread``) and their median per engine instance
(``nohit_paired_by_instance``): a connector that does nothing (n) gives this machine's
noise floor.

Usage: python -m benchmarks.bench_e2e [--quick] [--json PATH] [--redis-url URL]
       [--models llama,hybrid] [--reps N] [--instances N] [--with-cpu-only]
       [--reserved-cpus N|vllm]
       [--gap-s S] [--lmcache-path DIR] [--log-dir DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
import uuid
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks.e2e_engine import SMALL_KV_OVERRIDES, EngineProc
from benchmarks.harness import load_1m, ratio, say, write_result
from connector.demo.cli import choose_redis, delete_redis_prefix, model_path
from connector.demo.engine import EngineRunError
from connector.demo.presets import kvtier_transfer_config
from connector.demo.report import Row, render_table, summarize
from connector.demo.tiny_models import PROMPT_SEED_PERIOD
from connector.demo.workload import Workload

CPU_BYTES = 256 << 20
NATIVE_EXTRA = {
    "spec_name": "CpuPeerOffloadingSpec",
    "spec_module_path": "connector.native_tier.cpu_offload",
    "cpu_bytes_to_use": CPU_BYTES,
    # Give the peer its best setting for multi-turn chat: answers are reused next turn.
    "offload_prompt_only": False,
}
LMCACHE_FINDING = (
    "LMCache 0.5.6 (PyPI manylinux wheel, unpacked outside the venv with its missing pure-"
    "Python deps) imports and loads as LMCacheConnectorV1 on vLLM 0.32 CPU, but its vLLM "
    "KV-transfer factory has no CPU implementation: 'RuntimeError: No supported cpu "
    "connector found.' (lmcache/v1/gpu_connector/__init__.py:247, only cuda/xpu/musa/hpu), "
    "so it runs in 'degraded mode (recompute)': 0 hit tokens, plus a ~3 s ZMQ lookup "
    "timeout per request. Its connector is not SupportsHMA, so vLLM turns off the hybrid "
    "KV-cache manager and hybrid Mamba models cannot run with it at all. Its compiled "
    "cuda_ops also needs libc10_cuda.so/libtorch_cuda.so/libcudart.so.13 (CPU torch has "
    "none). Pass --lmcache-path DIR (an unpacked lmcache + deps) to re-check."
)
FULL = Workload(conversations=4, turns=3, system_words=320, user_words=40, max_tokens=8)
QUICK = Workload(conversations=3, turns=2, system_words=200, user_words=40, max_tokens=8)
# One no-hit pass: 16 requests of 480 tokens, 16 answer tokens each, one at a time (every
# prompt its own; each request's 15 full blocks are saved by the connectors).
NOHIT = Workload(conversations=16, turns=1, system_words=448, user_words=32, max_tokens=16,
                 shared_system=False)
NOHIT_TIMES = ("wall_s", "tree_cpu_s")
# The no-hit passes' system-prompt seeds: NOHIT_FIRST_SEED up to below PROMPT_SEED_PERIOD,
# so all distinct modulo it (the shared workload's is 7).
NOHIT_FIRST_SEED = 16
# Passes (warm-up included) whose prompts are all distinct (see ``nohit_phase``).
MAX_NOHIT_PASSES = (PROMPT_SEED_PERIOD - NOHIT_FIRST_SEED) // NOHIT.conversations
# vLLM's own cost of a connector: every hook a no-op.
NULL = {"kv_connector": "NullConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "benchmarks.peers.null_connector"}


def _model_dir(model: str) -> str:
    return str(model_path(model))


def nohit_phase(name: str, index: int) -> dict[str, Any]:
    """No-hit pass ``index`` (0: the warm-up): prompts that share no prefix with each other,
    with any other pass of the run, or with the shared workload.

    Each request's system prompt is seeded ``seed + 1 + conv``; :func:`prompt_words` repeats
    itself for seeds :data:`PROMPT_SEED_PERIOD` apart, so every pass takes its own window of
    ``NOHIT.conversations`` seeds within one period (before this, passes 508 seeds apart
    repeated the warm-up's prompts and half their requests hit vLLM's prefix cache).
    """
    if not 0 <= index < MAX_NOHIT_PASSES:
        raise ValueError(f"no-hit pass {index}: only {MAX_NOHIT_PASSES} passes (warm-up "
                         "included) have prompts of their own (the tiny vocabulary repeats)")
    seed = NOHIT_FIRST_SEED + index * NOHIT.conversations - 1  # system seeds seed+1...
    return {"name": name, "workload": asdict(replace(NOHIT, seed=seed))}


def _prefix_of(ktc: dict[str, Any]) -> str | None:
    return ktc["kv_connector_extra_config"].get("redis_prefix")


class Bench:
    """Engine runs of one benchmark invocation: log dir, engine env, Redis prefixes."""

    def __init__(self, log_dir: Path, env: dict[str, str], redis_url: str | None) -> None:
        self.log_dir = log_dir
        self.env = env
        self.redis_url = redis_url
        self.prefixes: list[str] = []

    def engine(self, label: str, model: str, ktc: dict[str, Any] | None, workload: Workload,
               extra_paths: list[str] | None = None) -> EngineProc:
        spec = {"label": label, "model": model, "model_dir": _model_dir(model),
                "workload": asdict(workload), "kv_transfer_config": ktc,
                "engine_overrides": dict(SMALL_KV_OVERRIDES)}
        engine = EngineProc(spec, self.log_dir, extra_paths=extra_paths, env=self.env).start()
        say(f"  {label}: engine started in {engine.startup_s:.1f} s")
        return engine

    def kvtier(self, redis: bool, prefix: str | None = None) -> dict[str, Any]:
        """kvtier's kv_transfer_config: as deployed (CPU + Redis, write-behind) or CPU only."""
        if not redis or self.redis_url is None:
            return kvtier_transfer_config({"cpu_bytes": CPU_BYTES, "redis_url": None})
        if prefix is None:
            prefix = f"kvtier-bench-{uuid.uuid4().hex[:10]}"
            self.prefixes.append(prefix)
        return kvtier_transfer_config({"cpu_bytes": CPU_BYTES, "redis_url": self.redis_url,
                                       "redis_prefix": prefix})

    def transfer_config(self, config: str) -> dict[str, Any] | None:
        """The kv_transfer_config of ``config``: none, null (every hook a no-op), native,
        kvtier (CPU + Redis, a Redis prefix of its own) or kvtier-cpu (CPU only)."""
        if config == "none":
            return None
        if config == "null":
            return dict(NULL)
        if config == "native":
            return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": dict(NATIVE_EXTRA)}
        if config in ("kvtier", "kvtier-cpu"):
            return self.kvtier(redis=config == "kvtier")
        raise ValueError(f"unknown config {config!r}: none, null, native, kvtier, kvtier-cpu")

    def cleanup(self) -> None:
        if self.redis_url is not None:
            for prefix in self.prefixes:
                delete_redis_prefix(self.redis_url, prefix)
        self.prefixes.clear()


def split_passes(reps: int, instances: int) -> list[list[int]]:
    """The no-hit passes each engine instance of a config runs: ``reps`` passes in
    ``instances`` contiguous runs, as even as they divide."""
    if not 1 <= instances <= reps:
        raise ValueError(f"instances must be 1 to {reps} (the passes), not {instances}")
    return [[k for k in range(reps) if k * instances // reps == i] for i in range(instances)]


def _interleaved(engines: dict[str, EngineProc], passes: list[int], reps: int, gap_s: float,
                 instance: int = 0) -> dict[str, dict[str, dict[str, Any]]]:
    """No-hit passes ``passes`` (of ``reps``) on every engine, the engines taking turns (the
    order rotated per pass), after one unmeasured warm-up pass each.

    Every config's pass ``k`` runs the same prompts, within seconds of the others' pass
    ``k``: load from elsewhere on the machine falls on all of them alike. ``gap_s`` before
    each pass lets the engine that just ran stop spinning (vLLM's shm queues busy-poll
    for 1 s after their last message). Each result records its engine ``instance``.
    """
    names = list(engines)
    out: dict[str, dict[str, dict[str, Any]]] = {n: {} for n in names}
    for rep in [-1, *passes]:  # -1: one unmeasured warm-up pass each
        phase = nohit_phase("warmup" if rep < 0 else f"nohit-{rep}", rep + 1)
        order = names[rep % len(names):] + names[:rep % len(names)] if rep >= 0 else names
        for name in order:
            time.sleep(gap_s)
            result = engines[name].run(phase)
            result["load_1m"] = load_1m()
            result["instance"] = instance
            if rep >= 0:
                out[name][phase["name"]] = result
        if rep >= 0:
            say(f"  no-hit pass {rep + 1}/{reps} (engines #{instance + 1}): " + ", ".join(
                f"{n} {out[n][phase['name']]['wall_s']:.3f} s" for n in names)
                + f" (load {load_1m():.1f})")
    return out


def _configs(bench: Bench, with_cpu_only: bool) -> dict[str, Any]:
    """Each config's kv_transfer_config (kvtier's with a Redis namespace of its own)."""
    names = ("none", "null", "native", "kvtier") + (("kvtier-cpu",) if with_cpu_only else ())
    return {name: bench.transfer_config(name) for name in names}


def bench_model(bench: Bench, model: str, workload: Workload, reps: int,
                lmcache_path: str | None, with_cpu_only: bool = False,
                gap_s: float = 1.5, instances: int = 1) -> dict[str, Any]:
    """Every configuration on one model; returns phases by config plus table rows.

    The no-hit passes are spread over ``instances`` engines per config, one set of engines
    (one per config) alive at a time: an engine's speed differs from another's of the
    same config by a few percent for as long as it lives, so one engine per config
    measures its instance as much as its config.
    """
    main_phases = [{"name": "cold"}, {"name": "reset", "reset_before": True}]
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    skipped: dict[str, str] = {}
    configs = _configs(bench, with_cpu_only)
    deployed = configs["kvtier"]
    engines: dict[str, EngineProc] = {}
    try:
        for config, ktc in configs.items():
            say(f"[bench] {model}: {config}: start, cold and reset passes")
            engines[config] = bench.engine(f"{model}-{config}", model, ktc, workload)
            runs[config] = {p["name"]: engines[config].run(p) for p in main_phases}
        for instance, passes in enumerate(split_passes(reps, instances)):
            if instance:
                for engine in engines.values():
                    engine.stop()
                engines = {}
                for config, ktc in _configs(bench, with_cpu_only).items():
                    engines[config] = bench.engine(f"{model}-{config}-{instance + 1}", model,
                                                   ktc, workload)
            say(f"[bench] {model}: no-hit passes {passes[0] + 1}-{passes[-1] + 1} of {reps} "
                 f"on engines #{instance + 1} of {instances}, taking turns")
            for config, phases in _interleaved(engines, passes, reps, gap_s,
                                               instance).items():
                runs[config].update(phases)
    finally:
        for engine in engines.values():
            engine.stop()
    prefix = _prefix_of(deployed)
    if prefix:
        say(f"[bench] {model}: (d) kvtier-redis: a new engine process on kvtier's Redis")
        engine = bench.engine(f"{model}-kvtier-redis", model,
                              bench.kvtier(redis=True, prefix=prefix), workload)
        try:
            runs["kvtier-redis"] = {"restart": engine.run({"name": "restart"})}
        finally:
            engine.stop()
    else:
        skipped["kvtier-redis"] = "no Redis reachable"
    bench.cleanup()
    if lmcache_path is not None and model == "llama":
        say(f"[bench] {model}: (e) LMCache")
        os.environ.setdefault("LMCACHE_LOCAL_CPU", "True")
        os.environ.setdefault("LMCACHE_CHUNK_SIZE", "32")
        os.environ.setdefault("LMCACHE_MAX_LOCAL_CPU_SIZE", "0.5")
        lm = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
        paths = [p for p in lmcache_path.split(os.pathsep) if p]
        try:
            engine = bench.engine(f"{model}-lmcache", model, lm, workload, extra_paths=paths)
            try:
                runs["lmcache"] = {p["name"]: engine.run(p) for p in main_phases}
            finally:
                engine.stop()
        except EngineRunError as exc:
            skipped["lmcache"] = f"engine failed: {str(exc).splitlines()[0]}"
    elif lmcache_path is not None:
        skipped["lmcache"] = ("LMCacheConnectorV1 is not SupportsHMA: vLLM disables the "
                              "hybrid KV-cache manager, so hybrid Mamba models cannot run")
    else:
        skipped["lmcache"] = LMCACHE_FINDING
    return {"runs": runs, "skipped": skipped}


def rows_for(result: dict[str, Any]) -> list[Row]:
    """Table rows: each config's phases, outputs compared with vLLM alone's same pass."""
    runs = result["runs"]
    ref = runs["none"]
    rows = []
    for config, phases in runs.items():
        for name, phase in phases.items():
            if name.startswith("nohit"):
                continue
            reference = ref.get("cold" if name == "restart" else name)
            rows.append(summarize(f"{config}: {name}", phase, reference))
    return rows


def _nohit_values(phases: dict[str, dict[str, Any]], key: str) -> dict[str, float]:
    return {n: p[key] for n, p in phases.items() if n.startswith("nohit") and p.get(key)}


def _nohit_time(phases: dict[str, dict[str, Any]], key: str) -> float | None:
    """Fastest no-hit pass (least disturbed by other load on the machine)."""
    values = _nohit_values(phases, key)
    return min(values.values()) if values else None


def _nohit_median(phases: dict[str, dict[str, Any]], key: str) -> float | None:
    values = _nohit_values(phases, key)
    return statistics.median(values.values()) if values else None


def _ttft_split(phases: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Median over no-hit passes of the pass's summed TTFT and of the rest (decoding)."""
    ttft = [sum(r["ttft_s"] for r in p["requests"]) for n, p in phases.items()
            if n.startswith("nohit")]
    rest = [p["wall_s"] - t for t, (n, p) in zip(
        ttft, ((n, p) for n, p in phases.items() if n.startswith("nohit")), strict=True)]
    return {"ttft_sum_s": statistics.median(ttft) if ttft else None,
            "after_first_token_s": statistics.median(rest) if rest else None}


def _paired(runs: dict[str, Any], config: str, key: str) -> list[float]:
    """Per pass: ``config``'s time / vLLM alone's time for the same prompts, run in turn."""
    return _paired_with(runs, config, "none", key)


def _paired_with(runs: dict[str, Any], config: str, ref: str, key: str) -> list[float]:
    """Per pass: ``config``'s time / ``ref``'s time for the same prompts, run in turn."""
    mine, theirs = _nohit_values(runs.get(config, {}), key), _nohit_values(runs.get(ref, {}), key)
    return [mine[n] / theirs[n] for n in mine if n in theirs]


def _by_instance(runs: dict[str, Any], config: str, ref: str, key: str
                 ) -> list[float | None]:
    """Per engine instance: the median of ``config``'s paired ratios to ``ref`` over the
    passes that instance ran (instance ``i`` of every config ran the same passes)."""
    mine, theirs = runs.get(config, {}), runs.get(ref, {})
    ratios: dict[int, list[float]] = {}
    for name, pass_ in mine.items():
        if name.startswith("nohit") and name in theirs and pass_.get(key) and theirs[name].get(key):
            ratios.setdefault(pass_.get("instance", 0), []).append(
                pass_[key] / theirs[name][key])
    return [statistics.median(ratios[i]) if i in ratios else None
            for i in range(max(ratios, default=-1) + 1)]


def _spread(values: list[float]) -> dict[str, float] | None:
    """The quartiles of paired ratios: how far one run's median can be trusted."""
    if len(values) < 2:
        return None
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"q1": q1, "median": q2, "q3": q3, "min": min(values), "max": max(values)}


def _nohit_cached(phases: dict[str, dict[str, Any]]) -> int:
    """Prompt tokens vLLM found cached in the no-hit passes: 0 unless they hit after all."""
    return sum(r["cached_tokens"] for n, p in phases.items() if n.startswith("nohit")
               for r in p["requests"])


def _nohit_identical(runs: dict[str, Any], config: str) -> bool | None:
    mine, ref = runs.get(config, {}), runs["none"]
    names = [n for n in mine if n.startswith("nohit")]
    if not names:
        return None
    return all([r["output"] for r in mine[n]["requests"]]
               == [r["output"] for r in ref[n]["requests"]] for n in names)


def _recomputed(phase: dict[str, Any] | None) -> int | None:
    """Prompt tokens the engine really ran through prefill: per request, prompt - cached,
    and at least 1 (vLLM always computes the last prompt token to sample the next one).

    vLLM's ``prompt_tokens_by_source[local_compute]`` counts at admission: a whole-prompt
    asynchronous hit (native) shows 0 there although vLLM then recomputes the last token
    (``Scheduler._update_waiting_for_remote_kv``); kvtier's synchronous hit of prompt - 1
    shows that token. Counting per request treats both the same.
    """
    if phase is None:
        return None
    return sum(max(r["prompt_tokens"] - r["cached_tokens"], 1) for r in phase["requests"])


def _counted(phase: dict[str, Any] | None) -> int | None:
    """vLLM's own admission counter of locally computed prompt tokens."""
    if phase is None:
        return None
    return int(round(phase["counters"].get(
        "vllm:prompt_tokens_by_source[source=local_compute]", 0.0)))


OVERHEAD_OF = {"kvtier": "", "native": "native_", "kvtier-cpu": "cpu_only_", "null": "null_"}
TIME_SUFFIX = {"wall_s": "", "tree_cpu_s": "_tree_cpu"}


def _median_minus_one(values: list[float]) -> float | None:
    return statistics.median(values) - 1.0 if values else None


def compute_ratios(results: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The headline ratios and the per-model numbers behind them.

    ``overhead_no_hit*``: the median over passes of (config's pass / vLLM alone's pass of
    the same prompts, run in turn) - 1; ``*_fastest``: fastest pass / fastest pass - 1.
    """
    ratios: dict[str, Any] = {}
    detail: dict[str, Any] = {}
    configs = [c for c in ("none", "kvtier", "native", "null", "kvtier-cpu")
               if all(c in r["runs"] for r in results.values())]
    pooled: dict[str, list[float]] = {}
    for model, result in results.items():
        runs = result["runs"]
        native_reset = _recomputed(runs["native"].get("reset"))
        kv_reset = _recomputed(runs["kvtier"].get("reset"))
        native_restart = _recomputed(runs["native"].get("cold"))  # fresh engine = restart
        kv_restart = _recomputed(runs.get("kvtier-redis", {}).get("restart"))
        ratios[f"recomputed_vs_native_{model}"] = ratio(kv_reset, native_reset, digits=None)
        ratios[f"restart_recomputed_vs_native_{model}"] = ratio(kv_restart, native_restart,
                                                                digits=None)
        fastest = {k: {c: _nohit_time(runs[c], k) for c in configs} for k in NOHIT_TIMES}
        median = {k: {c: _nohit_median(runs[c], k) for c in configs} for k in NOHIT_TIMES}
        overhead: dict[str, float | None] = {}
        for key, suffix in TIME_SUFFIX.items():
            for c in configs[1:]:
                paired = _paired(runs, c, key)
                pooled.setdefault(f"{OVERHEAD_OF[c]}overhead_no_hit{suffix}", []).extend(paired)
                overhead[f"{c}{suffix}"] = _median_minus_one(paired)
                overhead[f"{c}{suffix}_fastest"] = _minus_one(
                    ratio(fastest[key][c], fastest[key]["none"], digits=None))
                ratios[f"{OVERHEAD_OF[c]}overhead_no_hit{suffix}_{model}"] = \
                    overhead[f"{c}{suffix}"]
        vs_native = _paired_with(runs, "kvtier", "native", "wall_s")
        pooled.setdefault("kvtier_vs_native_no_hit", []).extend(vs_native)
        ratios[f"kvtier_vs_native_no_hit_{model}"] = _median_minus_one(vs_native)
        detail[model] = {
            "kvtier_vs_native_paired": vs_native,
            "nohit_paired_spread": {c: _spread(_paired(runs, c, "wall_s"))
                                    for c in configs[1:]},
            "nohit_paired_by_instance": {
                **{c: _by_instance(runs, c, "none", "wall_s") for c in configs[1:]},
                "kvtier_vs_native": _by_instance(runs, "kvtier", "native", "wall_s")},
            "recomputed_after_reset": {c: _recomputed(runs[c].get("reset"))
                                       for c in runs if "reset" in runs[c]},
            "vllm_counter_local_compute_after_reset": {
                c: _counted(runs[c].get("reset")) for c in runs if "reset" in runs[c]},
            "recomputed_after_restart": {
                **{c: _recomputed(runs[c].get("cold")) for c in configs},
                "kvtier-redis": kv_restart},
            "nohit_fastest_pass": fastest,
            "nohit_median_pass": median,
            "nohit_paired_ratios": {f"{c}{suffix}": _paired(runs, c, key) for c in configs[1:]
                                    for key, suffix in TIME_SUFFIX.items()},
            "nohit_passes": {c: len(_nohit_values(runs[c], "wall_s")) for c in configs},
            "nohit_cached_tokens": {c: _nohit_cached(runs[c]) for c in configs},
            "nohit_ttft_split": {c: _ttft_split(runs[c]) for c in configs},
            "overhead_no_hit": overhead,
            "nohit_outputs_identical": {c: _nohit_identical(runs, c) for c in configs[1:]},
        }
    for key, values in pooled.items():
        ratios[key] = _median_minus_one(values)
    return ratios, detail


def _minus_one(value: float | None) -> float | None:
    return None if value is None else value - 1.0


def _fmt(value: float | None, pct: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{100 * value:+.1f}%" if pct else f"{value:.3f}"


def _print_model(model: str, result: dict[str, Any], d: dict[str, Any]) -> list[Row]:
    rows = rows_for(result)
    print(f"\n== tiny {model} ==")
    print(render_table(rows))
    print("recomputed after GPU-cache reset: "
          + ", ".join(f"{k}={v}" for k, v in d["recomputed_after_reset"].items()))
    print("  (vLLM's admission counter:      "
          + ", ".join(f"{k}={v}" for k, v in
                      d["vllm_counter_local_compute_after_reset"].items()) + ")")
    print("recomputed after engine restart:  "
          + ", ".join(f"{k}={v}" for k, v in d["recomputed_after_restart"].items()))
    print("no-hit passes per config: " + ", ".join(
        f"{k}={v}" for k, v in d["nohit_passes"].items()))
    if any(d["nohit_cached_tokens"].values()):
        print("WARNING: the no-hit passes hit vLLM's prefix cache after all (cached tokens: "
              + ", ".join(f"{k}={v}" for k, v in d["nohit_cached_tokens"].items()) + ")")
    for key, what in (("wall_s", "wall s"), ("tree_cpu_s", "tree CPU s")):
        for stat, label in (("nohit_fastest_pass", "fastest"), ("nohit_median_pass", "median")):
            print(f"no-hit pass ({label}), {what}: ".ljust(36) + ", ".join(
                f"{k}={v:.3f}" if v is not None else f"{k}=n/a" for k, v in d[stat][key].items()))
        oh = d["overhead_no_hit"]
        configs = [c for c in d[stat][key] if c != "none"]
        suffix = TIME_SUFFIX[key]
        print(f"  overhead vs none, {what}: median of paired passes ".ljust(36) + ", ".join(
            f"{c} {_fmt(oh.get(f'{c}{suffix}'), True)}" for c in configs)
            + "; fastest/fastest " + ", ".join(
            f"{c} {_fmt(oh.get(f'{c}{suffix}_fastest'), True)}" for c in configs))
    print("  paired wall ratios vs none, quartiles [min-max]: " + ", ".join(
        f"{c} {v['q1']:.2f}/{v['median']:.2f}/{v['q3']:.2f} [{v['min']:.2f}-{v['max']:.2f}]"
        for c, v in d["nohit_paired_spread"].items() if v is not None))
    if any(len(v) > 1 for v in d["nohit_paired_by_instance"].values()):
        print("  paired wall ratios vs none, median per engine instance: " + ", ".join(
            f"{c} " + "/".join("n/a" if v is None else f"{v:.3f}" for v in vs)
            for c, vs in d["nohit_paired_by_instance"].items()))
    print("no-hit pass (median) split: summed TTFT / after first tokens, s: " + ", ".join(
        f"{c}={v['ttft_sum_s']:.3f}/{v['after_first_token_s']:.3f}"
        for c, v in d["nohit_ttft_split"].items() if v["ttft_sum_s"] is not None))
    for config, reason in result["skipped"].items():
        print(f"({config} not run: {reason})")
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller workload (~8 min)")
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH")
    parser.add_argument("--redis-url", default=None,
                        help="Redis for (c)/(d) (default: $KVTIER_REDIS_URL, else probe local)")
    parser.add_argument("--models", default="llama,hybrid")
    parser.add_argument("--with-cpu-only", action="store_true",
                        help="also run kvtier with the CPU tier only (c')")
    parser.add_argument("--reps", type=int, default=None,
                        help="no-hit passes per config (default 6 quick, 10 full)")
    parser.add_argument("--instances", type=int, default=2,
                        help="engines per config the no-hit passes are spread over, one "
                             "set alive at a time (default 2; 1: one engine per config)")
    parser.add_argument("--gap-s", type=float, default=1.5,
                        help="pause before each no-hit pass (engines stop spinning)")
    parser.add_argument("--reserved-cpus", default="1",
                        help="VLLM_CPU_NUM_OF_RESERVED_CPU for every engine (default 1; "
                             "'vllm': vLLM's own default, which differs with a connector)")
    parser.add_argument("--lmcache-path", default=None,
                        help="sys.path entries (os.pathsep-separated) holding lmcache")
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args(argv)

    t0 = time.monotonic()
    workload = QUICK if args.quick else FULL
    reps = args.reps or (6 if args.quick else 10)
    if reps >= MAX_NOHIT_PASSES:
        parser.error(f"--reps: at most {MAX_NOHIT_PASSES - 1} (each pass needs prompts of "
                     "its own)")
    if not 1 <= args.instances <= reps:
        parser.error(f"--instances: 1 to {reps} (the no-hit passes)")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    choice = choose_redis(args.redis_url)
    if not choice.reachable:
        say(f"[bench] Redis {choice.shown} not reachable ({choice.reason}): kvtier runs "
             "with the CPU tier only, (d) skipped")
    lmcache_path = args.lmcache_path
    if lmcache_path is None and importlib.util.find_spec("lmcache") is not None:
        lmcache_path = ""  # installed in this environment: run it
    log_dir = Path(args.log_dir or f"/tmp/kvtier-bench-e2e-{os.getpid()}")
    env = {} if args.reserved_cpus == "vllm" else {
        "VLLM_CPU_NUM_OF_RESERVED_CPU": str(int(args.reserved_cpus))}
    bench = Bench(log_dir, env, choice.url if choice.reachable else None)
    results: dict[str, dict[str, Any]] = {}
    load = {"start": load_1m()}
    try:
        for model in models:
            results[model] = bench_model(bench, model, workload, reps, lmcache_path,
                                         args.with_cpu_only, args.gap_s, args.instances)
            load[f"after_{model}"] = load_1m()
    except EngineRunError as exc:
        say(f"[bench] failed: {exc}")
        return 1
    finally:
        bench.cleanup()
    ratios, detail = compute_ratios(results)

    w, n = workload, NOHIT
    tiers = f"CPU + Redis {choice.shown}" if choice.reachable else "CPU tier only (no Redis)"
    print(f"\nbench_e2e — vLLM 0.32 CPU (default multiprocess executors), {w.conversations} "
          f"conversations x {w.turns} turns, {w.system_words}-token shared system prompt, "
          f"+{w.user_words} user tokens and {w.max_tokens} answer tokens per turn. No-hit "
          f"pass: {n.conversations} requests of {n.system_words + n.user_words} tokens + "
          f"{n.max_tokens} answer tokens, one at a time; {reps} passes per config over "
          f"{args.instances} engine(s) each; one engine per config alive at a time, the "
          f"configs taking turns. kvtier: {tiers}"
          f", write_mode back. Engine env: {env or 'vLLM defaults'}. "
          f"1-min load: " + ", ".join(f"{k} {v:.1f}" for k, v in load.items()))
    all_rows: dict[str, list[dict[str, Any]]] = {}
    for model, result in results.items():
        rows = _print_model(model, result, detail[model])
        all_rows[model] = [r.as_dict() for r in rows]
    print("\nratios (overhead_no_hit*: wall time, median over paired passes; *_tree_cpu: CPU "
          "time of the process tree)")
    for key, value in ratios.items():
        print(f"  {key:<44} {_fmt(value, pct='overhead' in key or 'vs_native_no_hit' in key)}")
    print(f"\ntotal {time.monotonic() - t0:.0f} s; engine logs in {log_dir}")
    if args.json_path:
        out = {"ratios": ratios, "detail": detail, "rows": all_rows,
               "workload": asdict(workload), "nohit_workload": asdict(NOHIT),
               "nohit_passes": reps, "nohit_instances": args.instances,
               "engine_env": env, "load": load,
               "skipped": {m: r["skipped"] for m, r in results.items()},
               "redis": {"used": choice.reachable, "url": choice.shown},
               "elapsed_s": time.monotonic() - t0}
        write_result(args.json_path, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
