"""How fast the backfill drains an outage's saves into Redis, side by side with the link.

kvtier's two halves (real scheduler and worker, real Redis through a loopback proxy; the
wiring of ``rigs/halves.py``, no vLLM) on one TP rank, ``--blocks`` KV blocks of
``--block-kib`` each. Engine steps are simulated: each step plans, runs the worker's side,
waits ``--step-ms`` (the forward) and hands the worker's report so far to the scheduler, as
vLLM does; nothing waits for Redis. Three paths write the same blocks:

* ``pipelined SET``: redis-py, one connection, pipelines of 32 values of the same size
  (the link's limit for a Python client; kvtier's header not included);
* ``saves, Redis up``: kvtier saves 32 blocks per step, written behind (the normal path),
  timed from the first step until every write is answered; what the writer's queue could
  not take is dropped (counted; those entries wait for the backfill);
* ``backfill``: the same saves while the proxy refuses Redis (CPU tier only), then the proxy
  forwards; timed from the first step with Redis reported up until every backfill is
  answered. It writes one batch (32) at a time.

Steps are at least ``--step-ms`` apart: a loop of empty steps in this one process would hold
the GIL against the writer threads (an engine's scheduler and workers are processes).

    python -m benchmarks.bench_backfill [--blocks 1024] [--block-kib 64]
        [--step-ms 2 10 30] [--redis-url redis://127.0.0.1:6379/0] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from benchmarks.harness import load_1m, write_result
from connector.vllm_connector.config import TieredConfig
from connector.vllm_connector.plan import WorkerReport
from rigs.halves import BS, Halves
from rigs.redis_keys import delete_prefix
from rigs.sched_doubles import Blk, Req
from rigs.tcp_proxy import TcpProxy

PER_STEP = 32  # blocks computed (and saved) per step: one backfill batch


def _engine(url: str, prefix: str, blocks: int, block_kib: int) -> Halves:
    width = block_kib * 1024 // (2 * BS * 4)  # [2, BS, width] float32 per block
    probe = Halves(TieredConfig(cpu_bytes=1 << 20), num_blocks=2, width=width)
    slot_bytes = probe.sched.directory.slot_bytes
    probe.close()
    config = TieredConfig(cpu_bytes=(blocks + 64) * slot_bytes, redis_url=url,
                          redis_prefix=prefix, redis_timeout_s=5.0)
    e = Halves(config, num_blocks=blocks + 1, width=width)
    e.fill(range(1, blocks + 1), seed=1)
    return e


def _step(e: Halves, computed: dict[str, int], step_s: float) -> None:
    """One engine step: plan, the worker's side, the forward, the report so far."""
    plan = e.plan(computed)
    e.run(plan)
    if step_s:
        time.sleep(step_s)  # the forward (a benchmark's stand-in, not a synchronisation)
    merged = WorkerReport()
    for rank in e.ranks:
        merged.merge(rank.worker.take_report())
    e.sched.on_report(merged)


def _until(e: Halves, done: Callable[[], bool], step_s: float, limit_s: float = 600.0) -> int:
    """Steps until ``done()``; their number."""
    steps, deadline = 0, time.monotonic() + limit_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError("not done within the benchmark's limit")
        _step(e, {}, step_s)
        steps += 1
    return steps


def _count(e: Halves, name: str) -> int:
    return sum(e.counter(name))


def _save_all(e: Halves, blocks: int, step_s: float) -> int:
    """Compute ``blocks`` blocks, PER_STEP per step (each step saves the ones it finished)."""
    e.admit(Req("r", blocks * BS + 4), [[Blk(i, i * BS) for i in range(1, blocks + 1)]], 0)
    steps = 0
    for done in range(PER_STEP, blocks + PER_STEP, PER_STEP):
        _step(e, {"r": min(done, blocks) * BS}, step_s)
        steps += 1
    return steps


def saves_while_up(url: str, blocks: int, block_kib: int, step_s: float) -> dict[str, Any]:
    prefix = f"kvtier-bench-{uuid.uuid4().hex[:12]}"
    e = _engine(url, prefix, blocks, block_kib)
    try:
        _until(e, lambda: e.sched.redis_up, step_s)
        start = time.perf_counter()
        steps = _save_all(e, blocks, step_s)
        steps += _until(e, lambda: _count(e, "blocks_written_redis")
                        + _count(e, "redis_write_failures") >= blocks, step_s)
        seconds = time.perf_counter() - start
        written = _count(e, "blocks_written_redis")
        nbytes = _count(e, "bytes_written_redis")
    finally:
        e.close()
        delete_prefix(url, prefix)
    return {"path": "saves, Redis up", "saved": blocks, "blocks": written, "bytes": nbytes,
            "seconds": seconds, "steps": steps}


def backfill(redis_port: int, blocks: int, block_kib: int, step_s: float) -> dict[str, Any]:
    url = f"redis://127.0.0.1:{redis_port}/0"
    prefix = f"kvtier-bench-{uuid.uuid4().hex[:12]}"
    proxy = TcpProxy("127.0.0.1", redis_port).start()
    e = _engine(proxy.url, prefix, blocks, block_kib)
    try:
        _until(e, lambda: e.sched.redis_up, step_s)
        proxy.mode = "refuse"
        proxy.reset_all()
        _save_all(e, blocks, step_s)
        _until(e, lambda: _count(e, "redis_write_failures")
               + e.sched.counters.snapshot()["redis_unavailable_saves"] >= blocks, step_s)
        assert _count(e, "blocks_written_redis") == 0, "a save reached Redis during the outage"
        proxy.mode = "forward"
        _until(e, lambda: e.sched.redis_up, step_s)  # the probe's back-off: not timed
        start = time.perf_counter()
        steps = _until(e, lambda: _count(e, "blocks_backfilled_redis")
                       + _count(e, "redis_backfill_failures") >= blocks, step_s)
        seconds = time.perf_counter() - start
        written = _count(e, "blocks_backfilled_redis")
        nbytes = _count(e, "bytes_backfilled_redis")
    finally:
        e.close()
        proxy.stop()
        delete_prefix(url, prefix)
    return {"path": "backfill", "saved": blocks, "blocks": written, "bytes": nbytes,
            "seconds": seconds, "steps": steps}


def pipelined_set(url: str, blocks: int, block_kib: int) -> dict[str, Any]:
    prefix = f"kvtier-bench-{uuid.uuid4().hex[:12]}"
    client = redis.Redis.from_url(url)
    value = os.urandom(block_kib * 1024)
    try:
        start = time.perf_counter()
        for first in range(0, blocks, PER_STEP):
            pipe = client.pipeline(transaction=False)
            for i in range(first, min(first + PER_STEP, blocks)):
                pipe.set(f"{prefix}:{i}", value)
            pipe.execute()
        seconds = time.perf_counter() - start
    finally:
        client.close()
        delete_prefix(url, prefix)
    return {"path": "pipelined SET", "saved": None, "blocks": blocks,
            "bytes": blocks * len(value), "seconds": seconds, "steps": None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--block-kib", type=int, default=64)
    ap.add_argument("--step-ms", type=float, nargs="+", default=[2.0, 10.0, 30.0])
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if min(args.step_ms) <= 0:
        ap.error("--step-ms must be positive (see the module's docstring)")
    port = redis.Redis.from_url(args.redis_url).connection_pool.connection_kwargs["port"]
    rows = [pipelined_set(args.redis_url, args.blocks, args.block_kib)]
    for step_ms in args.step_ms:
        for run in (saves_while_up(args.redis_url, args.blocks, args.block_kib,
                                   step_ms / 1000),
                    backfill(port, args.blocks, args.block_kib, step_ms / 1000)):
            rows.append({**run, "step_ms": step_ms})
    link = rows[0]["bytes"] / rows[0]["seconds"]
    print(f"{args.blocks} blocks of {args.block_kib} KiB, {PER_STEP} per step / batch; "
          f"load {load_1m():.1f}")
    print(f"{'path':<18}{'step ms':>8}{'saved':>7}{'written':>8}{'MB':>8}{'seconds':>9}"
          f"{'MB/s':>9}{'steps':>7}{'vs SET':>8}")
    for r in rows:
        rate = r["bytes"] / r["seconds"]
        r["mb_per_s"] = rate / 1e6
        r["vs_pipelined_set"] = rate / link
        step = "-" if r.get("step_ms") is None else f"{r['step_ms']:g}"
        steps = "-" if r["steps"] is None else str(r["steps"])
        saved = "-" if r["saved"] is None else str(r["saved"])
        print(f"{r['path']:<18}{step:>8}{saved:>7}{r['blocks']:>8}{r['bytes'] / 1e6:>8.1f}"
              f"{r['seconds']:>9.3f}{r['mb_per_s']:>9.1f}{steps:>7}"
              f"{r['vs_pipelined_set']:>7.2f}×")
    write_result(args.json, {"blocks": args.blocks, "block_kib": args.block_kib,
                             "per_step": PER_STEP, "load": load_1m(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
