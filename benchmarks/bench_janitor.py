"""Redis janitor pass cost, side by side with a naive sweep that GETs every value.

A private redis-server on a free loopback port holds N valid values of ``--value-bytes``
(written by RedisTier) plus 1% bad ones. Each round restores the bad ones and runs
(a) one unpaced janitor pass (SCAN + pipelined GETRANGE 0 63 / STRLEN + conditional delete)
and (b) a naive pass (SCAN + pipelined GET of each whole value, judged), interleaved; best
of ``--rounds``. Prints a table with ratios and, with ``--json``, the numbers.

    python -m benchmarks.bench_janitor [--keys 20000] [--value-bytes 65536] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import redis

from benchmarks.harness import write_result
from offload_tiers import codec
from offload_tiers.keys import BlockKey, BlockKind, Namespace, parse_key_name
from offload_tiers.redis.janitor import RedisJanitor, judge
from offload_tiers.redis.tier import RedisTier
from rigs.redis_server import RedisServer

NS = Namespace("bench", "float16", "nhd", 16)


def _naive_pass(client: redis.Redis, prefix: str) -> tuple[int, int]:
    """What a janitor without header reads would do: GET every value, decode it."""
    bad = seen = 0
    plen = len(prefix) + 1
    for keys in _scan_batches(client, prefix):
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        for k, value in zip(keys, pipe.execute(), strict=True):
            seen += len(value)
            parsed = parse_key_name(k[plen:])
            if parsed is None or judge(parsed, value[:64], len(value)) is not None:
                bad += 1
    return bad, seen


def _scan_batches(client: redis.Redis, prefix: str) -> list[list[bytes]]:
    out, cursor = [], 0
    while True:
        cursor, keys = client.scan(cursor, match=f"{prefix}:*", count=100)
        if keys:
            out.append(keys)
        if cursor == 0:
            return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=20_000)
    ap.add_argument("--value-bytes", type=int, default=64 << 10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--paced", type=float, default=5000.0,
                    help="also time one pass at this max_keys_per_s (0 = skip)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed")
    workdir = tempfile.mkdtemp(prefix="kvtier-bench-janitor-")
    server = RedisServer(Path(workdir)).start()
    url = server.url
    try:
        client = redis.Redis.from_url(url)
        payload = os.urandom(args.value_bytes)
        with RedisTier.from_url(url, prefix="b", strict=True, max_inflight_bytes=32 << 20) as t:
            for start in range(0, args.keys, 500):
                t.put_many([(BlockKey(NS.fingerprint, 0, i.to_bytes(8, "big"), 16,
                                      BlockKind.FULL), payload)
                            for i in range(start, min(start + 500, args.keys))])
        n_bad = max(1, args.keys // 100)
        bad = {f"b:{NS.fingerprint}:0:{(10**9 + i).to_bytes(8, 'big').hex()}".encode():
               codec.encode_bytes(BlockKey(NS.fingerprint, 1, b"x", 16, BlockKind.FULL),
                                  payload) for i in range(n_bad)}  # group mismatch
        best = {"janitor": float("inf"), "naive": float("inf")}
        deleted = naive_bad = 0
        for _ in range(args.rounds):
            client.mset(bad)
            j = RedisJanitor(url, "b", max_keys_per_s=1e12)
            t0 = time.perf_counter()
            assert j.run_pass()
            best["janitor"] = min(best["janitor"], time.perf_counter() - t0)
            deleted = j.stats()["deleted_total"]
            j.stop()
            client.mset(bad)
            t0 = time.perf_counter()
            naive_bad, _ = _naive_pass(client, "b")
            best["naive"] = min(best["naive"], time.perf_counter() - t0)
        total = args.keys + n_bad
        rates = {k: total / v for k, v in best.items()}
        print(f"{total} keys of {args.value_bytes} B ({n_bad} bad), best of {args.rounds}")
        print(f"{'pass':<34}{'seconds':>9}{'keys/s':>12}")
        print(f"{'janitor (header + length only)':<34}{best['janitor']:>9.3f}"
              f"{rates['janitor']:>12.0f}")
        print(f"{'naive (GET every value)':<34}{best['naive']:>9.3f}{rates['naive']:>12.0f}")
        print(f"ratio janitor/naive keys/s: {rates['janitor'] / rates['naive']:.1f}"
              f"   deleted {deleted}, naive found {naive_bad}")
        paced = None
        if args.paced:
            client.mset(bad)
            j = RedisJanitor(url, "b", max_keys_per_s=args.paced)
            t0 = time.perf_counter()
            assert j.run_pass()
            wall = time.perf_counter() - t0
            st = j.stats()
            j.stop()
            per_call = st["keys_examined_budget"] / st["scan_calls"]
            floor = (st["scan_calls"] - 1) * per_call / args.paced
            paced = {"max_keys_per_s": args.paced, "seconds": wall, "floor_s": floor,
                     "examined_per_s": st["keys_examined_budget"] / wall}
            print(f"paced at {args.paced:.0f} keys/s: {wall:.2f} s (pacing floor {floor:.2f} s), "
                  f"{st['keys_examined_budget'] / wall:.0f} keys examined/s")
        result = {"keys": total, "paced": paced, "value_bytes": args.value_bytes, "bad": n_bad,
                  "seconds": best, "keys_per_s": rates, "deleted": deleted,
                  "ratio_keys_per_s": rates["janitor"] / rates["naive"]}
        write_result(args.json, result)
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
