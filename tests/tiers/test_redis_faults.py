"""Real faults: a redis-server killed, paused and restarted mid-traffic; a proxy that adds
latency, resets connections and black-holes. The tier never raises, never serves a wrong
value, degrades to misses and recovers."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from offload_tiers.redis.tier import RedisTier
from rigs.redis_server import RedisServer
from rigs.tcp_proxy import TcpProxy
from tests.tiers.faults import Traffic, wait_until
from tests.tiers.helpers import key, payload

FAST = dict(redis_timeout_s=0.5, backoff_initial_s=0.05, backoff_max_s=0.5)


@pytest.fixture
def tier(redis_server: RedisServer, key_prefix: str) -> Iterator[RedisTier]:
    t = RedisTier.from_url(redis_server.url, prefix=key_prefix, **FAST)
    yield t
    t.close(timeout=1)


def _assert_clean(traffic: Traffic) -> None:
    """No exception, no wrong value, and drops counted, none silent: the outage failed some
    writes and every write is in the tier's counters exactly once."""
    assert traffic.exceptions == []
    assert traffic.wrong == []
    assert traffic.hits > 0
    traffic.assert_writes_accounted()
    assert traffic.failed_writes >= 1


def _figures(name: str, traffic: Traffic, tier: RedisTier, **extra: float) -> None:
    """Printed for RELIABILITY.md (run with -s)."""
    s = tier.stats()
    fields = dict(ops=traffic.ops, hits=traffic.hits, wrong=len(traffic.wrong),
                  exceptions=len(traffic.exceptions), errors=s["errors"],
                  put_failures=s["put_failures"], dropped=s["dropped"] + s["dropped_unavailable"],
                  failed_writes=traffic.failed_writes, corrupt=s["corrupt"],
                  **{k: round(v, 3) for k, v in extra.items()})
    print(f"\nFIGURES {name}: " + " ".join(f"{k}={v}" for k, v in fields.items()))


def test_sigkill_and_restart_mid_traffic(redis_server: RedisServer, tier: RedisTier) -> None:
    traffic = Traffic(tier).start()
    assert wait_until(lambda: traffic.hits > 20)
    redis_server.kill()
    assert wait_until(lambda: not tier.available)
    ops_down = traffic.ops
    assert wait_until(lambda: traffic.ops > ops_down + 10)  # callers keep going while it is down
    assert tier.get(key(1)) is None
    hits_down = traffic.hits
    ops_during_outage = traffic.ops - ops_down
    redis_server.start()  # same port, empty (no persistence)
    t0 = time.monotonic()
    assert wait_until(lambda: tier.available)
    recovery = time.monotonic() - t0
    assert wait_until(lambda: traffic.hits > hits_down + 20)
    traffic.stop()
    _assert_clean(traffic)
    _figures("sigkill+restart", traffic, tier, ops_during_outage=ops_during_outage,
             recovery_s=recovery)
    s = tier.stats()
    assert s["unavailable_events"] >= 1 and s["recoveries"] >= 1 and s["errors"] >= 1


def test_sigstop_longer_than_timeout(redis_server: RedisServer, tier: RedisTier) -> None:
    tier.put_many([(key(1000), payload(key(1000)))])
    traffic = Traffic(tier).start()
    assert wait_until(lambda: traffic.hits > 10)
    redis_server.pause()
    try:
        assert wait_until(lambda: not tier.available)
        ops_down = traffic.ops
        assert wait_until(lambda: traffic.ops > ops_down + 10)
        assert tier.get(key(1000)) is None  # a miss, not a hang or an exception
        assert "Timeout" in tier.last_error
        ops_during_outage = traffic.ops - ops_down
    finally:
        redis_server.resume()
    t0 = time.monotonic()
    assert wait_until(lambda: tier.available)
    recovery = time.monotonic() - t0
    assert wait_until(lambda: tier.get(key(1000)) is not None)
    assert bytes(tier.get(key(1000))) == payload(key(1000))
    traffic.stop()
    _assert_clean(traffic)
    _figures("sigstop", traffic, tier, ops_during_outage=ops_during_outage, recovery_s=recovery)


def test_write_behind_drops_instead_of_blocking(redis_server: RedisServer,
                                                key_prefix: str) -> None:
    t = RedisTier.from_url(redis_server.url, prefix=key_prefix, write_queue_max=4, **FAST)
    try:
        redis_server.pause()
        results = [t.submit_put(key(i), payload(key(i), 4096)) for i in range(200)]
        assert results.count(False) >= 190
        s = t.stats()
        assert s["dropped"] + s["dropped_unavailable"] == results.count(False)
    finally:
        redis_server.resume()
        t.close(timeout=2)


def test_proxy_latency_resets_and_blackhole(redis_server: RedisServer, key_prefix: str) -> None:
    proxy = TcpProxy("127.0.0.1", redis_server.port).start()
    t = RedisTier.from_url(proxy.url, prefix=key_prefix, **FAST)
    try:
        proxy.latency_s = 0.02
        traffic = Traffic(t).start()
        assert wait_until(lambda: traffic.hits > 10)
        for _ in range(5):  # connections reset mid-traffic
            hits = traffic.hits
            proxy.reset_all()
            assert wait_until(lambda h=hits: traffic.hits > h + 5)
        assert t.stats()["errors"] >= 1
        proxy.mode = "blackhole"
        proxy.reset_all()
        assert wait_until(lambda: not t.available)
        proxy.mode = "refuse"
        assert wait_until(lambda: proxy.connections > 3)
        proxy.mode = "forward"
        t0 = time.monotonic()
        assert wait_until(lambda: t.available)
        recovery = time.monotonic() - t0
        hits = traffic.hits
        assert wait_until(lambda: traffic.hits > hits + 10)
        traffic.stop()
        _assert_clean(traffic)
        _figures("proxy latency+5 resets+blackhole+refuse", traffic, t, recovery_s=recovery,
                 connections=proxy.connections)
    finally:
        t.close(timeout=1)
        proxy.stop()


def test_server_absent_at_start_then_appears(tmp_path, key_prefix: str) -> None:  # noqa: ANN001
    server = RedisServer(tmp_path / "late")
    t = RedisTier.from_url(server.url, prefix=key_prefix, **FAST)
    try:
        assert not t.available and "Connection" in t.last_error
        assert t.put_many([(key(0), b"x")]) == 0 and t.get(key(0)) is None
        assert not t.submit_put(key(0), b"x")
        server.start()
        assert wait_until(lambda: t.available)
        assert t.put_many([(key(0), b"x")]) == 1 and bytes(t.get(key(0))) == b"x"
    finally:
        t.close(timeout=1)
        server.stop()
