"""Model-based test: the Redis tier driven the way the connector drives it, against a
reference, with real Redis behind a proxy that the state machine breaks and repairs at random.

Stores go through the write-behind queue (``submit_put`` with ``on_done``, the payload a
buffer left untouched until ``on_done`` runs) or synchronously (``put_many``); restores are
``get_many_into`` into slab rows; ``exists_many`` and ``delete_many`` run in between.

Invariant: a restore fills its row with exactly the bytes stored under that key, or reports
a miss; never other bytes, never a partial for a full. Keys are content-addressed (as in
kvtier), so "the bytes stored" under a key are ``data_for(key)``. A PARTIAL key that shares
its hash with a FULL key (same Redis key name, same payload length) checks that the header's
kind/num_tokens keep them apart. Every ``on_done`` runs exactly once.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from offload_tiers.keys import BlockKey, BlockKind
from offload_tiers.redis.tier import RedisTier
from tests.support.tcp_proxy import TcpProxy
from tests.tiers.helpers import key, payload

SLOT = 512
FULL = [key(i) for i in range(6)]
PARTIAL = [key(i, partial=True) for i in range(6)]
COLLIDERS = [dataclasses.replace(k, num_tokens=k.num_tokens - 5, kind=BlockKind.PARTIAL)
             for k in FULL[:3]]  # same hash, same Redis key name as FULL[:3]
KEYS = FULL + PARTIAL + COLLIDERS
BATCH = st.lists(st.sampled_from(KEYS), max_size=6)


def _wait(ok: Callable[[], bool], timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def size_of(k: BlockKey) -> int:
    """Payload length: varies a little, and is the same for keys sharing a Redis key name."""
    return SLOT - k.block_hash[0] % 7


def data_for(k: BlockKey) -> bytes:
    return payload(k, size_of(k))


@pytest.fixture(scope="module")
def proxy(redis_url: str) -> Iterator[TcpProxy]:
    url = redis.connection.parse_url(redis_url)
    p = TcpProxy(url.get("host", "127.0.0.1"), int(url.get("port", 6379))).start()
    yield p
    p.stop()


class RedisTierMachine(RuleBasedStateMachine):
    proxy: TcpProxy
    redis_url: str

    def __init__(self) -> None:
        super().__init__()
        self.prefix = f"kvtier-test-sm-{uuid.uuid4().hex[:10]}"
        self.proxy.mode = "forward"
        self.redis = RedisTier.from_url(self.proxy.url, prefix=self.prefix, redis_timeout_s=0.5,
                                        backoff_initial_s=0.01, backoff_max_s=0.1)
        self.slab = np.zeros((8, SLOT), np.uint8)
        self.sources = {k: np.frombuffer(data_for(k), np.uint8) for k in KEYS}
        self.put_ever: set[BlockKey] = set()
        self.submitted = 0
        self.done = 0
        self._lock = threading.Lock()

    def _on_done(self, _ok: bool) -> None:
        with self._lock:
            self.done += 1

    def _restore(self, keys: list[BlockKey]) -> list[bool]:
        rows = [self.slab[i, :size_of(k)] for i, k in enumerate(keys)]
        got = self.redis.get_many_into(keys, rows)
        for k, row, hit in zip(keys, rows, got, strict=True):
            if hit:
                assert k in self.put_ever, "a value nobody stored"
                assert row.tobytes() == data_for(k), "wrong bytes"
        return got

    @rule(k=st.sampled_from(KEYS))
    def submit_put(self, k: BlockKey) -> None:
        self.put_ever.add(k)
        self.submitted += 1
        self.redis.submit_put(k, memoryview(self.sources[k]), on_done=self._on_done)

    @rule(keys=BATCH)
    def put_many(self, keys: list[BlockKey]) -> None:
        self.put_ever |= set(keys)
        self.redis.put_many([(k, data_for(k)) for k in keys])

    @rule(keys=BATCH)
    def restore(self, keys: list[BlockKey]) -> None:
        self._restore(keys)

    @rule(keys=BATCH)
    def exists(self, keys: list[BlockKey]) -> None:
        for k, here in zip(keys, self.redis.exists_many(keys), strict=True):
            assert not here or k in self.put_ever, "present, but nobody stored it"

    @rule(k=st.sampled_from(KEYS))
    def delete(self, k: BlockKey) -> None:
        self.redis.delete_many([k])

    @rule(k=st.sampled_from(KEYS), queued=st.booleans())
    @precondition(lambda self: self.proxy.mode == "forward")
    def stored_is_restored(self, k: BlockKey, queued: bool) -> None:
        """With Redis healthy, a store that reports success is restored right after."""
        self.redis.flush(10)  # nothing queued may overwrite k in between
        if not self.redis.available:
            return
        errors = self.redis.stats()["errors"]
        self.put_ever.add(k)
        if queued:
            flags: list[bool] = []
            self.submitted += 1
            self.redis.submit_put(k, memoryview(self.sources[k]),
                                  on_done=lambda ok: (flags.append(ok), self._on_done(ok)))
            assert self.redis.flush(10)
            stored = flags == [True]
        else:
            stored = self.redis.put_many([(k, data_for(k))]) == 1
        hit = self._restore([k])[0]
        if stored and self.redis.stats()["errors"] == errors:
            assert hit

    @rule(i=st.integers(0, len(COLLIDERS) - 1), partial_first=st.booleans())
    @precondition(lambda self: self.proxy.mode == "forward")
    def twin_is_never_served(self, i: int, partial_first: bool) -> None:
        """A FULL key and a PARTIAL key share one Redis key name: storing one, then asking
        for the other, is a miss (the header's kind/num_tokens tell them apart)."""
        stored, asked = (COLLIDERS[i], FULL[i]) if partial_first else (FULL[i], COLLIDERS[i])
        self.redis.flush(10)
        if not _wait(lambda: self.redis.available):
            return
        if self.redis.put_many([(stored, data_for(stored))]) != 1:
            return
        self.put_ever.add(stored)
        row = self.slab[0, :size_of(asked)]
        assert self.redis.get_many_into([asked], [row]) == [False], "the twin was served"

    @rule()
    def break_redis(self) -> None:
        self.proxy.mode = "refuse"
        self.proxy.reset_all()

    @rule()
    def repair_redis(self) -> None:
        self.proxy.mode = "forward"

    @invariant()
    def callbacks_never_outnumber_stores(self) -> None:
        with self._lock:
            assert self.done <= self.submitted

    def teardown(self) -> None:
        self.proxy.mode = "forward"
        self.redis.close(timeout=5)
        assert self.done == self.submitted, "an on_done did not run exactly once"
        client = redis.Redis.from_url(self.redis_url)
        keys = list(client.scan_iter(match=f"{self.prefix}*", count=1000))
        if keys:
            client.delete(*keys)


def test_redis_tier_matches_reference_under_failures(proxy: TcpProxy, redis_url: str) -> None:
    RedisTierMachine.proxy = proxy
    RedisTierMachine.redis_url = redis_url
    run_state_machine_as_test(
        RedisTierMachine,
        settings=settings(max_examples=40, stateful_step_count=40, deadline=None,
                          suppress_health_check=list(HealthCheck)),
    )
