"""Bounded soak: the tier stack under concurrent readers and writers for a fixed number of
operations, with a Redis tier; no torn values, no leak of slots, flat RSS (figures printed)."""

from __future__ import annotations

import resource
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from offload_tiers.cpu_tier import CpuTier
from offload_tiers.redis.tier import RedisTier
from offload_tiers.stack import TierStack
from tests.tiers.helpers import key, payload, run_threads

pytestmark = pytest.mark.slow
SLOT = 64 * 1024


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / (1 << 20)


@pytest.fixture
def redis_tier(redis_url: str, key_prefix: str) -> Iterator[RedisTier]:
    t = RedisTier.from_url(redis_url, prefix=key_prefix, strict=True, ttl_s=600)
    yield t
    t.close()


@pytest.mark.parametrize("mode", ["through", "back"])
def test_soak_concurrent_stack(redis_tier: RedisTier, mode: str) -> None:
    stack = TierStack(CpuTier(16 * SLOT, SLOT), redis_tier, mode)  # type: ignore[arg-type]
    keys = [key(i) for i in range(96)]
    data = {k: payload(k, SLOT) for k in keys}
    wrong: list[str] = []
    counts = {"puts": 0, "gets": 0, "hits": 0}
    lock = threading.Lock()

    def writer(seed: int, rounds: int) -> None:
        for n in range(rounds):
            k = keys[(n * 7 + seed * 13) % len(keys)]
            stack.put(k, np.frombuffer(data[k], dtype=np.uint8))
            with lock:
                counts["puts"] += 1

    def reader(seed: int, rounds: int) -> None:
        for n in range(rounds):
            batch = [keys[(n * 5 + seed + j) % len(keys)] for j in range(4)]
            got = stack.get_many(batch)
            stack.lookup_prefix(batch)
            with lock:
                counts["gets"] += len(batch)
                counts["hits"] += sum(g is not None for g in got)
            for k, g in zip(batch, got, strict=True):
                if g is not None and bytes(g) != data[k]:
                    wrong.append(k.name)

    def run(rounds: int) -> None:  # a thread's exception fails the test (run_threads)
        run_threads([lambda i=i: writer(i, rounds) for i in range(2)]
                    + [lambda i=i: reader(i, rounds) for i in range(2)])

    run(200)  # warm-up: pools, buffers, allocator arenas
    stack.flush(30)
    rss0 = _rss_mib()
    for _ in range(5):
        run(300)
    assert stack.flush(30)
    rss1 = _rss_mib()
    st = stack.stats()
    print(f"\nFIGURES soak-{mode}: puts={counts['puts']} gets={counts['gets']} "
          f"hits={counts['hits']} wrong={len(wrong)} exceptions=0 "
          f"redis_hits={st['redis_hits']} demotions={st['demotions']} "
          f"rss_growth_mib={rss1 - rss0:.1f}")
    assert wrong == []
    assert counts["puts"] == 2 * (200 + 5 * 300) and counts["hits"] > 0
    assert st["redis_hits"] > 0 and (mode == "through" or st["demotions"] > 0)
    assert st["cpu"]["pinned"] == 0 and st["cpu"]["reserved"] == 0
    assert st["redis"]["corrupt"] == 0
    assert rss1 - rss0 < 64  # flat: bounded queues, no per-op leak
