"""RedisTier.get_many_into against real Redis: each GET reply lands in its destination
(a CPU-tier slot row), validated there; every bad value, wrong length or fault is a miss."""

from __future__ import annotations

import dataclasses
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import redis

from offload_tiers import codec
from offload_tiers.cpu_tier import CpuTier
from offload_tiers.keys import BlockKind
from offload_tiers.redis import tier as tier_module
from offload_tiers.redis.tier import RedisTier
from rigs.redis_server import RedisServer
from tests.tiers.faults import wait_until
from tests.tiers.helpers import NS_A_TENANT2, NS_B, key, payload

FAST = dict(redis_timeout_s=0.5, backoff_initial_s=0.05, backoff_max_s=0.5)


def _rows(n: int, size: int, fill: int = 0xEE) -> np.ndarray:
    return np.full((n, size), fill, dtype=np.uint8)


def test_hits_land_in_cpu_tier_slots_and_misses_are_false(tier: RedisTier) -> None:
    size = 40_000
    keys = [key(i) for i in range(12)]
    assert tier.put_many([(k, payload(k, size)) for k in keys[:10]]) == 10
    cpu = CpuTier(12 * size, size)
    slots = [cpu.reserve(k) for k in keys]
    assert None not in slots
    got = tier.get_many_into(keys, [cpu.slab[s] for s in slots])
    assert got == [True] * 10 + [False, False]
    for k, s, ok in zip(keys, slots, got, strict=True):
        if ok:
            cpu.commit(k)
            assert bytes(cpu.view(s)) == payload(k, size)
        else:
            cpu.abort(k)
    assert len(cpu) == 10
    s = tier.stats()
    assert s["gets"] == 12 and s["hits"] == 10 and s["misses"] == 2 and s["corrupt"] == 0


def test_sizes_around_the_reader_buffers_and_an_empty_payload(tier: RedisTier) -> None:
    sizes = [0, 1, 63, 64, 4000, 4096, 4097, 16 * 1024, 65_536, 65_537, 300_000, 2 << 20]
    keys = [key(i) for i in range(len(sizes))]
    assert tier.put_many([(k, payload(k, n)) for k, n in zip(keys, sizes, strict=True)]) == 12
    dests = [np.zeros(n, dtype=np.uint8) for n in sizes]
    assert tier.get_many_into(keys, dests) == [True] * 12
    assert [d.tobytes() for d in dests] == [payload(k, n)
                                            for k, n in zip(keys, sizes, strict=True)]


def test_more_keys_than_the_window_and_memoryview_dests(redis_url: str, key_prefix: str) -> None:
    with RedisTier.from_url(redis_url, prefix=key_prefix, max_inflight=3,
                            max_inflight_bytes=100_000, strict=True) as t:
        keys = [key(i) for i in range(50)]
        assert t.put_many([(k, payload(k, 30_000)) for k in keys[::2]]) == 25
        buf = bytearray(50 * 30_000)
        dests = [memoryview(buf)[i * 30_000:(i + 1) * 30_000] for i in range(50)]
        assert t.get_many_into(keys, dests) == [i % 2 == 0 for i in range(50)]
        assert all(bytes(dests[i]) == payload(keys[i], 30_000) for i in range(0, 50, 2))


def _good(k, size: int = 4096) -> bytes:  # noqa: ANN001
    return codec.encode_bytes(k, payload(k, size))


def _with(value: bytes, off: int, fmt: str, val: object) -> bytes:
    v = bytearray(value)
    struct.pack_into("<" + fmt, v, off, val)
    return bytes(v)


def _flipped(value: bytes, at: int) -> bytes:
    v = bytearray(value)
    v[at] ^= 0x10
    return bytes(v)


BAD_VALUES: dict[str, Callable[[object], bytes]] = {
    "flipped payload byte": lambda k: _flipped(_good(k), codec.HEADER_SIZE + 1234),
    "flipped last byte": lambda k: _flipped(_good(k), codec.HEADER_SIZE + 4095),
    "truncated payload": lambda k: _good(k)[:-100],
    "padded payload": lambda k: _good(k) + b"\0",
    "header only": lambda k: _good(k)[:codec.HEADER_SIZE],
    "truncated header": lambda k: _good(k)[:30],
    "empty value": lambda k: b"",
    "bad magic": lambda k: b"XXXX" + _good(k)[4:],
    "version 1 header": lambda k: _with(_good(k), 4, "H", 1),
    "unknown version": lambda k: _with(_good(k), 4, "H", 99),
    "absurd length": lambda k: _with(_good(k), 44, "Q", (1 << 63) + 5),
    "foreign namespace": lambda k: _good(dataclasses.replace(k, fingerprint=NS_B.fingerprint)),
    "foreign tenant": lambda k: _good(dataclasses.replace(k,
                                                          fingerprint=NS_A_TENANT2.fingerprint)),
    "other block": lambda k: _good(dataclasses.replace(k, block_hash=b"another-block")),
    "other group": lambda k: _good(dataclasses.replace(k, group=3)),
    "other num_tokens": lambda k: _good(dataclasses.replace(k, num_tokens=k.num_tokens + 16)),
    "partial for full": lambda k: _good(dataclasses.replace(k, num_tokens=k.num_tokens - 8,
                                                            kind=BlockKind.PARTIAL)),
    "junk": lambda k: b"hello world" * 100,
}


#: Refused for this key, yet valid for another key of the same Redis name: never deleted.
SERVABLE_BY_ANOTHER_READER = {"other num_tokens", "partial for full"}


@pytest.mark.parametrize("reason", list(BAD_VALUES))
def test_bad_value_is_a_counted_miss_and_the_batch_stays_in_step(
        reason: str, tier: RedisTier, raw: redis.Redis, key_prefix: str) -> None:
    keys = [key(i) for i in range(5)]
    assert tier.put_many([(k, payload(k, 4096)) for k in keys]) == 5
    victim = keys[2]
    name = f"{key_prefix}:{victim.name}"
    raw.set(name, BAD_VALUES[reason](victim))
    dests = _rows(5, 4096)
    assert tier.get_many_into(keys, list(dests)) == [True, True, False, True, True], reason
    for i in (0, 1, 3, 4):  # the replies after the bad one were read in step
        assert dests[i].tobytes() == payload(keys[i], 4096)
    s = tier.stats()
    assert s["corrupt"] == 1 and s["hits"] == 4 and s["misses"] == 1 and s["available"]
    # proven corrupt (short and empty values too): deleted, the good ones kept; a value of
    # another kind / num_tokens under the same name may be another reader's: kept
    kept = reason in SERVABLE_BY_ANOTHER_READER
    assert raw.exists(name) == kept and s["corrupt_deleted"] == (not kept), reason
    assert s["stale_saves"] == 0
    assert raw.exists(*(f"{key_prefix}:{k.name}" for k in keys)) == 4 + kept


def test_wrong_destination_length_is_a_counted_miss(tier: RedisTier) -> None:
    keys = [key(i) for i in range(4)]
    assert tier.put_many([(k, payload(k, 5000)) for k in keys]) == 4
    dests = [np.zeros(5000, np.uint8), np.zeros(4999, np.uint8), np.zeros(5001, np.uint8),
             np.zeros(5000, np.uint8)]
    assert tier.get_many_into(keys, dests) == [True, False, False, True]
    assert not dests[1].any() and not dests[2].any()  # never written: refused on the header
    assert dests[3].tobytes() == payload(keys[3], 5000)
    s = tier.stats()
    assert s["corrupt"] == 2 and s["corrupt_deleted"] == 0  # valid values: never deleted
    assert tier.exists_many(keys) == [True] * 4


def test_a_key_of_another_type_is_a_miss(tier: RedisTier, raw: redis.Redis,
                                         key_prefix: str) -> None:
    keys = [key(0), key(1)]
    tier.put_many([(keys[1], payload(keys[1], 100))])
    raw.rpush(f"{key_prefix}:{keys[0].name}", b"a list")  # GET answers WRONGTYPE
    dests = _rows(2, 100)
    assert tier.get_many_into(keys, list(dests)) == [False, True]
    assert dests[1].tobytes() == payload(keys[1], 100)
    assert tier.stats()["corrupt"] == 1 and tier.available
    assert raw.type(f"{key_prefix}:{keys[0].name}") == b"list"  # an error reply deletes nothing
    assert tier.stats()["corrupt_deleted"] == 0


def test_caller_errors_raise_before_anything_is_sent(tier: RedisTier) -> None:
    with pytest.raises(ValueError, match="destinations"):
        tier.get_many_into([key(0), key(1)], [np.zeros(4, np.uint8)])
    with pytest.raises(ValueError, match="read-only"):
        tier.get_many_into([key(0)], [memoryview(b"1234")])
    with pytest.raises(ValueError, match="contiguous"):
        tier.get_many_into([key(0)], [np.zeros((4, 4), np.uint8)[:, 0]])
    assert tier.get_many_into([], []) == []
    assert tier.stats()["gets"] == 0


def test_server_absent_is_all_misses_without_raising(tmp_path, key_prefix: str) -> None:  # noqa: ANN001
    server = RedisServer(tmp_path / "absent")  # never started
    t = RedisTier.from_url(server.url, prefix=key_prefix, **FAST)
    try:
        assert t.get_many_into([key(0), key(1)], list(_rows(2, 10))) == [False, False]
        assert not t.available
        assert "Timeout" not in t.last_error  # refused at once: no socket timeout waited out
    finally:
        t.close(timeout=1)


class _MidBatch:
    """Runs one get_many_into in a thread and parks its reader once the first replies have
    landed (rows 0..2), so the test acts on the server mid-batch: with a window of 2
    commands in flight, the last key's GET cannot have been sent yet. ``join()`` lets the
    reader go on and returns the result."""

    PARK_AT = 3  # the reply the reader waits before reading

    def __init__(self, tier: RedisTier, keys: list, size: int,
                 monkeypatch: pytest.MonkeyPatch) -> None:
        self.dests = _rows(len(keys), size, fill=0)
        self.result: list[bool] | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.parked = threading.Event()
        self.go = threading.Event()
        read_into = tier_module._read_into

        def parking(reader: Any, key: Any, *rest: Any) -> Any:
            if key is keys[self.PARK_AT] and not self.parked.is_set():
                self.parked.set()
                assert self.go.wait(120), "the test never let the reader go on"
            return read_into(reader, key, *rest)

        monkeypatch.setattr(tier_module, "_read_into", parking)
        self._thread = threading.Thread(target=self._run, args=(tier, keys), daemon=True)

    def _run(self, tier: RedisTier, keys: list) -> None:
        t0 = time.monotonic()
        try:
            self.result = tier.get_many_into(keys, list(self.dests))
        except BaseException as exc:  # re-raised in the test's thread by join()
            self.error = exc
        finally:
            self.parked.set()  # never leave the test waiting on a reader that ended
        self.seconds = time.monotonic() - t0

    def start_and_wait_for_first_replies(self) -> None:
        self._thread.start()
        assert self.parked.wait(120), "the reader never reached the reply it parks at"
        assert self.dests[self.PARK_AT - 1].any(), "the reader ended before parking"

    def join(self) -> list[bool]:
        self.go.set()
        self._thread.join(120)  # a deadline for a hang, not a speed bound
        assert not self._thread.is_alive(), "get_many_into hung"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        print(f"\nget_many_into mid-batch fault: {self.seconds:.2f} s")
        return self.result


def _loaded_tier(server: RedisServer, key_prefix: str, n: int, size: int) -> tuple[RedisTier,
                                                                                    list]:
    t = RedisTier.from_url(server.url, prefix=key_prefix, max_inflight=2, **FAST)
    keys = [key(i) for i in range(n)]
    for i in range(0, n, 16):
        assert t.put_many([(k, payload(k, size)) for k in keys[i:i + 16]]) == len(keys[i:i + 16])
    return t, keys


def test_redis_killed_mid_batch(redis_server: RedisServer, key_prefix: str,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    t, keys = _loaded_tier(redis_server, key_prefix, 400, 256 * 1024)
    try:
        run = _MidBatch(t, keys, 256 * 1024, monkeypatch)
        run.start_and_wait_for_first_replies()
        redis_server.pause()  # freeze it first, so the kill surely lands mid-batch
        assert not run.dests[-1].any()  # the window keeps the last reply unsent
        redis_server.kill()  # SIGKILL a stopped server: its sockets close under the reader
        got = run.join()
        assert not any(got)
        assert not t.available and t.stats()["errors"] >= 1
        assert "Timeout" not in t.last_error  # the closed socket ended it, not a timeout
        assert t.get_many_into(keys[:1], list(_rows(1, 256 * 1024))) == [False]  # fast miss
        redis_server.start()
        assert wait_until(lambda: t.available)
        assert t.put_many([(keys[0], payload(keys[0], 256 * 1024))]) == 1
        dest = _rows(2, 256 * 1024)
        assert t.get_many_into(keys[:2], list(dest)) == [True, False]  # restarted empty
        assert dest[0].tobytes() == payload(keys[0], 256 * 1024)
    finally:
        t.close(timeout=1)


def test_redis_paused_mid_batch_times_out_then_recovers(redis_server: RedisServer,
                                                        key_prefix: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    t, keys = _loaded_tier(redis_server, key_prefix, 400, 256 * 1024)
    try:
        run = _MidBatch(t, keys, 256 * 1024, monkeypatch)
        run.start_and_wait_for_first_replies()
        redis_server.pause()
        try:
            assert not run.dests[-1].any()
            got = run.join()
            assert not any(got)
            assert "Timeout" in t.last_error and not t.available  # ended by redis_timeout_s
        finally:
            redis_server.resume()
        assert wait_until(lambda: t.available)
        dests = _rows(len(keys), 256 * 1024, fill=0)
        assert t.get_many_into(keys, list(dests)) == [True] * len(keys)
        assert all(dests[i].tobytes() == payload(keys[i], 256 * 1024) for i in (0, 199, 399))
        s = t.stats()
        assert s["unavailable_events"] >= 1 and s["recoveries"] >= 1 and s["corrupt"] == 0
    finally:
        t.close(timeout=1)
