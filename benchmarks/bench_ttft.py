"""Time to first token of a long-prefix request, per tier a prefix is restored from.

    python -m benchmarks.bench_ttft [--quick] [--sizes 1024,4096,8192] [--json PATH]
                                    [--redis-url URL] [--log-dir DIR]

Real vLLM CPU engines (vLLM's default executors, each engine its own process through
``connector.demo.engine``) on a locally built Llama big enough that prefill dominates
(``connector.demo.tiny_models.prefill_llama``: 6 layers, hidden 256, float32, 6 KiB of KV per
token). For each prompt size one single-request prompt (its own words: no prefix is shared
between sizes) runs once to store its KV, vLLM's prefix cache is reset, and the same prompt
runs again; that second request's TTFT (``RequestOutput.metrics.first_token_latency``,
``max_tokens=1``) is the figure. Engines:

* ``recompute``: vLLM without a connector (the second run recomputes everything);
* ``kvtier CPU``: kvtier, CPU tier only;
* ``kvtier Redis``: kvtier with a CPU tier just big enough for the largest prefix (a restore
  from Redis stages through CPU-tier slots); after storing, two other prompts of the largest
  size push the prefix out of it, so it comes back from Redis in the same engine (a second
  after them: their writes behind hold CPU-tier slots until written);
  ``kvtier Redis, new engine``: a new engine process on the same Redis prefix, whose first
  request restores from Redis;
* ``native CPU``: vLLM's OffloadingConnector, plain CPU tier (``CpuPeerOffloadingSpec``).

Restore throughput = KV bytes kvtier loaded into vLLM's cache for the request / the time
kvtier's own timers give the move: ``load_us`` (the worker's copies into the KV tensors) for
the CPU tier; ``fetch_us_redis`` (the I/O threads reading the values into CPU-tier slots,
summed over batches) + ``load_us`` for Redis. Next to it, the tier's raw limit measured in
the same run: ``numpy`` memcpy of the largest prefix's KV bytes for the CPU tier,
``redis-benchmark`` GET at kvtier's value size for Redis. The same bytes per second of TTFT
(a lower bound: the TTFT includes scheduling and the step's own prefill) are printed and
kept in the JSON (``restore_gbps_per_ttft``). JSON ``ratios``:
``ttft_cpu_hit_vs_recompute_4k``, ``ttft_redis_hit_vs_recompute_4k``,
``restore_gbps_vs_tier_limit_cpu``, ``restore_gbps_vs_tier_limit_redis`` (at the largest
size). ``--quick`` runs each measurement once; the default runs it three times (median).

Each measured request also records the CPU time every thread on the machine ran around it
(``/proc``, ``connector/demo/thread_times.py``; the two readings span the request and the
time the readings take, ``cpu_window_s``); for the Redis hits at the largest size it is
printed and kept (``cpu_ms``) by who ran: vLLM's engine core and worker main threads (their
spin-waits included), kvtier's I/O threads, ``redis-server``, and everything else (the
readings themselves included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import redis

from benchmarks.bench_tiers import bench_redis_benchmark
from benchmarks.harness import write_result
from connector.demo.engine import run_engine
from connector.demo.presets import kvtier_transfer_config
from connector.demo.tiny_models import prefill_llama

KV_BYTES_PER_TOKEN = 6 * 2 * 2 * 64 * 4  # layers x (K, V) x KV heads x head dim x float32
BLOCK = 32
USER_WORDS = 8
NATIVE_CPU = {"spec_name": "CpuPeerOffloadingSpec",
              "spec_module_path": "connector.native_tier.cpu_offload"}


def _workload(size: int) -> dict[str, Any]:
    return {"conversations": 1, "turns": 1, "system_words": size - USER_WORDS,
            "user_words": USER_WORDS, "max_tokens": 1, "seed": 1000 + size}


#: Pause before a measured Redis hit that follows evicting prompts: their writes behind
#: (200 ms linger, then ~50 MB) hold CPU-tier slots until written, and a restore stages
#: through those slots (it takes what fits: a run measured 224 of 256 blocks without it).
SETTLE_S = 1.0


def _phases(sizes: list[int], repeats: int, store: bool, evict: bool) -> list[dict[str, Any]]:
    """Per size: a storing run (unless ``store`` is False); with ``evict``, two prompts of the
    largest size (other words) that push it out of kvtier's CPU tier (sized for one largest
    prefix, LRU), so it comes back from Redis; then ``repeats`` measured runs, each after a
    reset of vLLM's prefix cache."""
    phases: list[dict[str, Any]] = []
    for size in sizes:
        if store:
            phases.append({"name": f"store-{size}", "workload": _workload(size)})
        if evict:
            phases += [{"name": f"evict-{size}-{i}",
                        "workload": {**_workload(max(sizes)), "seed": 5000 + 10 * size + i}}
                       for i in range(2)]
        for r in range(repeats):
            phases.append({"name": f"hit-{size}-{r}", "reset_before": store or r > 0,
                           "workload": _workload(size), "machine_threads": True,
                           "settle_s": SETTLE_S if evict else 0.0})
    return phases


def _engine(label: str, model_dir: Path, ktc: dict[str, Any] | None, sizes: list[int],
            repeats: int, log_dir: Path, *, store: bool = True, evict: bool = False,
            secrets: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    spec = {"label": label, "model": "llama", "model_dir": str(model_dir),
            "workload": _workload(sizes[0]), "kv_transfer_config": ktc,
            "phases": _phases(sizes, repeats, store, evict),
            "engine_overrides": {"max_model_len": max(sizes) + 256}}
    print(f"[ttft] {label} ...", flush=True)
    result = run_engine(spec, log_dir=log_dir, timeout_s=1800, quiet=True, secrets=secrets)
    return {p["name"]: p for p in result["phases"]}


def _counter(phase: dict[str, Any], suffix: str) -> float:
    return sum(v for k, v in phase["counters"].items() if k.split("{")[0].endswith(suffix))


def _measure(phases: dict[str, dict[str, Any]], size: int, repeats: int) -> dict[str, Any]:
    runs = [phases[f"hit-{size}-{r}"] for r in range(repeats)]
    ttfts = [run["requests"][0]["ttft_s"] for run in runs]
    first = runs[0]
    return {"ttft_s": statistics.median(ttfts), "ttft_runs_s": ttfts,
            "cached_tokens": first["requests"][0]["cached_tokens"],
            "prompt_tokens": first["requests"][0]["prompt_tokens"],
            "bytes_loaded": _counter(first, "bytes_loaded"),
            "load_s": _counter(first, "load_us") / 1e6,
            "fetch_redis_s": _counter(first, "fetch_us_redis") / 1e6,
            "hit_tokens_cpu": _counter(first, "hit_tokens_cpu"),
            "hit_tokens_redis": _counter(first, "hit_tokens_redis"),
            "wall_s": first["wall_s"], "cpu_ms": _cpu_split(first.get("machine_threads_s")),
            "cpu_window_s": first.get("machine_window_s", 0.0)}


#: Who ran during a measured request: thread-name prefixes ("process / thread"), in order.
CPU_GROUPS = (("engine core (main thread)", "VLLM::EngineCor / VLLM::EngineCor (main)"),
              ("worker (main thread)", "VLLM::Worker / VLLM::Worker (main)"),
              ("kvtier I/O threads", "VLLM::Worker / kvtier-io"),
              ("redis-server", "redis-server /"))


def _cpu_split(threads: dict[str, float] | None) -> dict[str, float]:
    """Milliseconds of CPU the machine's threads ran during one request, in
    :data:`CPU_GROUPS` and ``other``."""
    out = {name: 0.0 for name, _ in CPU_GROUPS} | {"other": 0.0}
    for thread, seconds in (threads or {}).items():
        group = next((name for name, prefix in CPU_GROUPS if thread.startswith(prefix)),
                     "other")
        out[group] += 1e3 * seconds
    return out


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def memcpy_gbps(nbytes: int, reps: int = 5) -> float:
    """The CPU tier's raw limit: one numpy copy of ``nbytes``, best of ``reps``."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="each measurement once")
    parser.add_argument("--sizes", default="1024,4096,8192", help="prompt sizes in tokens")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--log-dir", type=Path, help="engine logs (default: a temp dir)")
    args = parser.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    repeats = 1 if args.quick else 3
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvtier-ttft-"))
    model_dir = prefill_llama()
    prefix = f"kvtier-ttft-{uuid.uuid4().hex[:10]}"
    client = redis.Redis.from_url(args.redis_url)
    client.ping()
    secrets = {"KVTIER_TTFT_REDIS_URL": args.redis_url}
    redis_extra = {"redis_url_env": "KVTIER_TTFT_REDIS_URL", "redis_prefix": prefix,
                   "redis_timeout_s": 5.0}
    largest = max(sizes)
    # Redis restores stage through CPU-tier slots: room for the largest prefix, and no more.
    staging = -(-int(1.25 * largest * KV_BYTES_PER_TOKEN) // (1 << 20)) << 20
    t0 = time.perf_counter()
    try:
        engines = {
            "recompute": _engine("ttft-recompute", model_dir, None, sizes, repeats, log_dir),
            "kvtier CPU": _engine("ttft-kvtier-cpu", model_dir, kvtier_transfer_config(
                {"cpu_bytes": 512 << 20}), sizes, repeats, log_dir),
            "kvtier Redis": _engine("ttft-kvtier-redis", model_dir, kvtier_transfer_config(
                {"cpu_bytes": staging, **redis_extra}), sizes, repeats, log_dir,
                evict=True, secrets=secrets),
            "kvtier Redis, new engine": _engine(
                "ttft-kvtier-redis-new", model_dir,
                kvtier_transfer_config({"cpu_bytes": staging, **redis_extra}), sizes, 1,
                log_dir, store=False, secrets=secrets),
            "native CPU": _engine("ttft-native-cpu", model_dir, {
                "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {**NATIVE_CPU, "cpu_bytes_to_use": 512 << 20}},
                sizes, repeats, log_dir),
        }
        value_bytes = BLOCK * KV_BYTES_PER_TOKEN + 64  # one block's value with its header
        where = urlsplit(args.redis_url)
        limit_redis = bench_redis_benchmark(where.hostname or "127.0.0.1", where.port or 6379,
                                            value_bytes, largest * KV_BYTES_PER_TOKEN)
    finally:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
    limit_cpu = memcpy_gbps(largest * KV_BYTES_PER_TOKEN)
    table = {name: {size: _measure(phases, size, 1 if "new engine" in name else repeats)
                    for size in sizes} for name, phases in engines.items()}
    base = table["recompute"]
    print(f"\nTTFT of a {'/'.join(map(str, sizes))}-token prompt after vLLM's prefix cache "
          f"was reset (median of {repeats}), ms; x = vs recompute; cached tokens")
    print(f"{'engine':<26}" + "".join(f"{size:>24}" for size in sizes))
    for name, row in table.items():
        cells = "".join(
            f"{1000 * m['ttft_s']:>10.0f} ms {m['ttft_s'] / base[s]['ttft_s']:>5.2f}x"
            f" {m['cached_tokens']:>5}" for s, m in row.items())
        print(f"{name:<26}{cells}")
    cpu_hit, redis_hit = table["kvtier CPU"][largest], table["kvtier Redis"][largest]
    restore_cpu = _gbps(cpu_hit["bytes_loaded"], cpu_hit["load_s"])
    restore_redis = _gbps(redis_hit["bytes_loaded"],
                          redis_hit["fetch_redis_s"] + redis_hit["load_s"])
    per_ttft = {"cpu": _gbps(cpu_hit["bytes_loaded"], cpu_hit["ttft_s"]),
                "redis": _gbps(redis_hit["bytes_loaded"], redis_hit["ttft_s"])}
    redis_get = limit_redis.get("get_gbps")
    print(f"\nRestore at {largest} tokens, GB/s of KV moved into vLLM's cache (kvtier's "
          "timers; per second of TTFT in brackets, a lower bound):"
          f"\n  CPU tier   {restore_cpu:6.2f} ({per_ttft['cpu']:5.2f})   memcpy of the same "
          f"bytes {limit_cpu:6.2f}"
          f"\n  Redis      {restore_redis:6.2f} ({per_ttft['redis']:5.2f})   redis-benchmark GET "
          + (f"{redis_get:6.2f}" if redis_get else limit_redis.get("skipped", "n/a")))
    for name in ("kvtier Redis", "kvtier Redis, new engine"):
        m = table[name][largest]
        print(f"\nCPU around the {name} hit at {largest} tokens (ms; the request took "
              f"{1e3 * m['wall_s']:.0f} ms, the readings span {1e3 * m['cpu_window_s']:.0f} "
              f"ms: {1e3 * m['cpu_window_s'] * (os.cpu_count() or 1):.0f} ms of "
              f"{os.cpu_count()} cores): " + ", ".join(
                  f"{group} {ms:.0f}" for group, ms in m["cpu_ms"].items()))
    size_4k = 4096 if 4096 in sizes else largest
    ratios = {
        "ttft_cpu_hit_vs_recompute_4k":
            table["kvtier CPU"][size_4k]["ttft_s"] / base[size_4k]["ttft_s"],
        "ttft_redis_hit_vs_recompute_4k":
            table["kvtier Redis"][size_4k]["ttft_s"] / base[size_4k]["ttft_s"],
        "ttft_redis_new_engine_vs_recompute_4k":
            table["kvtier Redis, new engine"][size_4k]["ttft_s"] / base[size_4k]["ttft_s"],
        "ttft_native_cpu_hit_vs_recompute_4k":
            table["native CPU"][size_4k]["ttft_s"] / base[size_4k]["ttft_s"],
        "restore_gbps_vs_tier_limit_cpu": restore_cpu / limit_cpu,
        "restore_gbps_vs_tier_limit_redis": restore_redis / redis_get if redis_get else None,
    }
    print("\nratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items() if v is not None))
    report = {"sizes": sizes, "repeats": repeats, "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
              "table": {n: {str(s): m for s, m in row.items()} for n, row in table.items()},
              "tier_limits": {"cpu_memcpy_gbps": limit_cpu, "redis_benchmark": limit_redis},
              "restore_gbps": {"cpu": restore_cpu, "redis": restore_redis},
              "restore_gbps_per_ttft": per_ttft,
              "ratios": ratios, "elapsed_s": time.perf_counter() - t0}
    write_result(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
