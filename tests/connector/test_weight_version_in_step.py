"""The weight version is followed before a step's first look-up (issue 43.3 (a)).

vLLM's ``schedule()`` asks the connector about waiting requests
(``get_num_new_matched_tokens``) before it builds the step's metadata
(``build_connector_meta``). A version named between two steps must move the namespace before
that first look-up: else the first step after the change looks up under the old generation
and restores KV of the old weights.

The connector's scheduler side (the adapter's own ``get_num_new_matched_tokens``,
``build_connector_meta``, ``_fingerprint``) runs here over a real scheduler half and a worker
with CPU tensors (``rigs/halves.py``); vLLM's weight version is a stand-in read as
the adapter reads it. No engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from connector.identity.generation import Generation
from connector.vllm_connector.bounded_cache import BoundedCache
from connector.vllm_connector.config import TieredConfig
from connector.vllm_connector.connector import (
    TENANT_CACHE_MAX,
    TieredConnectorMetadata,
    TieredOffloadingConnector,
)
from rigs.halves import BS, Halves
from rigs.sched_doubles import Blk, Req


class WeightVersion:
    """vLLM's weight version as the adapter reads it (``WeightVersionSource.read``)."""

    def __init__(self) -> None:
        self.value = "default"  # EngineCore._weight_version at start

    def read(self) -> str:
        return self.value


@pytest.fixture
def engine() -> Iterator[tuple[TieredOffloadingConnector, Halves, WeightVersion]]:
    """The adapter's scheduler side over one engine's halves (CPU tier only), keyed by the
    adapter's namespace, as ``TieredOffloadingConnector.__init__`` wires it."""
    halves = Halves(TieredConfig(cpu_bytes=1 << 20))
    version = WeightVersion()
    conn = TieredOffloadingConnector.__new__(TieredOffloadingConnector)
    conn.scheduler = halves.sched
    conn.identity = halves.identity
    conn._weights = version  # type: ignore[assignment]
    conn._generation = Generation(version.read())
    conn._namespaces = BoundedCache(TENANT_CACHE_MAX)
    halves.sched._fingerprint = conn._fingerprint  # look-ups and saves: the adapter's keys
    yield conn, halves, version
    halves.close()


def _idle_step() -> SimpleNamespace:
    """A SchedulerOutput with nothing scheduled (the fields build_connector_meta reads)."""
    return SimpleNamespace(
        num_scheduled_tokens={}, scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        preempted_req_ids=set(), finished_req_ids=set(), kv_connector_block_state=None,
        total_num_scheduled_tokens=0)


def test_the_first_lookup_after_a_version_change_uses_the_new_generation(
        engine: tuple[TieredOffloadingConnector, Halves, WeightVersion]) -> None:
    conn, halves, version = engine
    stored = Req("p", 100)  # 3 full blocks of prompt P, computed and saved under "0"
    halves.fill([1, 2, 3])
    halves.admit(stored, [[Blk(i, i * BS) for i in (1, 2, 3)]], 0)
    assert len(halves.step({"p": 3 * BS}).plan.saves) == 3
    halves.sched.finished("p")
    again = Req("before", 100)
    assert conn.get_num_new_matched_tokens(again, 0) == (3 * BS, False)  # P is there
    conn.request_finished(again, [])

    version.value = "rl-v2"  # weights updated in place and named, between two steps
    # the next schedule(): the look-up comes before build_connector_meta
    assert conn.get_num_new_matched_tokens(Req("after", 100), 0) == (0, False)
    assert conn._generation.name == "named:rl-v2"
    meta = conn.build_connector_meta(_idle_step())  # type: ignore[arg-type]
    assert isinstance(meta, TieredConnectorMetadata) and not meta.plan.loads
    assert conn._generation.name == "named:rl-v2"  # followed once, not moved again
