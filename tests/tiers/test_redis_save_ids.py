"""RedisTier against real Redis: save ids in stored headers, and the conditional delete of
values a read proved corrupt (a value rewritten meanwhile is kept)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np
import pytest
import redis

from offload_tiers import codec
from offload_tiers.keys import BlockKey, BlockKind
from offload_tiers.redis.tier import RedisTier
from rigs.redis_server import RedisServer
from tests.tiers.helpers import key, payload

SIZE = 2048


def _name(prefix: str, k: BlockKey) -> str:
    return f"{prefix}:{k.name}"


def _flipped(value: bytes, at: int = codec.HEADER_SIZE + 100) -> bytes:
    v = bytearray(value)
    v[at] ^= 0x01
    return bytes(v)


def _rows(n: int) -> list[np.ndarray]:
    return list(np.zeros((n, SIZE), np.uint8))


def test_put_many_and_submit_put_store_the_save_id(tier: RedisTier, raw: redis.Redis,
                                                   key_prefix: str) -> None:
    keys = [key(i) for i in range(5)]
    assert tier.put_many([(k, payload(k, SIZE)) for k in keys[:3]],
                         save_ids=[11, 12, (1 << 32) - 1]) == 3
    assert tier.submit_put(keys[3], payload(keys[3], SIZE), save_id=14)
    assert tier.flush(10)
    assert tier.put_many([(keys[4], payload(keys[4], SIZE))]) == 1  # no save id: 0
    header = raw.getrange(_name(key_prefix, keys[0]), 0, codec.HEADER_SIZE - 1)
    assert codec.parse_header(header).save_id == 11
    absent = key(99)
    assert tier.save_ids_many(keys + [absent]) == [11, 12, (1 << 32) - 1, 14, 0, None]
    assert tier.exists_many(keys + [absent]) == [True] * 5 + [False]
    assert tier.save_ids_many([]) == []
    s = tier.stats()
    assert s["corrupt"] == 0 and s["exists_checks"] == 12


def test_get_many_into_serves_only_the_save_asked_for(tier: RedisTier, raw: redis.Redis,
                                                      key_prefix: str) -> None:
    keys = [key(i) for i in range(4)]
    assert tier.put_many([(k, payload(k, SIZE)) for k in keys], save_ids=[7, 7, 7, 7]) == 4
    dests = _rows(4)
    got = tier.get_many_into(keys, dests, save_ids=[7, 8, None, 0])
    assert got == [True, False, True, False]  # match, other save, any save, other save
    assert dests[0].tobytes() == payload(keys[0], SIZE)
    assert dests[2].tobytes() == payload(keys[2], SIZE)
    s = tier.stats()
    assert s["stale_saves"] == 2 and s["corrupt"] == 0 and s["misses"] == 2 and s["hits"] == 2
    assert s["corrupt_deleted"] == 0
    assert raw.exists(*(_name(key_prefix, k) for k in keys)) == 4  # another save's: kept
    assert tier.get_many_into(keys, _rows(4)) == [True] * 4  # no save ids: any save


def test_a_corrupt_value_of_another_save_is_corrupt_not_stale(tier: RedisTier, raw: redis.Redis,
                                                              key_prefix: str) -> None:
    k = key(1)
    raw.set(_name(key_prefix, k), _flipped(codec.encode_bytes(k, payload(k, SIZE), save_id=3)))
    assert tier.get_many_into([k], _rows(1), save_ids=[4]) == [False]
    s = tier.stats()
    assert s["corrupt"] == 1 and s["stale_saves"] == 0 and s["corrupt_deleted"] == 1
    assert not raw.exists(_name(key_prefix, k))


def test_save_ids_many_absent_valid_and_corrupt(tier: RedisTier, raw: redis.Redis,
                                                key_prefix: str) -> None:
    absent, valid, bad, twin = key(0), key(1), key(2), key(3)
    tier.put_many([(valid, payload(valid, SIZE))], save_ids=[0xABCDEF])
    raw.set(_name(key_prefix, bad), b"XXXX" + codec.encode_bytes(bad, b"p" * 10)[4:])
    partial = dataclasses.replace(twin, num_tokens=twin.num_tokens - 3, kind=BlockKind.PARTIAL)
    tier.put_many([(partial, b"a partial block")], save_ids=[5])  # same name as `twin`
    assert tier.save_ids_many([absent, valid, bad, twin]) == [None, 0xABCDEF, None, None]
    assert not raw.exists(_name(key_prefix, bad))  # a bad header: deleted
    assert tier.save_ids_many([partial]) == [5]  # refused for FULL, another reader's: kept
    s = tier.stats()
    assert s["corrupt"] == 2 and s["corrupt_deleted"] == 1


def test_corrupt_values_found_by_reads_are_deleted(tier: RedisTier, raw: redis.Redis,
                                                   key_prefix: str) -> None:
    keys = [key(i) for i in range(4)]
    assert tier.put_many([(k, payload(k, SIZE)) for k in keys]) == 4
    for k in keys[1:3]:
        raw.set(_name(key_prefix, k), _flipped(raw.get(_name(key_prefix, k))))
    assert tier.get_many_into(keys[:2], _rows(2)) == [True, False]  # flipped payload byte
    assert tier.get_many(keys[2:]) == [None, tier.get(keys[3])]
    assert raw.exists(*(_name(key_prefix, k) for k in keys)) == 2
    assert tier.get_many(keys[:1])[0] is not None and tier.exists_many(keys[3:]) == [True]
    s = tier.stats()
    assert s["corrupt"] == 2 and s["corrupt_deleted"] == 2 and s["corrupt_changed"] == 0


def _judged(raw: redis.Redis, name: str) -> tuple[bytes, bytes, int]:
    value = raw.get(name)
    return name.encode(), value[:codec.HEADER_SIZE], len(value)


def test_a_value_rewritten_after_the_verdict_is_kept(tier: RedisTier, raw: redis.Redis,
                                                     key_prefix: str) -> None:
    """The compare-and-delete itself: it removes exactly the bytes that were judged."""
    k = key(5)
    name = _name(key_prefix, k)
    good = codec.encode_bytes(k, payload(k, SIZE), save_id=1)
    cases: dict[str, tuple[bytes, bytes]] = {  # judged value -> value found at delete time
        "another save rewrote it": (_flipped(good), codec.encode_bytes(k, payload(k, SIZE),
                                                                       save_id=2)),
        "same header, other length": (good[:-10], good),  # a truncated copy, then the whole
        "short, then valid": (good[:20], good),
        "empty, then valid": (b"", good),
    }
    for case, (judged, rewritten) in cases.items():
        raw.set(name, judged)
        verdict = _judged(raw, name)
        raw.set(name, rewritten)
        tier._delete_corrupt([verdict])
        assert raw.get(name) == rewritten, case
    raw.delete(name)
    tier._delete_corrupt([(name.encode(), b"", 0)])  # gone meanwhile: nothing to do
    raw.set(name, _flipped(good))
    tier._delete_corrupt([_judged(raw, name)])  # unchanged: deleted
    assert not raw.exists(name)
    s = tier.stats()
    assert s["corrupt_changed"] == len(cases) + 1 and s["corrupt_deleted"] == 1
    assert s["corrupt_delete_failures"] == 0


@pytest.mark.parametrize("read", ["get_many_into", "get_many", "save_ids_many"])
def test_a_rewrite_between_read_and_delete_survives(read: str, tier: RedisTier,
                                                    raw: redis.Redis, key_prefix: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer replaces the corrupt value right after the read judged it (a hook runs just
    before the delete): the new value stays and is served."""
    k = key(6)
    name = _name(key_prefix, k)
    good = codec.encode_bytes(k, payload(k, SIZE), save_id=9)
    raw.set(name, _flipped(good) if read != "save_ids_many" else good[:-1])
    delete = tier._delete_corrupt

    def rewrite_first(doomed: list) -> None:
        assert [d[0] for d in doomed] == [name.encode()]
        tier.put_many([(k, payload(k, SIZE))], save_ids=[10])
        delete(doomed)

    monkeypatch.setattr(tier, "_delete_corrupt", rewrite_first)
    reads: dict[str, Callable[[], object]] = {
        "get_many_into": lambda: tier.get_many_into([k], _rows(1)),
        "get_many": lambda: tier.get_many([k]),
        "save_ids_many": lambda: tier.save_ids_many([k]),
    }
    assert reads[read]() in ([False], [None])
    monkeypatch.undo()
    assert tier.save_ids_many([k]) == [10] and bytes(tier.get(k)) == payload(k, SIZE)
    s = tier.stats()
    assert s["corrupt_deleted"] == 0 and s["corrupt_changed"] == 1


def test_delete_corrupt_false_keeps_corrupt_values(redis_url: str, key_prefix: str,
                                                   raw: redis.Redis) -> None:
    k, h = key(1), key(2)
    bad_payload = _flipped(codec.encode_bytes(k, payload(k, SIZE)))
    bad_header = b"XXXX" + codec.encode_bytes(h, payload(h, SIZE))[4:]
    raw.set(_name(key_prefix, k), bad_payload)
    raw.set(_name(key_prefix, h), bad_header)
    with RedisTier.from_url(redis_url, prefix=key_prefix, delete_corrupt=False,
                            strict=True) as t:
        assert t.get_many_into([k, h], _rows(2)) == [False, False]
        assert t.get_many([k, h]) == [None, None]
        assert t.save_ids_many([k, h]) == [0, None]  # the probe reads no payload
        s = t.stats()
        assert s["corrupt"] == 5 and s["corrupt_deleted"] == 0 and s["corrupt_changed"] == 0
    assert raw.get(_name(key_prefix, k)) == bad_payload
    assert raw.get(_name(key_prefix, h)) == bad_header


def test_script_not_cached_is_sent_whole(redis_server: RedisServer, key_prefix: str) -> None:
    """EVALSHA first; a server that never saw the script (or flushed it) gets EVAL."""
    raw = redis_server.client()
    k = key(1)
    with RedisTier.from_url(redis_server.url, prefix=key_prefix, strict=True) as t:
        for flush in (False, True, False):
            if flush:
                raw.script_flush()
            assert t.put_many([(k, payload(k, SIZE))]) == 1
            raw.set(_name(key_prefix, k), _flipped(raw.get(_name(key_prefix, k))))
            assert t.get_many_into([k], _rows(1)) == [False]
            assert not raw.exists(_name(key_prefix, k))
        stats = raw.info("commandstats")
        assert t.stats()["corrupt_deleted"] == 3
    assert stats["cmdstat_eval"]["calls"] == 2  # the first call, and the one after the flush
    assert stats["cmdstat_evalsha"]["calls"] == 3


def test_scripts_refused_leave_the_value_and_warn_once(redis_server: RedisServer,
                                                       key_prefix: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    raw = redis_server.client()
    raw.execute_command("ACL", "SETUSER", "noscripts", "on", ">pw", "~*", "+@all",
                        "-@scripting")
    url = f"redis://noscripts:pw@127.0.0.1:{redis_server.port}/0"
    k = key(1)
    bad = _flipped(codec.encode_bytes(k, payload(k, SIZE)))
    raw.set(_name(key_prefix, k), bad)
    with caplog.at_level(logging.WARNING, logger="offload_tiers.redis.tier"):
        with RedisTier.from_url(url, prefix=key_prefix, strict=True) as t:
            for _ in range(3):
                assert t.get_many_into([k], _rows(1)) == [False]  # never raises
            s = t.stats()
            assert t.available and s["corrupt"] == 3 and s["corrupt_delete_failures"] == 1
    assert raw.get(_name(key_prefix, k)) == bad
    assert sum("refuses scripts" in r.getMessage() for r in caplog.records) == 1


def test_caller_errors_raise_before_anything_is_sent(tier: RedisTier) -> None:
    items = [(key(0), b"a"), (key(1), b"b")]
    with pytest.raises(ValueError, match="save ids"):
        tier.put_many(items, save_ids=[1])
    for bad in (-1, 1 << 32):
        with pytest.raises(ValueError, match="save_id"):
            tier.put_many(items, save_ids=[1, bad])
        with pytest.raises(ValueError, match="save_id"):
            tier.submit_put(key(0), b"a", save_id=bad)
    with pytest.raises(ValueError, match="save ids"):
        tier.get_many_into([key(0)], _rows(1), save_ids=[1, 2])
    assert tier.stats()["puts"] == 0 and tier.save_ids_many([key(0), key(1)]) == [None, None]


def test_redis_absent_is_all_none_without_raising(tmp_path, key_prefix: str) -> None:  # noqa: ANN001
    server = RedisServer(tmp_path / "absent")  # never started
    t = RedisTier.from_url(server.url, prefix=key_prefix, redis_timeout_s=0.5,
                           backoff_initial_s=0.05, backoff_max_s=0.5)
    try:
        assert t.save_ids_many([key(0), key(1)]) == [None, None]
        assert t.get_many_into([key(0)], _rows(1), save_ids=[1]) == [False]
        assert t.stats()["corrupt_deleted"] == 0 and not t.available
    finally:
        t.close(timeout=1)


def test_submit_puts_queues_a_batch_with_save_ids_and_reports_each(tier: RedisTier) -> None:
    keys = [key(i) for i in range(4)]
    done: dict[int, list[bool]] = {i: [] for i in range(4)}
    accepted = tier.submit_puts([(k, memoryview(payload(k, SIZE)), done[i].append, 20 + i)
                                 for i, k in enumerate(keys)])
    assert accepted == [True] * 4
    assert tier.flush(10)
    assert done == {i: [True] for i in range(4)}  # each reported exactly once
    assert tier.save_ids_many(keys) == [20, 21, 22, 23]
    assert [bytes(v) for v in tier.get_many(keys)] == [payload(k, SIZE) for k in keys]
    queued = tier.stats()["queued"]
    bad = dataclasses.replace(key(9), group=1 << 40)  # refused before anything is queued
    with pytest.raises(ValueError, match="group"):
        tier.submit_puts([(key(8), payload(key(8), SIZE), None, 1), (bad, b"x", None, 2)])
    assert tier.stats()["queued"] == queued and tier.save_ids_many([key(8)]) == [None]
