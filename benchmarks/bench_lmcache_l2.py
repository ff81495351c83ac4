"""kvtier's LMCache L2 adapter beside LMCache's own ``resp`` and ``valkey`` adapters, on one
Redis, in one run (issue #48). Run it in ``.venv-lmcache`` (``make lmcache`` builds it):

    .venv-lmcache/bin/python -m benchmarks.bench_lmcache_l2 --json \
        benchmarks/results/lmcache_l2.json

Each adapter is built the way LMCache builds it (``--l2-adapter`` JSON through its config
parser and factory) and driven by LMCache's own L2 benchmark runner
(``lmcache.cli.commands.bench.l2_adapter_bench``: ``bench_store`` then ``bench_load`` over the
same keys, each round ``--in-flight`` submits of ``--num-keys`` chunks, timed from the first
submit to the last completion eventfd). A chunk is LMCache's default 256 tokens at Llama-3.1-8B's
geometry (32 layers, K and V, 8 KV heads x 128, bf16): 32 MiB. The Redis is a redis-server of
this run's own (loopback, no persistence), flushed between adapters; adapters take turns
(``--reps`` passes over all three, each pass starting with the next adapter: the first after
a fresh server pays for Redis's memory growth), and each op's figure is its median round.
Loaded bytes are checked against the stored ones after the timed rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.harness import write_result

os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

import torch
from lmcache.cli.commands.bench.l2_adapter_bench.data import (
    make_memory_objects,
    make_object_keys,
)
from lmcache.cli.commands.bench.l2_adapter_bench.runner import (
    bench_load,
    bench_store,
)
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import (
    parse_args_to_l2_adapters_config,
)

from rigs.redis_server import RedisServer

#: Llama-3.1-8B: layers, KV heads, head dim; bf16; LMCache's default chunk of 256 tokens.
LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES, CHUNK_TOKENS = 32, 8, 128, 2, 256
CHUNK_BYTES = 2 * LAYERS * CHUNK_TOKENS * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # 32 MiB


def specs(port: int) -> dict[str, dict[str, Any]]:
    """The ``--l2-adapter`` JSON of each adapter, as an LMCache user writes it."""
    return {
        "kvtier": {"type": "plugin", "module_path": "connector.lmcache_l2.adapter",
                   "class_name": "KvtierL2Adapter",
                   "adapter_params": {"redis_url": f"redis://127.0.0.1:{port}/0",
                                      "key_prefix": "bench"}},
        "lmcache_resp": {"type": "resp", "host": "127.0.0.1", "port": port},
        "lmcache_valkey": {"type": "valkey", "startup_nodes": f"127.0.0.1:{port}"},
    }


def build(spec: dict[str, Any]) -> Any:
    ns = argparse.Namespace(l2_adapter=[json.dumps(spec)])
    return create_l2_adapter(parse_args_to_l2_adapters_config(ns).adapters[0])


def run_one(name: str, spec: dict[str, Any], buffer: torch.Tensor, args: argparse.Namespace,
            log: Any) -> dict[str, Any]:
    """LMCache's store then load rounds for one adapter; durations and a byte check."""
    n, k = args.in_flight, args.num_keys
    per_round = n * k
    total = args.warmup + args.rounds

    def keys_for(r: int) -> list[list]:
        return [make_object_keys(k, key_offset=r * per_round + i * k) for i in range(n)]

    store_objs = [make_memory_objects(buffer, k, CHUNK_BYTES, i * k * CHUNK_BYTES)
                  for i in range(n)]
    load_objs = [make_memory_objects(buffer, k, CHUNK_BYTES, (per_round + i * k) * CHUNK_BYTES,
                                     fill_offset=1) for i in range(n)]
    for objs in store_objs:  # random bytes, not a fill pattern Redis or a codec might favour
        for j, obj in enumerate(objs):
            gen = torch.Generator().manual_seed(1000 + j)
            obj.raw_data.copy_(torch.randint(0, 256, obj.raw_data.shape, dtype=torch.uint8,
                                             generator=gen))
    adapter = build(spec)
    try:
        st = bench_store(adapter, n, k, CHUNK_BYTES, total, keys_for, lambda r: store_objs, log)
        ld = bench_load(adapter, n, k, CHUNK_BYTES, total, keys_for, lambda r: load_objs, log)
        verified = all(torch.equal(a.raw_data, b.raw_data)
                       for sa, la in zip(store_objs, load_objs, strict=True)
                       for a, b in zip(sa, la, strict=True))
    finally:
        adapter.close()
    ok = (st.timed_out_rounds == 0 and ld.timed_out_rounds == 0
          and all(c == per_round for c in st.success_counts)
          and all(c == per_round for c in ld.success_counts))
    return {"store_s": st.round_durations[args.warmup:], "load_s": ld.round_durations[args.warmup:],
            "all_keys_ok": ok, "bytes_verified": verified}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-keys", type=int, default=8, help="chunks per submit")
    ap.add_argument("--in-flight", type=int, default=1, help="submits per round")
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds per op")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    ap.add_argument("--reps", type=int, default=4, help="passes over the three adapters")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--verbose", action="store_true", help="LMCache's per-round lines")
    args = ap.parse_args(argv)
    log = print if args.verbose else (lambda _msg: None)

    per_round_bytes = args.in_flight * args.num_keys * CHUNK_BYTES
    buffer = torch.empty(2 * per_round_bytes, dtype=torch.uint8)
    rows: dict[str, dict[str, list[float]]] = {}
    checks: dict[str, bool] = {}
    with tempfile.TemporaryDirectory(prefix="bench-lmcache-l2-") as tmp:
        server = RedisServer(Path(tmp)).start()
        try:
            names = list(specs(server.port).items())
            for rep in range(args.reps):
                turn = names[rep % len(names):] + names[:rep % len(names)]  # who goes first
                for name, spec in turn:
                    server.client().flushall()
                    out = run_one(name, spec, buffer, args, log)
                    row = rows.setdefault(name, {"store_s": [], "load_s": []})
                    row["store_s"] += out["store_s"]
                    row["load_s"] += out["load_s"]
                    checks[name] = checks.get(name, True) and out["all_keys_ok"] \
                        and out["bytes_verified"]
                    print(f"[rep {rep + 1}] {name}: store "
                          f"{per_round_bytes / statistics.median(out['store_s']) / 1e9:.2f} GB/s, "
                          f"load {per_round_bytes / statistics.median(out['load_s']) / 1e9:.2f} "
                          f"GB/s, keys ok {out['all_keys_ok']}, bytes ok {out['bytes_verified']}",
                          flush=True)
        finally:
            server.stop()

    adapters: dict[str, Any] = {}
    for name, row in rows.items():
        store_gbps = per_round_bytes / statistics.median(row["store_s"]) / 1e9
        load_gbps = per_round_bytes / statistics.median(row["load_s"]) / 1e9
        adapters[name] = {"store_gb_s": round(store_gbps, 3), "load_gb_s": round(load_gbps, 3),
                          "store_round_s": [round(s, 4) for s in row["store_s"]],
                          "load_round_s": [round(s, 4) for s in row["load_s"]],
                          "all_keys_ok_and_bytes_verified": checks[name]}
    kv, resp, valkey = adapters["kvtier"], adapters["lmcache_resp"], adapters["lmcache_valkey"]
    result = {
        "geometry": {"model": "Llama-3.1-8B", "layers": LAYERS, "kv_heads": KV_HEADS,
                     "head_dim": HEAD_DIM, "dtype": "bfloat16", "chunk_tokens": CHUNK_TOKENS,
                     "chunk_bytes": CHUNK_BYTES},
        "workload": {"num_keys": args.num_keys, "in_flight": args.in_flight,
                     "rounds": args.rounds, "warmup": args.warmup, "reps": args.reps,
                     "bytes_per_round": per_round_bytes, "figure": "median round",
                     "redis": "one redis-server of the run's own on loopback, flushed "
                              "between adapters", "cpus": os.cpu_count()},
        "adapters": adapters,
        "kvtier_store_vs_lmcache_resp": round(kv["store_gb_s"] / resp["store_gb_s"], 3),
        "kvtier_load_vs_lmcache_resp": round(kv["load_gb_s"] / resp["load_gb_s"], 3),
        "kvtier_store_vs_lmcache_valkey": round(kv["store_gb_s"] / valkey["store_gb_s"], 3),
        "kvtier_load_vs_lmcache_valkey": round(kv["load_gb_s"] / valkey["load_gb_s"], 3),
    }
    print(f"\nLMCache L2 adapters, {CHUNK_BYTES >> 20} MiB chunks (256 tokens, Llama-3.1-8B), "
          f"{args.in_flight} x {args.num_keys} per round, median of {args.rounds * args.reps}")
    print(f"{'adapter':<16}{'store GB/s':>12}{'load GB/s':>12}  verified")
    for name, row in adapters.items():
        print(f"{name:<16}{row['store_gb_s']:>12.2f}{row['load_gb_s']:>12.2f}  "
              f"{row['all_keys_ok_and_bytes_verified']}")
    print(f"kvtier vs resp: store {result['kvtier_store_vs_lmcache_resp']:.2f}x, "
          f"load {result['kvtier_load_vs_lmcache_resp']:.2f}x")
    write_result(args.json, result)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
