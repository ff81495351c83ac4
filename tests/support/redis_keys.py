"""A Redis key prefix of a test's own, deleted afterwards (for fixtures of any scope).

``tests/conftest.py``'s ``key_prefix`` fixture is per test; module-scoped fixtures that share
one engine's Redis keys across tests use :func:`scratch_prefix`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import redis


def delete_prefix(url: str, prefix: str) -> int:
    """Delete every key under ``prefix``; returns how many."""
    client = redis.Redis.from_url(url, socket_timeout=5.0)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i:i + 500])
        return len(keys)
    finally:
        client.close()


@contextmanager
def scratch_prefix(url: str) -> Iterator[str]:
    """A fresh ``kvtier-test-<hex>`` prefix; its keys are deleted on exit."""
    prefix = f"kvtier-test-{uuid.uuid4().hex[:12]}"
    try:
        yield prefix
    finally:
        delete_prefix(url, prefix)
