"""A Redis key prefix of a test's own, deleted afterwards (for fixtures of any scope).

``tests/conftest.py``'s ``key_prefix`` fixture is per test; module-scoped fixtures that share
one engine's Redis keys across tests use :func:`scratch_prefix`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from connector.demo.cli import delete_redis_prefix


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
