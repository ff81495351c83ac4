"""RedisTier against real Redis: round trips, bad values, namespaces, TTL, queue, policies."""

from __future__ import annotations

import dataclasses
import logging
import struct

import numpy as np
import pytest
import redis

from offload_tiers import codec
from offload_tiers.keys import BlockKind
from offload_tiers.redis.tier import EVENT_COUNTS, RedisTier
from rigs.redis_server import RedisServer
from tests.tiers.helpers import NS_A_TENANT2, NS_B, key, payload, run_threads


def test_put_get_exists_delete_round_trip(tier: RedisTier, raw: redis.Redis,
                                          key_prefix: str) -> None:
    keys = [key(i) for i in range(20)]
    sizes = [0, 1, 100, 16 * 1024 - 1, 16 * 1024, 70_000] * 4
    items = [(k, payload(k, n)) for k, n in zip(keys, sizes, strict=False)]
    assert tier.put_many(items) == 20
    got = tier.get_many(keys + [key(99)])
    assert [bytes(g) if g is not None else None for g in got] == [p for _, p in items] + [None]
    assert tier.exists_many([keys[0], keys[5], key(99)]) == [True, True, False]
    name = f"{key_prefix}:{keys[3].fingerprint}:0:{keys[3].block_hash.hex()}"
    assert raw.exists(name) and raw.strlen(name) == codec.HEADER_SIZE + sizes[3]
    assert tier.delete_many(keys[:10] + [key(99)]) == 10
    assert tier.get_many(keys[:2]) == [None, None]
    s = tier.stats()
    assert s["puts"] == 20 and s["hits"] == 20 and s["corrupt"] == 0 and s["available"]


def test_numpy_and_memoryview_payloads(tier: RedisTier) -> None:
    arr = np.arange(4096, dtype=np.float32).reshape(16, 256)
    k = key(1)
    assert tier.put_many([(k, arr), (key(2), memoryview(arr.tobytes()))]) == 2
    assert np.array_equal(np.frombuffer(tier.get(k), dtype=np.float32).reshape(16, 256), arr)


def test_hand_written_bad_values_are_counted_misses(tier: RedisTier, raw: redis.Redis,
                                                   key_prefix: str) -> None:
    k = key(7)
    data = payload(k, 4096)
    good = codec.encode_bytes(k, data)
    name = f"{key_prefix}:{k.name}"

    def header_with(off: int, fmt: str, val: object) -> bytes:
        v = bytearray(good)
        struct.pack_into("<" + fmt, v, off, val)
        return bytes(v)

    flipped = bytearray(good)
    flipped[codec.HEADER_SIZE + 1234] ^= 0x10
    bad = {
        "flipped": bytes(flipped), "truncated": good[:-100], "header only": good[:64],
        "short": good[:5], "empty": b"", "trailing byte": good + b"\0",
        "version 1": header_with(4, "H", 1),
        "absurd length": header_with(44, "Q", (1 << 63) + 5),
        "foreign": codec.encode_bytes(dataclasses.replace(k, fingerprint=NS_B.fingerprint), data),
        "junk": b"hello world",
    }
    for reason, value in bad.items():
        raw.set(name, value)
        assert tier.get(k) is None, reason
        assert not raw.exists(name), reason  # proven corrupt by the read: deleted
        raw.set(name, value)
        header_ok = reason == "flipped"  # the probe reads no payload
        assert tier.exists_many([k]) == [header_ok], reason
        # A bad header is deleted by the probe. An empty string reads as no key at all to
        # GETRANGE + STRLEN: the probe says absent and leaves it (the next read deletes it).
        assert raw.exists(name) == (header_ok or reason == "empty"), reason
    raw.delete(name)
    raw.rpush(name, b"not a string")  # a foreign key of another type under the prefix
    assert tier.get(k) is None and tier.exists_many([k]) == [False]
    assert raw.type(name) == b"list"  # an error reply proves nothing: kept
    s = tier.stats()
    # every read counted, every probe but the flipped (header intact) and the empty value;
    # the list: once by the read, once by the probe
    assert s["corrupt"] == len(bad) + (len(bad) - 2) + 2 and s["hits"] == 0
    assert s["corrupt_deleted"] == 2 * len(bad) - 2  # all but the probes' flipped and empty
    # the serial a per-step reader polls moved with every one of those events
    assert tier.events_serial == sum(s[name] for name in EVENT_COUNTS) > 0
    raw.delete(name)
    serial = tier.events_serial
    assert tier.put_many([(k, data)]) == 1 and bytes(tier.get(k)) == data
    assert tier.exists_many([k, key(8)]) == [True, False] and tier.get(key(8)) is None
    assert tier.events_serial == serial  # hits, misses and writes are no events


def test_partial_value_does_not_answer_full_lookup(tier: RedisTier) -> None:
    full = key(4)
    partial = dataclasses.replace(full, num_tokens=full.num_tokens - 8, kind=BlockKind.PARTIAL)
    assert tier.put_many([(partial, b"partial bytes")]) == 1  # same Redis key name as `full`
    assert tier.get(full) is None and tier.exists_many([full]) == [False]
    assert bytes(tier.get(partial)) == b"partial bytes"
    assert tier.put_many([(full, b"full bytes")]) == 1  # promotion replaces it
    assert tier.get(partial) is None and bytes(tier.get(full)) == b"full bytes"


def test_two_models_and_two_tenants_never_share(tier: RedisTier) -> None:
    a = key(1)
    b = key(1, ns=NS_B)
    t2 = key(1, ns=NS_A_TENANT2)
    assert a.block_hash == b.block_hash == t2.block_hash
    tier.put_many([(a, b"model a"), (b, b"model b")])
    assert [bytes(x) if x else None for x in tier.get_many([a, b, t2])] == [
        b"model a", b"model b", None]
    assert tier.exists_many([t2]) == [False]


def test_ttl_with_jitter(redis_url: str, key_prefix: str, raw: redis.Redis) -> None:
    with RedisTier.from_url(redis_url, prefix=key_prefix, ttl_s=100, ttl_jitter=0.5) as t:
        keys = [key(i) for i in range(30)]
        t.put_many([(k, b"x") for k in keys])
        ttls = [raw.pttl(f"{key_prefix}:{k.name}") for k in keys]
    assert all(99_000 <= v <= 150_000 for v in ttls)
    assert len(set(ttls)) > 1  # jittered, not one expiry for all


def test_submit_put_write_behind_and_flush(tier: RedisTier) -> None:
    keys = [key(i) for i in range(50)]
    done: list[bool] = []
    for k in keys[:25]:
        assert tier.submit_put(k, payload(k, 1000))
    buf = bytearray(payload(keys[25], 1000))
    assert tier.submit_put(keys[25], memoryview(buf))  # copied: caller may reuse buf
    buf[:] = b"\0" * 1000
    assert tier.submit_put(keys[26], payload(keys[26], 1000), on_done=done.append)
    assert tier.flush(10)
    got = tier.get_many(keys[:27])
    assert all(g is not None and bytes(g) == payload(k, 1000)
               for g, k in zip(got, keys[:27], strict=True))
    assert done == [True] and tier.stats()["written"] == 27


def test_invalid_settings_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="scheme"):
        RedisTier.from_url("http://127.0.0.1:6379")
    with pytest.raises(ValueError, match="ttl_s"):
        RedisTier.from_url("redis://127.0.0.1:6379", ttl_s=0)


def test_noeviction_policy_warns_once(redis_server: RedisServer, key_prefix: str,
                                      caplog: pytest.LogCaptureFixture) -> None:
    redis_server.client().config_set("maxmemory-policy", "noeviction")
    with caplog.at_level(logging.WARNING, logger="offload_tiers.redis.channel"):
        with RedisTier.from_url(redis_server.url, prefix=key_prefix) as t:
            t.put_many([(key(0), b"x")])
            assert t.stats()["noeviction"]
    assert sum("noeviction" in r.getMessage() for r in caplog.records) == 1


def test_small_maxmemory_allkeys_lru_serves_exact_or_miss(tmp_path, key_prefix: str) -> None:  # noqa: ANN001
    server = RedisServer(tmp_path / "lru", "--maxmemory", "4mb",
                         "--maxmemory-policy", "allkeys-lru").start()
    try:
        with RedisTier.from_url(server.url, prefix=key_prefix) as t:
            assert not t.stats()["noeviction"]
            keys = [key(i) for i in range(200)]
            stored = 0
            for start in range(0, 200, 20):
                stored += t.put_many([(k, payload(k, 64 * 1024)) for k in keys[start:start + 20]])
            assert stored == 200  # 12.5 MiB into 4 MiB: the server evicts, stores never fail
            got = t.get_many(keys)
            hits = [g for g in got if g is not None]
            assert 0 < len(hits) < 200
            assert all(bytes(g) == payload(k, 64 * 1024)
                       for g, k in zip(got, keys, strict=True) if g is not None)
            assert t.stats()["corrupt"] == 0
    finally:
        server.stop()


def test_noeviction_full_server_fails_stores_without_raising(tmp_path, key_prefix: str) -> None:  # noqa: ANN001
    server = RedisServer(tmp_path / "full", "--maxmemory", "2mb",
                         "--maxmemory-policy", "noeviction").start()
    try:
        with RedisTier.from_url(server.url, prefix=key_prefix) as t:
            stored = t.put_many([(key(i), payload(key(i), 64 * 1024)) for i in range(100)])
            assert 0 < stored < 100
            s = t.stats()
            assert s["put_failures"] == 100 - stored and s["available"]  # OOM is per command
    finally:
        server.stop()


def test_concurrent_threads_share_the_tier_without_torn_values(tier: RedisTier) -> None:
    keys = [key(i) for i in range(40)]
    wrong: list[str] = []
    hits = [0] * 4

    def worker(seed: int) -> None:
        slab = np.zeros((10, 20_000), np.uint8)
        for n in range(30):
            batch = keys[(n + seed) % 30:(n + seed) % 30 + 10]
            assert tier.put_many([(k, payload(k, 20_000)) for k in batch[:5]]) == 5
            tier.submit_put(batch[5], payload(batch[5], 20_000))
            for k, got in zip(batch, tier.get_many(batch), strict=True):
                if got is not None:
                    hits[seed] += 1
                    if bytes(got) != payload(k, 20_000):
                        wrong.append(k.name)
            for k, ok, row in zip(batch, tier.get_many_into(batch, list(slab)), slab,
                                  strict=True):
                if ok:
                    hits[seed] += 1
                    if row.tobytes() != payload(k, 20_000):
                        wrong.append(k.name)

    run_threads([lambda i=i: worker(i) for i in range(4)])
    assert wrong == []
    assert all(h >= 30 * 5 * 2 for h in hits)  # at least each thread's own fresh stores
    assert tier.flush(10) and tier.stats()["corrupt"] == 0


def test_bad_key_is_a_clear_error_before_anything_is_sent(tier: RedisTier) -> None:
    bad = dataclasses.replace(key(0), group=1 << 40)
    with pytest.raises(ValueError, match="group"):
        tier.put_many([(key(1), b"fine"), (bad, b"x")])
    with pytest.raises(ValueError, match="group"):
        tier.submit_put(bad, b"x")
    assert tier.get(key(1)) is None and tier.stats()["puts"] == 0
