"""Why a Redis restore inside vLLM's worker reads slower than alone: the GIL's switch interval.

    python -m benchmarks.bench_gil [--json PATH] [--redis-url URL] [--values 256]

kvtier's worker reads Redis values on I/O threads (``RedisTier.get_many_into``: each value
received straight into its CPU-tier slot). After every ``recv`` the reading thread needs
the GIL back; CPython hands it over when the holder drops it, at the latest after the
*switch interval* (``sys.getswitchinterval()``, 5 ms by default). vLLM's worker thread holds
the GIL through its Python work between steps (while a request waits for its KV the engine
keeps stepping). This measures the same read of ``--values`` values of 192 KiB (the size
``bench_ttft.py``'s model stores per block) against the machine's Redis:

* alone;
* beside a thread that holds the GIL in a Python loop (vLLM's worst case), at switch
  intervals of 5 ms (CPython's default), 1 ms and 0.2 ms (kvtier's while a fetch is in
  flight: ``connector/vllm_connector/gil.py``);
* beside a thread that loops with ``os.sched_yield()`` (vLLM's shared-memory queue between
  steps: it lets the GIL go every turn).

Best of three reads per case, GB/s. Table, JSON ``cases`` and ``ratios`` (each case over
"alone").
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import redis

from benchmarks.harness import write_result
from connector.vllm_connector.gil import FETCH_SWITCH_INTERVAL_S
from offload_tiers.keys import BlockKey, BlockKind
from offload_tiers.redis.tier import RedisTier

VALUE_BYTES = 192 * 1024


def _spinner(stop: threading.Event, yielding: bool) -> None:
    x = 0
    while not stop.is_set():
        if yielding:
            os.sched_yield()
        x += 1


def _read_gbps(tier: RedisTier, keys: list[BlockKey], dests: list[np.ndarray]) -> float:
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        ok = tier.get_many_into(keys, dests)
        elapsed = time.perf_counter() - t
        if not all(ok):
            raise RuntimeError("a value did not come back")
        best = max(best, len(keys) * VALUE_BYTES / elapsed / 1e9)
    return best


def measure(url: str, values: int) -> dict[str, Any]:
    prefix = f"kvtier-bench-gil-{uuid.uuid4().hex[:8]}"
    tier = RedisTier.from_url(url, prefix=prefix, strict=True, redis_timeout_s=30)
    keys = [BlockKey("f" * 32, 0, i.to_bytes(32, "big"), 32, BlockKind.FULL)
            for i in range(values)]
    rng = np.random.default_rng(0)
    if tier.put_many([(k, rng.integers(0, 256, VALUE_BYTES, dtype=np.uint8).tobytes())
                      for k in keys]) != values:
        raise RuntimeError("could not store the values")
    dests = [np.empty(VALUE_BYTES, dtype=np.uint8) for _ in keys]
    default = sys.getswitchinterval()
    cases: dict[str, float] = {}
    try:
        cases["alone"] = _read_gbps(tier, keys, dests)
        for label, interval, yielding in (
                ("python loop, 5 ms", 0.005, False), ("python loop, 1 ms", 0.001, False),
                (f"python loop, {FETCH_SWITCH_INTERVAL_S * 1e3:g} ms",
                 FETCH_SWITCH_INTERVAL_S, False),
                ("sched_yield loop, 5 ms", 0.005, True)):
            sys.setswitchinterval(interval)
            stop = threading.Event()
            other = threading.Thread(target=_spinner, args=(stop, yielding), daemon=True)
            other.start()
            try:
                cases[label] = _read_gbps(tier, keys, dests)
            finally:
                stop.set()
                other.join()
                sys.setswitchinterval(default)
    finally:
        client = redis.Redis.from_url(url)
        doomed = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if doomed:
            client.delete(*doomed)
        tier.close()
    return {"values": values, "value_bytes": VALUE_BYTES, "gbps": cases,
            "ratios": {k: v / cases["alone"] for k, v in cases.items() if k != "alone"}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--values", type=int, default=256)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    result = measure(args.redis_url, args.values)
    print(f"{args.values} Redis values of {VALUE_BYTES // 1024} KiB read by one thread "
          "(RedisTier.get_many_into), best of 3:")
    print(f"{'beside':<28}{'GB/s':>8}{'vs alone':>10}")
    for label, gbps in result["gbps"].items():
        ratio = result["ratios"].get(label, 1.0)
        print(f"{label:<28}{gbps:>8.2f}{ratio:>9.2f}×")
    write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
