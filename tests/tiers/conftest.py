"""Fixtures of the tier tests: a RedisTier on the test Redis, and a raw redis-py client."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from offload_tiers.redis.tier import RedisTier


@pytest.fixture
def tier(redis_url: str, key_prefix: str) -> Iterator[RedisTier]:
    t = RedisTier.from_url(redis_url, prefix=key_prefix, strict=True)
    yield t
    t.close()


@pytest.fixture
def raw(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)
