"""A Redis key prefix of a test's own, deleted afterwards (for fixtures of any scope).

``tests/conftest.py``'s ``key_prefix`` fixture is per test; module-scoped fixtures that share
one engine's Redis keys across tests use :func:`scratch_prefix`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from connector.demo.cli import delete_redis_prefix
from offload_tiers.redis.presence_feed import is_announce_stream


def block_names(client: Any, prefix: str) -> list[bytes]:
    """The key names of stored blocks under ``prefix`` (the presence feed's announcement
    stream left out), sorted."""
    start = len(prefix) + 1
    return sorted(n for n in client.scan_iter(match=f"{prefix}:*", count=1000)
                  if not is_announce_stream(n[start:]))


def delete_prefix(url: str, prefix: str) -> int:
    """Delete every key under ``prefix`` (kvtier's ``{prefix}:...`` keys); returns how many."""
    return delete_redis_prefix(url, prefix)


@contextmanager
def scratch_prefix(url: str) -> Iterator[str]:
    """A fresh ``kvtier-test-<hex>`` prefix; its keys are deleted on exit."""
    prefix = f"kvtier-test-{uuid.uuid4().hex[:12]}"
    try:
        yield prefix
    finally:
        delete_prefix(url, prefix)


def wait_for_keys(url: str, prefix: str, at_least: int, deadline_s: float = 300.0) -> int:
    """Wait until Redis holds ``at_least`` keys under ``prefix`` (an engine's background
    writes landed); the count. The deadline only ends a hang: it then fails."""
    import redis

    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + deadline_s
    while True:
        found = len(block_names(client, prefix))
        if found >= at_least:
            return found
        assert time.monotonic() < deadline, f"only {found} of {at_least} keys under {prefix}"
        time.sleep(0.05)  # polling interval
