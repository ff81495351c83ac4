"""Which part of kvtier a no-hit request waits for: TTFT per request, configs side by side.

bench_e2e's no-hit overhead is a ratio of pass wall times, and a pass runs in a fast or a
slow state of this machine (up to 1.6x within seconds), so its figures need many passes to
move. This benchmark asks a narrower question with less noise: the **time to first token of
every no-hit request** (bench_e2e's ``NOHIT`` prompts, one request at a time; vLLM's own
``first_token_latency``), median over all requests of all passes, for

* ``none`` — vLLM alone;
* ``kvtier-cpu`` — kvtier with its CPU tier only;
* ``kvtier`` — kvtier as deployed (CPU tier + Redis, write-behind, presence summary);
* ``native`` (``--with-native``) — vLLM's OffloadingConnector (CPU).

The engines (vLLM's default multiprocess executors) are alive together and take turns, the
order rotated every pass, as in bench_e2e, with bench_e2e's engine environment
(``VLLM_CPU_NUM_OF_RESERVED_CPU=1``: with vLLM's default a connector changes how many cores
the worker's OpenMP gets). As in bench_e2e the passes are spread over ``--instances``
engines per config (default 2, one set alive at a time): two engines of one config differ
by a few percent for as long as they live. Ratios: each config's median TTFT over
``none``'s; ``median_ms_by_instance``: each config's median on each of its engines.

Usage: python -m benchmarks.bench_nohit_ttft [--model hybrid] [--passes 6] [--instances 2]
       [--with-native] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.bench_e2e import (
    MAX_NOHIT_PASSES,
    NOHIT,
    Bench,
    nohit_phase,
    split_passes,
)
from benchmarks.e2e_engine import EngineProc
from benchmarks.harness import write_result
from connector.demo.cli import choose_redis

CONFIGS = ("none", "kvtier-cpu", "kvtier")


def summarize(ttfts: dict[str, list[float]], baseline: str = "none") -> dict[str, Any]:
    """Per config: requests, median and p90 TTFT (ms); ratios of medians to ``baseline``'s."""
    rows: dict[str, dict[str, float]] = {}
    for config, values in ttfts.items():
        ordered = sorted(values)
        rows[config] = {"requests": len(ordered),
                        "median_ms": 1e3 * statistics.median(ordered),
                        "p90_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]}
    base = rows[baseline]["median_ms"]
    ratios = {f"ttft_nohit_{c.replace('-', '_')}_vs_none": r["median_ms"] / base
              for c, r in rows.items() if c != baseline}
    return {"rows": rows, "ratios": ratios}


def take_turns(bench: Bench, model: str, configs: list[str], passes: int, gap_s: float,
               measure: Callable[[str, EngineProc, dict[str, Any]], dict[str, Any]],
               instances: int = 1) -> list[dict[str, dict[str, Any]]]:
    """One engine per config, alive together; one unmeasured warm-up pass each, then no-hit
    passes taking turns (the order rotated every pass). With ``instances`` > 1 the passes
    are split into that many runs, each on a new engine per config (one set alive at a
    time: two engines of one config differ by a few percent for as long as they live).
    ``measure(config, engine, phase)`` runs one pass; per measured pass, its result per
    config, each with its engine ``instance``."""
    out: list[dict[str, dict[str, Any]]] = []
    for instance, numbers in enumerate(split_passes(passes, instances)):
        engines: dict[str, EngineProc] = {}
        try:
            for config in configs:
                label = config if instances == 1 else f"{config}-{instance + 1}"
                engines[config] = bench.engine(label, model, bench.transfer_config(config),
                                               NOHIT)
            for rep in [-1, *numbers]:  # -1: one unmeasured warm-up pass each
                phase = nohit_phase("warmup" if rep < 0 else f"nohit-{rep}", rep + 1)
                order = configs[rep % len(configs):] + configs[:rep % len(configs)]
                got: dict[str, dict[str, Any]] = {}
                for config in order:
                    time.sleep(gap_s)  # the engine that just ran stops spinning
                    got[config] = {**measure(config, engines[config], phase),
                                   "instance": instance}
                if rep >= 0:
                    out.append(got)
                    print(f"  pass {rep + 1}/{passes} (engines #{instance + 1}): " + ", ".join(
                        f"{c} {r['wall_s']:.3f} s" for c, r in got.items()), file=sys.stderr,
                        flush=True)
        finally:
            for engine in engines.values():
                engine.stop()
    return out


def run(bench: Bench, model: str, configs: list[str], passes: int, gap_s: float,
        instances: int = 1
        ) -> tuple[dict[str, list[float]], list[dict[str, float]], dict[str, list[float]]]:
    """Per config, every no-hit request's TTFT; per pass, each config's wall time; per
    config, its median TTFT on each engine instance (ms)."""
    def measure(config: str, engine: EngineProc, phase: dict[str, Any]) -> dict[str, Any]:
        result = engine.run(phase)
        cached = sum(r["cached_tokens"] for r in result["requests"])
        if cached and phase["name"] != "warmup":
            raise RuntimeError(f"{config}: {cached} tokens of a no-hit pass hit")
        return result

    per_pass = take_turns(bench, model, configs, passes, gap_s, measure, instances)
    ttfts = {c: [r["ttft_s"] for p in per_pass for r in p[c]["requests"]] for c in configs}
    by_instance = {c: [1e3 * statistics.median(r["ttft_s"] for p in per_pass
                                               if p[c]["instance"] == i
                                               for r in p[c]["requests"])
                       for i in range(instances)] for c in configs}
    return ttfts, [{c: p[c]["wall_s"] for c in configs} for p in per_pass], by_instance


def add_arguments(parser: argparse.ArgumentParser, passes: int) -> None:
    """The options this benchmark shares with ``thread_cpu.py``."""
    parser.add_argument("--model", default="hybrid", choices=("llama", "hybrid"))
    parser.add_argument("--passes", type=int, default=passes)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--gap-s", type=float, default=1.5)
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH")


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if not 1 <= args.passes < MAX_NOHIT_PASSES:
        parser.error(f"--passes: 1 to {MAX_NOHIT_PASSES - 1}")
    return args


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, passes=6)
    parser.add_argument("--with-native", action="store_true")
    parser.add_argument("--instances", type=int, default=2,
                        help="engines per config the passes are spread over, one set alive "
                             "at a time (default 2; 1: one engine per config)")
    args = parse(parser, argv)
    if not 1 <= args.instances <= args.passes:
        parser.error(f"--instances: 1 to {args.passes} (the passes)")
    choice = choose_redis(args.redis_url)
    configs = [c for c in CONFIGS if c != "kvtier" or choice.reachable]
    if args.with_native:
        configs.append("native")
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    bench = Bench(Path(f"/tmp/kvtier-bench-nohit-ttft-{os.getpid()}"), env,
                  choice.url if choice.reachable else None)
    t0 = time.monotonic()
    try:
        ttfts, walls, by_instance = run(bench, args.model, configs, args.passes, args.gap_s,
                                        args.instances)
    finally:
        bench.cleanup()
    summary = {**summarize(ttfts), "median_ms_by_instance": by_instance}
    print(f"\nbench_nohit_ttft — {args.model}, {args.passes} passes x {NOHIT.conversations} "
          f"no-hit requests of {NOHIT.system_words + NOHIT.user_words} tokens, one at a "
          f"time; engines alive together, taking turns; env {env}; Redis "
          f"{choice.shown if choice.reachable else 'not reachable (kvtier skipped)'}")
    print(f"{'config':<12} {'requests':>8} {'TTFT median':>12} {'TTFT p90':>10} {'vs none':>8}"
          f"  median per engine")
    for config, row in summary["rows"].items():
        ratio = summary["ratios"].get(f"ttft_nohit_{config.replace('-', '_')}_vs_none", 1.0)
        print(f"{config:<12} {row['requests']:>8} {row['median_ms']:>9.1f} ms "
              f"{row['p90_ms']:>7.1f} ms {ratio:>7.3f}x  "
              + " / ".join(f"{v:.1f}" for v in by_instance[config]))
    if args.json_path:
        out = {**summary, "model": args.model, "passes": args.passes,
               "instances": args.instances,
               "workload": asdict(NOHIT), "engine_env": env, "pass_wall_s": walls,
               "redis": {"used": choice.reachable, "url": choice.shown},
               "elapsed_s": time.monotonic() - t0}
        write_result(args.json_path, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
