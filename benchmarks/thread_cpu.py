"""Where a connector's no-hit CPU goes, thread by thread, and what Redis did meanwhile.

Starts one ``LLM`` per config (vLLM's default multiprocess executors, bench_e2e's engine
environment; the engines alive together and taking turns, the order rotated every pass),
runs one unmeasured no-hit pass each and ``--passes`` measured ones (bench_e2e's ``NOHIT``
prompts, one request at a time), and reports per config and pass:

* the run time of every thread of the engine's processes (``/proc/PID/task/TID/schedstat``,
  nanoseconds), summed by process and thread name. kvtier names its threads at the OS level
  (``offload_tiers/thread_names.py``), so its writer, saver and presence feed stand apart
  from vLLM's; ``(main)`` marks a process's main thread. Each thread's CPU binding is shown;
* the SETs and input bytes ``redis-server`` counted, and its CPU time (``INFO``);
* the pass's wall time and median TTFT.

Then the median per config over the measured passes. Configs: bench_nohit_ttft's (``none``,
``kvtier-cpu``, ``kvtier``, ``native``).

Usage: python -m benchmarks.thread_cpu [--model hybrid] [--configs kvtier,kvtier-cpu]
       [--passes 3] [--redis-url URL] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.bench_e2e import NOHIT, Bench
from benchmarks.bench_nohit_ttft import add_arguments, parse, take_turns
from benchmarks.harness import write_result
from connector.demo.cli import choose_redis
from connector.demo.thread_times import process_tree, thread_deltas, thread_times

#: Threads below this many ms of CPU in a pass are left out of the table (not the JSON).
SHOWN_MS = 1.0


def redis_counts(client: Any) -> dict[str, float]:
    info = client.info("all")
    return {"sets": info.get("cmdstat_set", {}).get("calls", 0),
            "input_bytes": info["total_net_input_bytes"],
            "cpu_s": info["used_cpu_sys"] + info["used_cpu_user"]}


def measure_pass(engine: Any, phase: dict[str, Any], redis_client: Any) -> dict[str, Any]:
    pid = engine.pid
    before = thread_times(process_tree(pid))
    r0 = redis_counts(redis_client) if redis_client else None
    result = engine.run(phase)
    after = thread_times(process_tree(pid))
    r1 = redis_counts(redis_client) if redis_client else None
    threads = thread_deltas(before, after)
    ttfts = sorted(r["ttft_s"] for r in result["requests"])
    out: dict[str, Any] = {"wall_s": result["wall_s"], "ttft_median_s": statistics.median(ttfts),
                           "threads_s": threads}
    if r0 is not None and r1 is not None:
        out["redis"] = {k: r1[k] - r0[k] for k in r0}
    return out


def run(bench: Bench, model: str, configs: list[str], passes: int, gap_s: float,
        redis_client: Any) -> dict[str, list[dict[str, Any]]]:
    per_pass = take_turns(bench, model, configs, passes, gap_s,
                          lambda _c, engine, phase: measure_pass(engine, phase, redis_client))
    return {c: [p[c] for p in per_pass] for c in configs}


def medians(passes: list[dict[str, Any]]) -> dict[str, Any]:
    names = sorted({n for p in passes for n in p["threads_s"]})
    out: dict[str, Any] = {
        "wall_s": statistics.median(p["wall_s"] for p in passes),
        "ttft_median_s": statistics.median(p["ttft_median_s"] for p in passes),
        "threads_ms": {n: 1e3 * statistics.median(p["threads_s"].get(n, 0.0) for p in passes)
                       for n in names}}
    if all("redis" in p for p in passes):
        out["redis"] = {k: statistics.median(p["redis"][k] for p in passes)
                        for k in passes[0]["redis"]}
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, passes=3)
    parser.add_argument("--configs", default="kvtier,kvtier-cpu")
    args = parse(parser, argv)
    configs = args.configs.split(",")
    unknown = set(configs) - {"none", "kvtier-cpu", "kvtier", "native"}
    if unknown:
        parser.error(f"--configs: unknown {sorted(unknown)}")
    choice = choose_redis(args.redis_url)
    if "kvtier" in configs and not choice.reachable:
        parser.error(f"--configs kvtier needs Redis ({choice.shown} does not answer)")
    redis_client = None
    if choice.reachable:
        import redis

        redis_client = redis.Redis.from_url(choice.url)
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    bench = Bench(Path(f"/tmp/kvtier-thread-cpu-{os.getpid()}"), env,
                  choice.url if choice.reachable else None)
    try:
        per_pass = run(bench, args.model, configs, args.passes, args.gap_s, redis_client)
    finally:
        bench.cleanup()
    summary = {c: medians(p) for c, p in per_pass.items()}
    print(f"\nthread_cpu — {args.model}, medians of {args.passes} no-hit passes of "
          f"{NOHIT.conversations} requests; env {env}")
    for config, row in summary.items():
        print(f"\n{config}: wall {row['wall_s']:.3f} s, TTFT median "
              f"{1e3 * row['ttft_median_s']:.1f} ms" + (
                  ", Redis: {sets:.0f} SETs, {mb:.2f} MB in, {cpu:.1f} ms CPU".format(
                      sets=row["redis"]["sets"], mb=row["redis"]["input_bytes"] / 1e6,
                      cpu=1e3 * row["redis"]["cpu_s"]) if "redis" in row else ""))
        for name, ms in sorted(row["threads_ms"].items(), key=lambda kv: -kv[1]):
            if ms >= SHOWN_MS:
                print(f"  {ms:8.1f} ms  {name}")
    write_result(args.json_path, {"model": args.model, "configs": configs,
                                  "passes": args.passes, "engine_env": env,
                                  "summary": summary, "per_pass": per_pass})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
