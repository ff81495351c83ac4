"""Model-based test: the tier stack against a reference dict, with real Redis behind a proxy
that the state machine breaks and repairs at random.

Invariant: a get returns exactly the bytes last put under that key, or a miss; never other
bytes, never a partial for a full. Keys are content-addressed (as in kvtier), so "the bytes
last put" under a key is ``payload(key)``; a PARTIAL key that shares its hash with a FULL key
(same Redis key name) checks that the header's kind/num_tokens keep them apart.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator

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

from offload_tiers.cpu_tier import CpuTier
from offload_tiers.keys import BlockKind
from offload_tiers.redis.tier import RedisTier
from offload_tiers.stack import TierStack, chain_availability
from tests.support.tcp_proxy import TcpProxy
from tests.tiers.helpers import key, payload

SLOT = 512
FULL = [key(i) for i in range(6)]
PARTIAL = [key(i, partial=True) for i in range(6)]
COLLIDERS = [dataclasses.replace(k, num_tokens=k.num_tokens - 5, kind=BlockKind.PARTIAL)
             for k in FULL[:3]]  # same hash, same Redis key name as FULL[:3]
KEYS = FULL + PARTIAL + COLLIDERS


def data_for(k) -> bytes:  # noqa: ANN001
    return payload(k, SLOT - (k.num_tokens % 7))  # lengths vary a little


@pytest.fixture(scope="module")
def proxy(redis_url: str) -> Iterator[TcpProxy]:
    url = redis.connection.parse_url(redis_url)
    p = TcpProxy(url.get("host", "127.0.0.1"), int(url.get("port", 6379))).start()
    yield p
    p.stop()


class StackMachine(RuleBasedStateMachine):
    proxy: TcpProxy
    redis_url: str

    def __init__(self) -> None:
        super().__init__()
        self.prefix = f"kvtier-test-sm-{uuid.uuid4().hex[:10]}"
        self.proxy.mode = "forward"
        self.redis = RedisTier.from_url(self.proxy.url, prefix=self.prefix, socket_timeout_s=0.5,
                                        backoff_initial_s=0.01, backoff_max_s=0.1)
        self.mode = "through"
        self.stack: TierStack | None = None
        self.put_ever: set = set()

    @rule(mode=st.sampled_from(["through", "back"]), slots=st.integers(1, 5))
    @precondition(lambda self: self.stack is None)
    def build(self, mode: str, slots: int) -> None:
        self.mode = mode
        self.stack = TierStack(CpuTier(slots * SLOT, SLOT), self.redis, mode)

    @rule(k=st.sampled_from(KEYS), as_array=st.booleans())
    @precondition(lambda self: self.stack is not None)
    def put(self, k, as_array: bool) -> None:  # noqa: ANN001
        data = data_for(k)
        src = np.frombuffer(data, dtype=np.uint8) if as_array else data
        stored = self.stack.put(k, src)
        self.put_ever.add(k)
        if stored:
            got = self.stack.get(k)
            assert got is not None and bytes(got) == data  # just put: must hit

    @rule(k=st.sampled_from(KEYS))
    @precondition(lambda self: self.stack is not None)
    def get(self, k) -> None:  # noqa: ANN001
        got = self.stack.get(k)
        if got is not None:
            assert k in self.put_ever, "a value nobody stored"
            assert bytes(got) == data_for(k), "wrong bytes"

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=6))
    @precondition(lambda self: self.stack is not None)
    def get_many_and_lookup(self, keys) -> None:  # noqa: ANN001
        for k, got in zip(keys, self.stack.get_many(keys), strict=True):
            assert got is None or bytes(got) == data_for(k)
        r = self.stack.lookup_prefix(keys)
        assert r.any.num_tokens >= max(r.cpu.num_tokens, r.redis.num_tokens)
        assert r.any.num_blocks >= max(r.cpu.num_blocks, r.redis.num_blocks)
        chain = keys[: r.any.num_blocks]
        assert all(k.kind is BlockKind.FULL for k in chain[: r.any.full_blocks])
        if r.any.ends_partial:
            assert chain[-1].kind is BlockKind.PARTIAL
        assert chain_availability(keys, [True] * len(keys)).num_blocks >= r.any.num_blocks

    @rule(k=st.sampled_from(KEYS))
    @precondition(lambda self: self.stack is not None)
    def evict_from_cpu(self, k) -> None:  # noqa: ANN001
        self.stack.remove(k)
        assert not self.stack.cpu.contains(k)

    @rule(i=st.integers(0, 5))
    @precondition(lambda self: self.stack is not None)
    def promote(self, i: int) -> None:
        self.stack.promote(PARTIAL[i], FULL[i], data_for(FULL[i]))
        self.put_ever.add(FULL[i])
        assert not self.stack.cpu.contains(PARTIAL[i])

    @rule(k=st.sampled_from(FULL))
    @precondition(lambda self: self.stack is not None and self.proxy.mode == "forward")
    def survives_cpu_loss_via_redis(self, k) -> None:  # noqa: ANN001
        errors = self.redis.stats()["errors"]
        if not self.redis.available:
            return
        self.stack.put(k, data_for(k))
        self.put_ever.add(k)
        if self.mode == "back":
            for filler in KEYS:  # push k out of the CPU tier: it is demoted
                if filler is not k and self.stack.cpu.contains(k):
                    self.stack.put(filler, data_for(filler))
                    self.put_ever.add(filler)
        assert self.stack.flush(10)
        self.stack.remove(k)
        got = self.stack.get(k)
        if self.redis.stats()["errors"] == errors and self.redis.stats()["dropped"] == 0:
            assert got is not None and bytes(got) == data_for(k)

    @rule()
    def break_redis(self) -> None:
        self.proxy.mode = "refuse"
        self.proxy.reset_all()

    @rule()
    def repair_redis(self) -> None:
        self.proxy.mode = "forward"

    @invariant()
    def never_raises_stats(self) -> None:
        if self.stack is not None:
            s = self.stack.stats()
            assert s["cpu"]["entries"] <= s["cpu"]["num_slots"]

    def teardown(self) -> None:
        self.proxy.mode = "forward"
        if self.stack is not None:
            self.stack.flush(5)
            assert self.stack.stats()["cpu"]["pinned"] == 0
        self.redis.close(timeout=2)
        client = redis.Redis.from_url(self.redis_url)
        keys = list(client.scan_iter(match=f"{self.prefix}*", count=1000))
        if keys:
            client.delete(*keys)


def test_stack_matches_reference_under_failures(proxy: TcpProxy, redis_url: str) -> None:
    StackMachine.proxy = proxy
    StackMachine.redis_url = redis_url
    run_state_machine_as_test(
        StackMachine,
        settings=settings(max_examples=40, stateful_step_count=40, deadline=None,
                          suppress_health_check=list(HealthCheck)),
    )
