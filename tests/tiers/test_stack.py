"""TierStack with a real Redis: write-through, write-back, promotion, lookup_prefix, threads."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from offload_tiers.cpu_tier import CpuTier
from offload_tiers.keys import BlockKind
from offload_tiers.redis.tier import RedisTier
from offload_tiers.stack import TierAvailability, TierStack, chain_availability
from tests.tiers.helpers import NS_B, key, payload, run_threads

SLOT = 1024


@pytest.fixture
def redis_tier(redis_url: str, key_prefix: str) -> Iterator[RedisTier]:
    t = RedisTier.from_url(redis_url, prefix=key_prefix, strict=True)
    yield t
    t.close()


def make(redis_tier: RedisTier | None, mode: str = "through", slots: int = 4) -> TierStack:
    return TierStack(CpuTier(slots * SLOT, SLOT), redis_tier, mode)


def test_chain_availability_rules() -> None:
    full = [key(i) for i in range(4)]
    part3 = key(3, partial=True)
    assert chain_availability(full, [True] * 4) == TierAvailability(64, 4, False)
    assert chain_availability(full, [True, True, False, True]) == TierAvailability(32, 2, False)
    assert chain_availability(full[:3] + [part3], [True] * 4) == TierAvailability(56, 3, True)
    assert chain_availability([key(0, partial=True), full[1]], [True, True]) == \
        TierAvailability(8, 0, True)  # nothing extends past a partial
    assert chain_availability([], []) == TierAvailability()
    assert chain_availability([full[2], full[1]], [True, True]) == TierAvailability(48, 1, False)
    assert TierAvailability(56, 3, True).num_blocks == 4


def test_write_through_then_promotion_from_redis(redis_tier: RedisTier) -> None:
    s = make(redis_tier, "through", slots=2)
    keys = [key(i) for i in range(5)]
    arrays = [np.frombuffer(payload(k, SLOT), dtype=np.uint8).copy() for k in keys]
    for k, a in zip(keys, arrays, strict=True):
        assert s.put(k, a)
    assert s.flush(10)
    assert len(s.cpu) == 2 and all(redis_tier.exists_many(keys))
    assert bytes(s.get(keys[0])) == payload(keys[0], SLOT)  # from Redis, promoted
    assert s.cpu.contains(keys[0])
    st = s.stats()
    assert st["redis_hits"] == 1 and st["promotions"] == 1 and st["write_through"] == 5
    assert st["cpu"]["pinned"] == 0  # write-through pins (if any) released


def test_write_back_demotes_on_eviction_only(redis_tier: RedisTier) -> None:
    s = make(redis_tier, "back", slots=2)
    keys = [key(i) for i in range(4)]
    s.put(keys[0], payload(keys[0], SLOT))
    s.put(keys[1], payload(keys[1], SLOT))
    s.flush(5)
    assert redis_tier.exists_many(keys[:2]) == [False, False]  # nothing written yet
    s.put(keys[2], payload(keys[2], SLOT))  # evicts keys[0] -> demoted
    s.flush(5)
    assert redis_tier.exists_many(keys[:3]) == [True, False, False]
    assert bytes(s.get(keys[0])) == payload(keys[0], SLOT)  # promoted back (clean now)
    s.flush(5)
    demotions = s.stats()["demotions"]
    s.put(keys[3], payload(keys[3], SLOT))  # evicts keys[1] (dirty) -> demoted
    s.put(key(9), payload(key(9), SLOT))  # evicts keys[2] (dirty)
    s.put(key(10), payload(key(10), SLOT))  # evicts keys[0] (clean): no demotion
    s.flush(5)
    assert s.stats()["demotions"] == demotions + 2


def test_lookup_prefix_per_tier(redis_tier: RedisTier) -> None:
    s = make(redis_tier, "through", slots=8)
    chain = [key(i) for i in range(5)]
    partial4 = key(4, partial=True)
    for k in chain[:3]:
        s.put(k, payload(k, 64))
    s.flush(5)
    s.cpu.remove(chain[0])
    redis_tier.put_many([(chain[3], payload(chain[3], 64)), (partial4, b"p")])
    r = s.lookup_prefix(chain[:4] + [partial4])
    assert r.cpu == TierAvailability(0, 0, False)  # block 0 is not in CPU
    assert r.redis == TierAvailability(72, 4, True)
    assert r.any == TierAvailability(72, 4, True)
    r = s.lookup_prefix(chain)
    assert r.any == TierAvailability(64, 4, False)  # block 4 (full) is nowhere
    # a partial entry never stands in for the full block with the same position
    full4_same_hash = dataclasses.replace(partial4, num_tokens=80, kind=BlockKind.FULL)
    assert s.lookup_prefix(chain[:4] + [full4_same_hash]).any.num_tokens == 64


def test_lookup_prefix_cpu_only_and_namespaces() -> None:
    s = make(None)
    a = [key(i) for i in range(3)]
    b = [key(i, ns=NS_B) for i in range(3)]
    for k in a:
        s.put(k, b"x")
    assert s.lookup_prefix(a).cpu == TierAvailability(48, 3, False)
    assert s.lookup_prefix(b).any == TierAvailability()
    assert s.get(b[0]) is None


def test_promote_partial_to_full_everywhere(redis_tier: RedisTier) -> None:
    s = make(redis_tier, "through", slots=4)
    partial = key(2, partial=True)
    full = key(2)
    s.put(partial, b"partial")
    s.flush(5)
    assert s.lookup_prefix([key(0), key(1), partial]).cpu.ends_partial is False  # 0,1 absent
    assert s.promote(partial, full, b"full")
    s.flush(5)
    assert not s.cpu.contains(partial) and redis_tier.exists_many([partial]) == [False]
    assert bytes(s.get(full)) == b"full" and s.get(partial) is None


def test_redis_down_stack_serves_cpu_and_misses(redis_server, key_prefix: str) -> None:  # noqa: ANN001
    t = RedisTier.from_url(redis_server.url, prefix=key_prefix, socket_timeout_s=0.5)
    s = TierStack(CpuTier(2 * SLOT, SLOT), t, "back")
    try:
        redis_server.kill()
        for i in range(6):
            s.put(key(i), payload(key(i), SLOT))  # evictions demote into a dead Redis
        assert bytes(s.get(key(5))) == payload(key(5), SLOT)
        assert s.get(key(0)) is None
        r = s.lookup_prefix([key(4), key(5)])
        assert r.cpu.full_blocks == 2 and r.redis == TierAvailability()
        st = s.stats()
        assert st["demotion_drops"] + st["demotions"] == 4
    finally:
        s.close(timeout=1)


def test_concurrent_readers_and_writers_no_torn_values(redis_tier: RedisTier) -> None:
    s = make(redis_tier, "back", slots=6)
    keys = [key(i) for i in range(24)]
    wrong: list[str] = []
    hits = [0, 0]
    stop = threading.Event()

    def writer(seed: int) -> None:
        for n in range(300):
            k = keys[(n * 5 + seed) % len(keys)]
            s.put(k, np.frombuffer(payload(k, SLOT), dtype=np.uint8))

    def reader(me: int) -> None:
        while not stop.is_set():
            for k, v in zip(keys, s.get_many(keys), strict=True):
                if v is not None:
                    hits[me] += 1
                    if bytes(v) != payload(k, SLOT):
                        wrong.append(k.name)
            s.lookup_prefix(keys[:4])

    run_threads([lambda i=i: writer(i) for i in range(3)],
                [lambda i=i: reader(i) for i in range(2)], stop=stop)
    assert wrong == []
    assert hits[0] > 0 and hits[1] > 0
    st = s.stats()
    assert st["demotions"] > 0 and st["redis_hits"] > 0 and st["cpu"]["pinned"] == 0


def test_bad_write_mode() -> None:
    with pytest.raises(ValueError, match="write_mode"):
        TierStack(CpuTier(SLOT, SLOT), None, "sideways")  # type: ignore[arg-type]


def test_write_through_pins_are_bounded_so_puts_never_starve(redis_tier: RedisTier) -> None:
    s = make(redis_tier, "through", slots=8)
    keys = [key(i) for i in range(64)]
    assert all(s.put(k, np.frombuffer(payload(k, SLOT), dtype=np.uint8)) for k in keys)
    assert s.cpu.stats()["pinned"] <= 2
    assert s.flush(10) and s.cpu.stats()["pinned"] == 0
    got = redis_tier.get_many(keys)
    assert all(bytes(g) == payload(k, SLOT) for g, k in zip(got, keys, strict=True))
