"""The Redis client home shared by the tier and the janitor: backoff state and scrubbing."""

from __future__ import annotations

import pytest
from redis.exceptions import AuthenticationError

from offload_tiers.redis.client import ClientFactory, Health
from offload_tiers.redis.tier import RedisTier
from offload_tiers.redis.url import parse_redis_url


def test_health_backs_off_doubling_up_to_its_cap_and_resets_on_recovery() -> None:
    h = Health("main", initial_s=1.0, max_s=5.0)
    assert h.available and not h.due(0.0) and not h.waiting(0.0)
    assert h.failed(100.0)  # an outage starts
    assert 100.5 <= h.next_try <= 101.5 and h.backoff_s == 2.0
    assert h.waiting(100.4) and not h.due(100.4) and h.due(101.5)
    assert not h.failed(102.0)  # still the same outage
    assert 103.0 <= h.next_try <= 105.0 and h.backoff_s == 4.0
    h.failed(110.0)
    assert h.backoff_s == 5.0 and h.failures == 3
    h.failed(120.0)
    assert h.backoff_s == 5.0 and h.next_try <= 127.5
    assert h.recovered() and h.available and h.backoff_s == 1.0
    assert not h.recovered()  # already up


def test_scrub_removes_the_password_as_written_and_decoded() -> None:
    f = ClientFactory(parse_redis_url("redis://kv:p%40ss@127.0.0.1:1/0"), timeout_s=1.0,
                      password="other-secret")
    text = f.scrub("p%40ss p@ss other-secret kv")
    assert text == "*** *** *** kv"
    said = f.describe(AuthenticationError("bad p@ss"))
    assert said == "authentication failed (bad ***)"
    assert f.describe(TimeoutError("late")) == "TimeoutError: late"


def test_client_options_turn_redis_py_retries_off() -> None:
    f = ClientFactory(parse_redis_url("redis://127.0.0.1:1/0"), timeout_s=0.3,
                      ssl_ca_certs="/ca.pem")
    assert f.kwargs["socket_timeout"] == f.kwargs["socket_connect_timeout"] == 0.3
    assert f.kwargs["retry"].get_retries() == 0 and f.kwargs["ssl_ca_certs"] == "/ca.pem"
    assert f.kwargs["health_check_interval"] == 0
    cluster = ClientFactory(parse_redis_url("redis+cluster://127.0.0.1:1"), timeout_s=0.3,
                            connect_timeout_s=0.1)
    assert "health_check_interval" not in cluster.kwargs
    assert cluster.kwargs["socket_connect_timeout"] == 0.1


def test_from_url_still_takes_the_old_timeout_name(redis_url: str, key_prefix: str) -> None:
    with pytest.warns(DeprecationWarning, match="redis_timeout_s"):
        t = RedisTier.from_url(redis_url, prefix=key_prefix, socket_timeout_s=0.7, strict=True)
    try:
        assert t._factory.kwargs["socket_timeout"] == 0.7
    finally:
        t.close()
