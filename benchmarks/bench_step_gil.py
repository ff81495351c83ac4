"""What kvtier's background threads cost a step that runs beside them in the same process.

    python -m benchmarks.bench_step_gil [--json PATH] [--redis-url URL] [--steps 1500]

vLLM's CPU worker runs a step as many small torch calls from its main thread; every call
lets the GIL go and takes it back. kvtier's threads in that process (the saver's gathers,
the Redis writer, the fetch threads) need the GIL for their Python work; CPython hands it
to a waiting thread only when the holder drops it, at the latest after the switch interval
(5 ms by default). So a step that overlaps a burst of background Python can wait for the
GIL, which bench_stall's timed hooks see as a forward's time off the CPU.

Here the main thread runs a stand-in for the tiny Llama's decode step (a loop of small
matmuls and elementwise calls, about as many torch calls as vLLM's step makes) ``--steps``
times, and a background thread, each case in turn, does what kvtier does for one long
prompt every few steps, with the real components against the machine's Redis:

  alone    nothing beside the steps
  gather   the saver: 32 blocks gathered from a KV tensor into CPU-tier slots
  write    the Redis writer: 32 values of 32 KiB stored (``RedisTier.submit_puts``; its
           write-behind thread packs and sends them) as one batch, written at once
  write paced  the same as batches of 8, 3 ms apart (the connector's
           ``redis_write_batch``, ``redis_write_pace_ms``; off by default)
  fetch    a fetch thread: the same 32 values read back into slots (``get_many_into``,
           inside ``short_switch_interval`` as the connector runs it; ``fetch 5 ms``:
           without it)

The cases take turns (:data:`REPEATS` times ``--steps / REPEATS`` steps each), so that the
machine's drift falls on every case alike.
Per case: step wall time p50 / p99 / max (ms) and the p99 over alone's. Each case runs
with the background thread pinned to the other core where there is one (kvtier's
``affinity.py`` does the same), the steps on this core. Table and JSON ``cases``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks.harness import write_result
from connector.vllm_connector.config import load_config
from connector.vllm_connector.gil import short_switch_interval
from offload_tiers.keys import BlockKey, BlockKind
from offload_tiers.redis.tier import RedisTier

BLOCKS = 32  # one 1,024-token prompt of the tiny Llama (block 32)
BLOCK_BYTES = 32 * 1024  # its KV per block: 2 layers x K,V x 32 tokens x 2 heads x 32 x 4 B
EVERY = 8  # steps between two bursts
REPEATS = 10  # turns each case takes


class Step:
    """A stand-in for a decode step of the tiny Llama: ``calls`` small torch calls."""

    def __init__(self, calls: int = 240) -> None:
        torch.manual_seed(0)
        self.x = torch.randn(16, 128)
        self.w = [torch.randn(128, 128) / 12 for _ in range(4)]
        self.rounds = calls // 6

    def __call__(self) -> float:
        t = time.perf_counter()
        x = self.x
        for i in range(self.rounds):
            w = self.w[i % 4]
            y = torch.matmul(x, w)
            y = torch.nn.functional.silu(y)
            y = y * 0.5
            y = y + x
            x = torch.nn.functional.layer_norm(y, (128,))
            x = x.contiguous()
        return time.perf_counter() - t


def _pin_to_other_core() -> None:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) > 1:
        os.sched_setaffinity(0, {cores[-1]})


def run_case(step: Step, steps: int, burst: Callable[[], None] | None) -> list[float]:
    """Step times (s) with ``burst`` run on a background thread every :data:`EVERY` steps."""
    go = threading.Semaphore(0)
    stop = threading.Event()

    def background() -> None:
        _pin_to_other_core()
        while True:
            go.acquire()
            if stop.is_set():
                return
            assert burst is not None
            burst()

    thread = threading.Thread(target=background, daemon=True) if burst else None
    if thread is not None:
        thread.start()
    times = []
    for i in range(steps):
        if thread is not None and i % EVERY == 0:
            go.release()
        times.append(step())
    if thread is not None:
        stop.set()
        go.release()
        thread.join()
    return times


def _stats(times: list[float]) -> dict[str, float]:
    arr = np.array(times) * 1e3
    return {"p50_ms": float(np.percentile(arr, 50)), "p99_ms": float(np.percentile(arr, 99)),
            "max_ms": float(arr.max()), "mean_ms": float(arr.mean())}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("KVTIER_REDIS_URL",
                                                              "redis://127.0.0.1:6379/0"))
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        os.sched_setaffinity(0, {cores[0]})  # the steps' core; threads started later move
    prefix = f"kvtier-stepgil-{uuid.uuid4().hex[:8]}"
    def make_tier(**writer: Any) -> RedisTier:
        made: list[RedisTier] = []

        def make() -> None:  # its writer thread inherits the other core, as in the worker
            _pin_to_other_core()
            made.append(RedisTier.from_url(args.redis_url, prefix=prefix, strict=True,
                                           **writer))
        maker = threading.Thread(target=make)
        maker.start()
        maker.join()
        return made[0]
    settings = load_config({"redis_write_batch": 8, "redis_write_pace_ms": 3})
    paced = {"write_batch_items": settings.redis_write_batch,
             "write_pace_s": settings.redis_write_pace_ms / 1e3}
    tier = make_tier(write_batch_items=BLOCKS)  # one batch, written at once (the default)
    paced_tier = make_tier(**paced)
    kv = torch.randn(4096, BLOCK_BYTES // 4)  # one "layer" holding whole blocks
    slab = np.zeros((BLOCKS, BLOCK_BYTES), dtype=np.uint8)
    keys = [BlockKey("ab" * 16, 0, i.to_bytes(32, "big"), 32 * (i + 1), BlockKind.FULL)
            for i in range(BLOCKS)]
    values = [np.random.default_rng(i).integers(0, 255, BLOCK_BYTES, dtype=np.uint8)
              for i in range(BLOCKS)]
    tier.put_many(list(zip(keys, values, strict=True)))
    ids = torch.randint(0, 4096, (BLOCKS,))
    out = torch.from_numpy(slab).view(torch.float32)

    def gather() -> None:
        torch.index_select(kv, 0, ids, out=out)

    def writer(through: RedisTier) -> Callable[[], None]:
        def write() -> None:
            left = [len(keys)]
            done = threading.Event()

            def one_done(ok: bool) -> None:  # the writer's callback (the connector's appends)
                left[0] -= 1
                if not left[0]:
                    done.set()
            through.submit_puts([(k, v, one_done, 0)
                                 for k, v in zip(keys, values, strict=True)])
            done.wait()
        return write

    def fetch() -> None:
        with short_switch_interval():
            got = tier.get_many_into(keys, list(slab))
        if not all(got):
            raise RuntimeError("a value did not come back")

    def fetch_plain() -> None:
        if not all(tier.get_many_into(keys, list(slab))):
            raise RuntimeError("a value did not come back")

    step = Step()
    for _ in range(200):
        step()  # warm
    bursts = {"alone": None, "gather": gather, "write": writer(tier),
              "write paced": writer(paced_tier), "fetch": fetch, "fetch 5 ms": fetch_plain}
    times: dict[str, list[float]] = {name: [] for name in bursts}
    try:
        # The cases take turns, REPEATS times, so that the machine's drift falls on all
        for _ in range(REPEATS):
            for name, burst in bursts.items():
                times[name] += run_case(step, args.steps // REPEATS, burst)
    finally:
        tier.close()
        paced_tier.close()
        import redis
        client = redis.Redis.from_url(args.redis_url)
        for name in client.scan_iter(match=f"{prefix}:*"):
            client.delete(name)
        client.close()
    cases: dict[str, Any] = {name: _stats(t) for name, t in times.items()}
    alone = cases["alone"]["p99_ms"]
    print(f"\nbench_step_gil — {args.steps} steps of ~240 small torch calls; every {EVERY} "
          f"steps a background burst of {BLOCKS} blocks of {BLOCK_BYTES >> 10} KiB; "
          f"cores {cores}; switch interval {sys.getswitchinterval() * 1e3:g} ms")
    print(f"  {'case':<12} {'mean ms':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
          f"{'p99 x alone':>12} {'ms per burst':>13}")
    for name, c in cases.items():
        c["p99_vs_alone"] = c["p99_ms"] / alone
        # the steps' extra time per burst, against alone's mean step
        c["extra_ms_per_burst"] = ((c["mean_ms"] - cases["alone"]["mean_ms"]) * EVERY)
        print(f"  {name:<12} {c['mean_ms']:>8.2f} {c['p50_ms']:>8.2f} {c['p99_ms']:>8.2f} "
              f"{c['max_ms']:>8.2f} {c['p99_vs_alone']:>12.2f} {c['extra_ms_per_burst']:>13.2f}")
    if args.json_path:
        write_result(args.json_path, {"cases": cases, "steps": args.steps, "every": EVERY,
                                      "blocks": BLOCKS, "block_bytes": BLOCK_BYTES,
                                      "cores": cores})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
