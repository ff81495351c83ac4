"""Side-by-side throughput of kvtier's tiers against their limits and peers.

    python -m benchmarks.bench_tiers [--quick] [--json PATH] [--redis-url URL]

Payloads are shaped like a real model's KV blocks: Llama-3-8B with 16-token blocks is
32 layers x 2 (K, V) x 8 KV heads x 128 dims x 2 bytes x 16 tokens = 2 MiB per block across
layers; and 64 KiB per-layer pages. In one run:

* CPU tier put/get vs ``numpy.copyto`` of the same bytes (a plain memory copy: the limit);
* Redis tier put_many/get_many/get_many_into (replies received straight into CPU-tier slot
  rows) vs raw redis-py pipelined SET/GET of the same payloads (no header, no checksum);
* the server's own limit: ``redis-benchmark`` SET/GET on the same server, at the same value
  size and kvtier's pipeline depth, >= 64 MiB per shape and command, interleaved with
  kvtier's passes (JSON ``ratios.redis_put_vs_server_limit`` / ``redis_get_vs_server_limit``:
  put_many and get_many_into over redis-benchmark, the worse of the two shapes);
* LMCache's Redis storage backend on the same payloads, from its own venv
  (``~/.cache/kvtier/lmcache-venv``); when it cannot run, the table says exactly why.

Each measurement is the best of several repetitions, baseline and kvtier interleaved.
Unless ``--redis-url`` is given, a private redis-server on a free loopback port is used.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import redis

from benchmarks.harness import best, ratio, write_result
from offload_tiers.cpu_tier import CpuTier
from offload_tiers.keys import BlockKey, BlockKind, Namespace
from offload_tiers.redis.tier import RedisTier
from rigs.redis_server import RedisServer

MiB = 1 << 20
SHAPES = {"block_2MiB": 2 * MiB, "page_64KiB": 64 * 1024}
LMCACHE_VENV = Path(os.environ.get("KVTIER_LMCACHE_VENV",
                                   Path.home() / ".cache/kvtier/lmcache-venv"))
NS = Namespace(model="meta-llama/Meta-Llama-3-8B", dtype="bfloat16", kv_layout="nhd",
               block_size=16)


def keys_for(n: int, salt: str) -> list[BlockKey]:
    return [BlockKey(NS.fingerprint, 0, f"{salt}-{i}".encode().ljust(16, b"."), 16 * (i + 1),
                     BlockKind.FULL) for i in range(n)]


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


# ---------------------------------------------------------------------------- CPU tier
def bench_cpu(size: int, total: int, reps: int) -> dict:
    n = max(4, total // size)
    src = np.random.default_rng(1).integers(0, 256, (n, size), dtype=np.uint8)
    dst = np.empty_like(src)
    out = np.empty_like(src)
    tier = CpuTier(n * size, size)
    keys = keys_for(n, "cpu")
    tier.slab[:] = 0
    dst[:] = 0
    out[:] = 0

    def memcpy_put() -> None:
        for i in range(n):
            np.copyto(dst[i], src[i])

    def tier_put() -> None:
        for i in range(n):
            tier.put(keys[i], src[i])

    def memcpy_get() -> None:
        for i in range(n):
            np.copyto(out[i], dst[i])

    def tier_get() -> None:
        for i in range(n):
            tier.read_into(keys[i], out[i])

    def tier_get_bytes() -> None:
        for i in range(n):
            tier.get(keys[i])

    res = {}
    for fn in (memcpy_put, tier_put, memcpy_get, tier_get, tier_get_bytes):
        fn()  # warm (page faults)
    t = {name: [] for name in ("memcpy_put", "tier_put", "memcpy_get", "tier_get",
                               "tier_get_bytes")}
    for _ in range(reps):  # interleaved
        t["memcpy_put"].append(best(memcpy_put, 1))
        t["tier_put"].append(best(tier_put, 1))
        t["memcpy_get"].append(best(memcpy_get, 1))
        t["tier_get"].append(best(tier_get, 1))
        t["tier_get_bytes"].append(best(tier_get_bytes, 1))
    assert np.array_equal(out, src), "CPU tier returned wrong bytes"
    for name, ts in t.items():
        res[name + "_gbps"] = gbps(n * size, min(ts))
    res.update(blocks=n, bytes=n * size)
    return res


# ---------------------------------------------------------------------------- Redis tier
def bench_redis(url: str, size: int, total: int, reps: int,
                lmcache: LMCacheRunner | None = None,
                server_limit: Callable[[], dict] | None = None) -> dict:
    n = max(4, total // size)
    batch = max(1, (32 * MiB) // size)
    rng = np.random.default_rng(2)
    payloads = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]
    raw = redis.Redis.from_url(url, socket_timeout=60)
    prefix = f"kvtier-bench-{os.getpid()}"
    tier = RedisTier.from_url(url, prefix=prefix, redis_timeout_s=60, strict=True)
    keys = keys_for(n, "redis")
    slots = CpuTier(n * size, size, pin_memory=False).slab  # restores land in CPU-tier slots
    slots[:] = 0
    raw_names = [f"{prefix}-raw:{i}".encode() for i in range(n)]
    chunks = [range(i, min(n, i + batch)) for i in range(0, n, batch)]

    def raw_put() -> None:
        for chunk in chunks:
            pipe = raw.pipeline(transaction=False)
            for i in chunk:
                pipe.set(raw_names[i], payloads[i])
            pipe.execute()

    def tier_put() -> None:
        for chunk in chunks:
            assert tier.put_many([(keys[i], payloads[i]) for i in chunk]) == len(chunk)

    def raw_get() -> None:
        for chunk in chunks:
            pipe = raw.pipeline(transaction=False)
            for i in chunk:
                pipe.get(raw_names[i])
            got = pipe.execute()
            assert all(g is not None for g in got)

    def tier_get() -> None:
        for chunk in chunks:
            got = tier.get_many([keys[i] for i in chunk])
            assert all(g is not None for g in got), "Redis tier missed a block it stored"

    def tier_get_into() -> None:
        for chunk in chunks:
            got = tier.get_many_into([keys[i] for i in chunk], [slots[i] for i in chunk])
            assert all(got), "Redis tier missed a block it stored"

    t: dict[str, list[float]] = {k: [] for k in ("raw_put", "tier_put", "raw_get", "tier_get",
                                                 "tier_get_into")}
    limits: dict[str, float] = {}
    try:
        raw_put()
        tier_put()
        for _ in range(reps):  # interleaved: each contender sees the same machine load
            t["raw_put"].append(best(raw_put, 1))
            t["tier_put"].append(best(tier_put, 1))
            if lmcache is not None and (dt := lmcache.timed("put")) is not None:
                t.setdefault("lmcache_put", []).append(dt)
            t["raw_get"].append(best(raw_get, 1))
            t["tier_get"].append(best(tier_get, 1))
            t["tier_get_into"].append(best(tier_get_into, 1))
            if lmcache is not None and (dt := lmcache.timed("get")) is not None:
                t.setdefault("lmcache_get", []).append(dt)
            if server_limit is not None:
                for k, v in server_limit().items():  # best of the runs, like the others
                    limits[k] = max(limits.get(k, v), v) if isinstance(v, float) else v
        sample = tier.get(keys[0])
        assert sample is not None and bytes(sample) == payloads[0]
        assert all(slots[i].tobytes() == payloads[i] for i in (0, n // 2, n - 1))
    finally:
        tier.delete_many(keys)
        for i in range(0, n, 512):
            raw.delete(*raw_names[i:i + 512])
        tier.close()
    res: dict = {name + "_gbps": gbps(n * size, min(ts)) for name, ts in t.items()}
    res.update(blocks=n, bytes=n * size, batch=batch)
    if server_limit is not None:
        res["server_limit"] = limits
    return res


def kvtier_window(size: int) -> int:
    """Commands kvtier keeps in flight for ``size``-byte values (RedisTier's defaults)."""
    return max(1, min(64, (64 * MiB) // (size + 64)))


def bench_redis_benchmark(host: str, port: int, size: int, total: int) -> dict:
    """One ``redis-benchmark`` SET+GET run: the server's own limit at this value size, with
    kvtier's pipelining (``-P`` = its window), one connection, ``total`` bytes per command
    (at least 64 MiB and 4 pipeline rounds)."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return {"skipped": "redis-benchmark is not installed"}
    window = kvtier_window(size)
    n = max(4 * window, -(-max(total, 64 * MiB) // size))
    cmd = [exe, "-h", host, "-p", str(port), "-t", "set,get", "-d", str(size), "-n", str(n),
           "-c", "1", "-P", str(window), "--csv", "-q"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    except (subprocess.SubprocessError, OSError) as exc:
        return {"skipped": f"redis-benchmark failed: {exc}"}
    res: dict[str, object] = {"requests": n, "bytes_per_command": n * size,
                              "pipeline": window, "command": " ".join(cmd)}
    for row in csv.reader(io.StringIO(proc.stdout)):
        if len(row) >= 2 and row[0] in ("SET", "GET"):
            rps = float(row[1])
            res[row[0].lower() + "_gbps"] = rps * size / 1e9
    if "set_gbps" not in res or "get_gbps" not in res:
        return {"skipped": f"redis-benchmark printed no SET/GET rows: {proc.stdout[-200:]!r}"}
    return res


# ---------------------------------------------------------------------------- LMCache
LMCACHE_DRIVER = textwrap.dedent(r"""
    import asyncio, json, sys, threading, time
    size, n, reps, url = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    try:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.connector.redis_connector import RedisConnector
    except Exception as exc:
        print(json.dumps({"skipped": f"import failed: {type(exc).__name__}: {exc}"}))
        sys.exit(0)
    # an LMCache chunk of 16 tokens, Llama-3-8B geometry: (layers, K/V, tokens, heads, dim)
    layers = max(1, size // (2 * 16 * 8 * 128 * 2))
    shape = (layers, 2, 16, 8, 128)
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=16, local_cpu=True,
            max_local_cpu_size=(3 * n * size) / 2**30 + 0.5, remote_url=url)
    meta = LMCacheMetadata("bench-llama", 1, 1, 0, 0, torch.bfloat16, shape, chunk_size=16)
    backend = LocalCPUBackend(cfg, meta)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    conn = RedisConnector(url, loop, backend)
    assert conn.full_chunk_size_bytes == size, (conn.full_chunk_size_bytes, size)
    keys = [CacheEngineKey("bench-llama", 1, 0, 10_000 + i, torch.bfloat16) for i in range(n)]
    objs = []
    gen = torch.Generator().manual_seed(3)
    for i in range(n):
        obj = backend.allocate(conn.meta_shapes, conn.meta_dtypes, conn.meta_fmt)
        flat = obj.tensor.view(torch.uint8).reshape(-1)
        flat.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen))
        objs.append(obj)
    batch = max(1, (32 << 20) // size)
    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result()
    async def get_all(ks):
        return await asyncio.gather(*(conn.get(k) for k in ks))
    def put():
        for i in range(0, n, batch):
            run(conn.batched_put(keys[i:i + batch], objs[i:i + batch]))
    def get():
        for i in range(0, n, batch):
            got = run(get_all(keys[i:i + batch]))
            assert all(g is not None for g in got), "LMCache missed a stored chunk"
            for g in got:
                g.ref_count_down()
    put()
    first = run(conn.get(keys[0]))
    verified = first is not None and bytes(first.byte_array) == bytes(objs[0].byte_array)
    first.ref_count_down()
    print(json.dumps({"ready": True, "verified": verified, "chunk_shape": list(shape)}),
          flush=True)
    for line in sys.stdin:  # one timed pass per command, so the caller can interleave
        cmd = line.strip()
        if cmd not in ("put", "get"):
            break
        t0 = time.perf_counter()
        put() if cmd == "put" else get()
        print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)
    import redis as redis_py
    client = redis_py.Redis.from_url(url)
    for k in keys:
        client.delete(k.to_string() + "kv_bytes", k.to_string() + "metadata")
""")


def setup_lmcache_venv() -> None:
    """Build LMCache's own venv; torch comes from this interpreter's env through a .pth file
    (LMCache only needs *a* torch; its other pins stay inside its venv)."""
    import torch  # noqa: PLC0415 - only for locating it

    base = getattr(sys, "_base_executable", sys.executable)  # same Python as torch's env
    subprocess.run([base, "-m", "venv", str(LMCACHE_VENV)], check=True)
    site = next((LMCACHE_VENV / "lib").glob("python3*/site-packages"))
    (site / "zz_kvtier_torch.pth").write_text(str(Path(torch.__file__).parents[1]) + "\n")
    subprocess.run([str(LMCACHE_VENV / "bin" / "pip"), "install", "-q", "lmcache==0.5.6"],
                   check=True, timeout=900)


class LMCacheRunner:
    """LMCache's RedisConnector in its own venv, driven one timed pass at a time (so its
    passes interleave with kvtier's and raw redis-py's on this shared machine)."""

    def __init__(self, url: str, size: int, n: int, budget_s: float) -> None:
        self.skipped: str | None = None
        self.info: dict = {}
        self.proc: subprocess.Popen | None = None
        self._err = tempfile.TemporaryFile()
        python = LMCACHE_VENV / "bin" / "python"
        if not python.exists():
            self.skipped = (f"no LMCache venv at {LMCACHE_VENV}; build it with "
                            "`python -m benchmarks.bench_tiers --setup-lmcache`")
            return
        self.proc = subprocess.Popen(
            [str(python), "-c", LMCACHE_DRIVER, str(size), str(n), "0", url],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True)
        self._deadline = time.monotonic() + budget_s
        self._watchdog = threading.Timer(budget_s, self.proc.kill)
        self._watchdog.daemon = True
        self._watchdog.start()
        msg = self._read()
        if msg is not None and "skipped" in msg:
            self.skipped = msg["skipped"]
        elif msg is None or not msg.get("ready"):
            self.skipped = self.skipped or self._failure("did not start")
        else:
            self.info = {k: v for k, v in msg.items() if k != "ready"}

    def _failure(self, what: str) -> str:
        self._err.seek(0)
        lines = [ln for ln in self._err.read().decode(errors="replace").splitlines()
                 if ln.strip() and "INFO" not in ln]
        tail = lines[-1] if lines else "no error output"
        if time.monotonic() > self._deadline:
            return f"LMCache driver exceeded its time budget ({what})"
        return f"LMCache driver {what}: {tail}"

    def _read(self) -> dict | None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        return None

    def timed(self, cmd: str) -> float | None:
        if self.skipped or self.proc is None or self.proc.stdin is None:
            return None
        try:
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
        except OSError:
            self.skipped = self._failure(f"died before {cmd}")
            return None
        msg = self._read()
        if msg is None or "seconds" not in msg:
            self.skipped = self._failure(f"failed during {cmd}")
            return None
        return float(msg["seconds"])

    def close(self) -> None:
        if self.proc is not None:
            try:
                if self.proc.stdin is not None:
                    self.proc.stdin.write("quit\n")
                    self.proc.stdin.close()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
            self._watchdog.cancel()


# ---------------------------------------------------------------------------- server + main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, fewer repetitions")
    ap.add_argument("--json", type=Path, help="write the results as JSON here")
    ap.add_argument("--redis-url", help="benchmark this Redis instead of a private one")
    ap.add_argument("--lmcache-budget-s", type=float, default=900.0)
    ap.add_argument("--setup-lmcache", action="store_true",
                    help=f"first build LMCache's venv at {LMCACHE_VENV} (pip, up to 15 min)")
    args = ap.parse_args(argv)
    if args.setup_lmcache:
        setup_lmcache_venv()
    cpu_total = (64 if args.quick else 512) * MiB
    redis_total = (64 if args.quick else 256) * MiB  # per shape and command, both contenders
    reps = 3 if args.quick else 5

    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-"))
    server = None
    if args.redis_url:
        url = args.redis_url
        parsed = redis.connection.parse_url(url)
        host, port = parsed.get("host", "127.0.0.1"), int(parsed.get("port", 6379))
    else:
        server = RedisServer(tmp, "--maxmemory-policy", "allkeys-lru").start()
        port = server.port
        host, url = "127.0.0.1", f"redis://127.0.0.1:{port}/0"
    results: dict = {"config": {"quick": args.quick, "reps": reps, "cpu_total_bytes": cpu_total,
                                "redis_total_bytes": redis_total, "redis": url,
                                "cpus": os.cpu_count()}, "shapes": {}}
    try:
        for shape, size in SHAPES.items():
            print(f"[{shape}] CPU tier ...", flush=True)
            cpu = bench_cpu(size, cpu_total, reps)
            print(f"[{shape}] Redis tier, redis-benchmark ...", flush=True)
            lmc = LMCacheRunner(url, size, max(4, redis_total // size),
                                args.lmcache_budget_s / len(SHAPES))
            try:
                red = bench_redis(url, size, redis_total, reps, lmc,
                                  lambda size=size: bench_redis_benchmark(host, port, size,
                                                                          redis_total))
            finally:
                lmc.close()
            lm = dict(lmc.info)
            if "lmcache_put_gbps" in red and "lmcache_get_gbps" in red and not lmc.skipped:
                lm.update(put_gbps=red.pop("lmcache_put_gbps"),
                          get_gbps=red.pop("lmcache_get_gbps"),
                          backend="lmcache.v1 RedisConnector (redis.asyncio) + LocalCPUBackend")
            else:
                red.pop("lmcache_put_gbps", None)
                red.pop("lmcache_get_gbps", None)
                lm = {"skipped": lmc.skipped or "LMCache produced no timings"}
            rb = red.pop("server_limit")
            results["shapes"][shape] = {"size": size, "cpu": cpu, "redis": red,
                                        "redis_benchmark": rb, "lmcache": lm}
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    by_shape = {}
    for shape, r in results["shapes"].items():
        c, d = r["cpu"], r["redis"]
        by_shape[shape] = {
            "cpu_put_vs_memcpy": ratio(c["tier_put_gbps"], c["memcpy_put_gbps"]),
            "cpu_get_vs_memcpy": ratio(c["tier_get_gbps"], c["memcpy_get_gbps"]),
            "redis_put_vs_raw": ratio(d["tier_put_gbps"], d["raw_put_gbps"]),
            "redis_get_vs_raw": ratio(d["tier_get_gbps"], d["raw_get_gbps"]),
        }
        rb = r["redis_benchmark"]
        if "set_gbps" in rb:
            by_shape[shape]["redis_put_vs_server_limit"] = ratio(d["tier_put_gbps"],
                                                                 rb["set_gbps"])
            by_shape[shape]["redis_get_vs_server_limit"] = ratio(d["tier_get_into_gbps"],
                                                                 rb["get_gbps"])
        lm = r["lmcache"]
        if "put_gbps" in lm:
            by_shape[shape]["redis_put_vs_lmcache"] = ratio(d["tier_put_gbps"], lm["put_gbps"])
            by_shape[shape]["redis_get_vs_lmcache"] = ratio(d["tier_get_gbps"], lm["get_gbps"])
    results["ratios_by_shape"] = by_shape
    results["ratios"] = dict(by_shape["block_2MiB"])
    results["ratios"]["worst_shape"] = {
        k: min(v[k] for v in by_shape.values()) for k in by_shape["block_2MiB"]
        if all(k in v for v in by_shape.values())}
    for k in ("redis_put_vs_server_limit", "redis_get_vs_server_limit"):  # worst of the shapes
        if k in results["ratios"]["worst_shape"]:
            results["ratios"][k] = results["ratios"]["worst_shape"][k]
    print_table(results)
    if args.json:
        write_result(args.json, results)
        print(f"wrote {args.json}")
    return 0


def print_table(results: dict) -> None:
    rows = []
    for shape, r in results["shapes"].items():
        c, d, rb, lm = r["cpu"], r["redis"], r["redis_benchmark"], r["lmcache"]
        rows += [
            (shape, "CPU put", c["tier_put_gbps"], "numpy.copyto", c["memcpy_put_gbps"]),
            (shape, "CPU get (read_into)", c["tier_get_gbps"], "numpy.copyto",
             c["memcpy_get_gbps"]),
            (shape, "CPU get (bytes)", c["tier_get_bytes_gbps"], "numpy.copyto",
             c["memcpy_get_gbps"]),
            (shape, "Redis put_many", d["tier_put_gbps"], "redis-py pipeline SET",
             d["raw_put_gbps"]),
            (shape, "Redis get_many", d["tier_get_gbps"], "redis-py pipeline GET",
             d["raw_get_gbps"]),
            (shape, "Redis get_many_into", d["tier_get_into_gbps"], "redis-py pipeline GET",
             d["raw_get_gbps"]),
        ]
        if "set_gbps" in rb:
            rows.append((shape, "Redis put_many", d["tier_put_gbps"], "redis-benchmark SET",
                         rb["set_gbps"]))
            rows.append((shape, "Redis get_many_into", d["tier_get_into_gbps"],
                         "redis-benchmark GET", rb["get_gbps"]))
        if "put_gbps" in lm:
            rows.append((shape, "Redis put_many", d["tier_put_gbps"], "LMCache Redis put",
                         lm["put_gbps"]))
            rows.append((shape, "Redis get_many", d["tier_get_gbps"], "LMCache Redis get",
                         lm["get_gbps"]))
    print()
    print(f"{'shape':<11} {'kvtier':<20} {'GB/s':>7}   {'vs':<22} {'GB/s':>7}  {'ratio':>6}")
    print("-" * 82)
    for shape, name, mine, other_name, other in rows:
        print(f"{shape:<11} {name:<20} {mine:7.2f}   {other_name:<22} {other:7.2f}  "
              f"{ratio(mine, other) or float('nan'):6.2f}")
    for shape, r in results["shapes"].items():
        for what in ("redis_benchmark", "lmcache"):
            if "skipped" in r[what]:
                print(f"{shape}: {what} not measured: {r[what]['skipped']}")
    print("ratios:", json.dumps(results["ratios"]))


if __name__ == "__main__":
    raise SystemExit(main())
