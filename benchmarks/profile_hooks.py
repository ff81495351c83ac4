"""What each of kvtier's vLLM hooks costs per call, in the engine core and in the worker, and
the same for vLLM's native OffloadingConnector (``--config native``, bench_e2e's peer).

Starts one ``LLM`` (vLLM's default multiprocess executors, bench_e2e's engine environment)
with ``benchmarks/peers/timed_connector.py`` — the connector with every hook timed — runs
one unmeasured no-hit pass and ``--passes`` measured ones (bench_e2e's ``NOHIT`` prompts, one
request at a time), then prints per process and hook: calls, wall and thread-CPU time per
call and in all, and the sum per engine step. A no-hit request is one prefill step and 15
decode steps on the Llama: most steps have nothing for the connector to do, so the per-step
sums are what every step pays.

The timing wrapper adds about a microsecond per call; wall time includes waits for the GIL
(the engine core's I/O threads), thread CPU does not.

``--cprofile N`` also runs every hook under ``cProfile`` (in the timed connector) and prints,
per process, the N functions with the most own time inside the hooks: where each hook's time
goes. cProfile inflates every call, so read the shares; take the per-call figures from a run
without it.

Usage: python -m benchmarks.profile_hooks [--model llama|hybrid] [--config kvtier|kvtier-cpu|native]
       [--passes 3] [--cprofile N] [--json PATH]
"""

from __future__ import annotations

import argparse
import io
import json
import pstats
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.bench_e2e import NOHIT, Bench, nohit_phase
from benchmarks.harness import write_result
from connector.demo.cli import choose_redis

WORKER_HOOKS = ("handle_preemptions", "start_load_kv", "wait_for_save", "get_transfer_results",
                "get_block_ids_with_load_errors", "build_connector_worker_meta")


def summarize(dumps: list[dict[str, Any]]) -> dict[str, Any]:
    """Per process ("engine core" or "worker <pid>"): per hook calls and µs per call."""
    out: dict[str, Any] = {}
    for dump in dumps:
        hooks = dump["hooks"]
        is_worker = any(h in hooks for h in WORKER_HOOKS)
        name = f"worker {dump['pid']}" if is_worker else "engine core"
        steps = max((hooks[h][0] for h in ("start_load_kv", "build_connector_meta")
                     if h in hooks), default=0)
        rows = {h: {"calls": n, "wall_us_per_call": wall / n / 1e3,
                    "cpu_us_per_call": cpu / n / 1e3, "cpu_ms": cpu / 1e6}
                for h, (n, wall, cpu) in hooks.items() if n}
        total_cpu = sum(r["cpu_ms"] for r in rows.values())
        out[name] = {"steps": steps, "hooks": rows, "cpu_ms": total_cpu,
                     "cpu_us_per_step": 1e3 * total_cpu / steps if steps else None}
    return out


def top_functions(prof_path: Path, n: int) -> str:
    """The ``n`` functions with the most own time in one process's hook profile."""
    text = io.StringIO()
    pstats.Stats(str(prof_path), stream=text).sort_stats("tottime").print_stats(n)
    lines = text.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return "\n".join(lines[start:])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama", choices=("llama", "hybrid"))
    parser.add_argument("--config", default="kvtier", choices=("kvtier", "kvtier-cpu", "native"))
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="profile the hooks with cProfile and print the top N functions")
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    choice = choose_redis(args.redis_url)
    redis = args.config == "kvtier" and choice.reachable
    with tempfile.TemporaryDirectory(prefix="kvtier-hooks-") as times_dir:
        env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "KVTIER_HOOK_TIMES_DIR": times_dir}
        if args.cprofile:
            env["KVTIER_HOOK_CPROFILE"] = "1"
        bench = Bench(Path(times_dir) / "logs", env, choice.url if redis else None)
        if args.config == "native":
            ktc = bench.transfer_config("native")
            ktc["kv_connector"] = "TimedNativeConnector"
        else:
            ktc = bench.kvtier(redis=redis)
            ktc["kv_connector"] = "TimedTieredConnector"
        ktc["kv_connector_module_path"] = "benchmarks.peers.timed_connector"
        engine = bench.engine(f"{args.config}-timed", args.model, ktc, NOHIT)
        walls = []
        try:
            for rep in range(-1, args.passes):
                result = engine.run(nohit_phase("warmup" if rep < 0 else f"nohit-{rep}",
                                                 rep + 1))
                walls.append(result["wall_s"])
        finally:
            engine.stop()
            bench.cleanup()
        dumps = [json.loads(p.read_text()) for p in Path(times_dir).glob("*.json")]
        profiles = {int(p.stem): top_functions(p, args.cprofile)
                    for p in Path(times_dir).glob("*.prof")} if args.cprofile else {}
    summary = summarize(dumps)
    print(f"\nprofile_hooks — {args.model}, {args.config}"
          f"{' (Redis ' + choice.shown + ')' if redis else ''}, {args.passes} passes + warm-up "
          f"of {NOHIT.conversations} no-hit requests; pass walls "
          + ", ".join(f"{w:.3f} s" for w in walls))
    for process, data in summary.items():
        per_step = data["cpu_us_per_step"]
        print(f"{process}: {data['steps']} steps, hooks' thread CPU {data['cpu_ms']:.1f} ms"
              + (f" ({per_step:.1f} µs per step)" if per_step is not None else ""))
        print(f"  {'hook':<32} {'calls':>7} {'wall µs/call':>13} {'CPU µs/call':>12} "
              f"{'CPU ms':>8}")
        for hook, row in sorted(data["hooks"].items(), key=lambda kv: -kv[1]["cpu_ms"]):
            print(f"  {hook:<32} {row['calls']:>7} {row['wall_us_per_call']:>13.1f} "
                  f"{row['cpu_us_per_call']:>12.1f} {row['cpu_ms']:>8.1f}")
    for pid, text in profiles.items():
        print(f"\ncProfile inside the hooks, process {pid} (own time, top {args.cprofile}):")
        print(text)
    if args.json_path:
        out = {"model": args.model, "config": args.config, "passes": args.passes,
               "pass_wall_s": walls, "processes": summary,
               "redis": {"used": redis, "url": choice.shown}}
        write_result(args.json_path, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
