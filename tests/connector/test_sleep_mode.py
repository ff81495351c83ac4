"""Sleep mode (vLLM >= 0.33: ``unregister_kv_caches`` before a sleep, ``restore_kv_caches``
after wake-up) through kvtier's real worker half: CPU KV tensors, the saver thread, the I/O
threads and a real Redis at 127.0.0.1:6379.

A sleep is played the way vLLM's allocators may do it, at its hardest: after
``unregister_kv_caches`` the memory behind vLLM's KV tensors is given up (the old memory is
scribbled over, as a reuse would) and the same tensor objects are re-pointed at other memory
(``Tensor.set_``), whose contents are forgotten. A view kept across the sleep would read or
write the old memory; the tests assert nothing does, that saves and loads in flight at the
sleep lose nothing, and that what is served after wake-up is what was stored.

These run on every vLLM: on 0.32 the hooks are kvtier's own methods, which no vLLM 0.32 calls.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from connector.vllm_connector.config import TieredConfig
from connector.vllm_connector.connector import TieredOffloadingConnector
from connector.vllm_connector.layout import LayoutError
from connector.vllm_connector.worker import TieredWorker
from rigs.halves import BS, Halves, as_bytes
from rigs.sched_doubles import Blk, Req

SENTINEL = 7.0  # what the old memory holds once the sleep gave it to someone else


def _req(name: str, tokens: int = 100) -> Req:
    req = Req(name, tokens)
    req.block_hashes = [f"{name}{i}".encode() for i in range(tokens // BS)]
    return req


def _blocks(block_ids: list[int]) -> list[list[Blk]]:
    """Full blocks holding a request's first tokens (``block_hash_num_tokens`` set)."""
    return [[Blk(b, (i + 1) * BS) for i, b in enumerate(block_ids)]]


@pytest.fixture
def engines(redis_url: str, key_prefix: str) -> Iterator[Any]:
    made: list[Halves] = []

    def make() -> Halves:
        config = TieredConfig(cpu_bytes=1 << 20, redis_url=redis_url, redis_prefix=key_prefix,
                              presence=False, redis_write_linger_ms=0)
        made.append(Halves(config))
        return made[-1]

    yield make
    for e in made:
        e.close()


def _store(e: Halves, req: Req, block_ids: list[int], seed: int) -> None:
    """``req``'s blocks computed in ``block_ids`` and saved (CPU tier and Redis)."""
    e.fill(block_ids, seed=seed)
    e.admit(req, _blocks(block_ids), 0)
    e.step({req.request_id: len(block_ids) * BS})
    assert e.ranks[0].worker.flush_redis(30.0)
    e.step()  # the writes' reports reach the scheduler


def _remap(kv: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The sleep: each of vLLM's tensors now lives in other memory (contents forgotten: NaN);
    the old memory, returned as views, is scribbled over."""
    old = {}
    for name, tensor in kv.items():
        old[name] = tensor[:]  # a view of the old memory, kept only by the test
        tensor.set_(torch.full_like(tensor, float("nan")))
        old[name].fill_(SENTINEL)
    return old


class _Says(logging.Handler):
    """Runs ``then`` when a record containing ``text`` is logged (in the logging thread)."""

    def __init__(self, text: str, then: threading.Event) -> None:
        super().__init__(logging.INFO)
        self.text, self.then, self.seen = text, then, False

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.seen = True
            self.then.set()


def test_saves_and_loads_in_flight_cross_a_sleep_without_a_stale_view(engines: Any) -> None:
    first, sleeper = engines(), engines()
    a = _req("a")
    _store(first, a, [1, 2, 3], seed=11)  # what the sleeper will load from Redis
    stored_a = [as_bytes(first.ranks[0].kv["attn0"][b]) for b in (1, 2, 3)]

    rank = sleeper.ranks[0]
    worker = rank.worker
    assert worker._saver is not None  # CPU tensors: saves copy on the saver thread
    # A request whose blocks are computed in this step: its saves are copied off the step.
    s = _req("s")
    sleeper.fill([1, 2, 3], seed=5)
    before = [as_bytes(rank.kv["attn0"][b]) for b in (1, 2, 3)]
    sleeper.admit(s, _blocks([1, 2, 3]), 0)
    # A Redis hit for "a": its fetch is held on the I/O thread across the sleep.
    assert sleeper.lookup(a) == (96, True)
    sleeper.admit(a, [[Blk(7), Blk(8), Blk(9), Blk(10)]], 96)
    fetch_go, fetching = threading.Event(), threading.Event()
    real_get = worker.redis.get_many_into

    def held_get(*args: Any, **kwargs: Any) -> list[bool]:
        fetching.set()
        fetch_go.wait()
        return real_get(*args, **kwargs)

    worker.redis.get_many_into = held_get  # type: ignore[method-assign]
    saver_go = threading.Event()
    worker._saver.submit(saver_go.wait)  # the saver is busy: this step's saves wait for it
    plan = sleeper.plan({"s": 96})
    assert plan.saves and plan.fetches
    sleeper.run(plan)
    assert fetching.wait(30)
    assert worker.slot_keys[plan.saves[0].slot] is None  # the saves have not read their blocks

    says = _Says("waiting for the saves in flight", saver_go)
    log = logging.getLogger("connector.vllm_connector.worker")
    log.addHandler(says)
    log.setLevel(logging.INFO)
    try:
        worker.unregister()  # releases the saver once it says it waits for it
    finally:
        log.removeHandler(says)
    assert says.seen
    assert not worker.kv_registered
    assert all(worker.slot_keys[op.slot] == op.key for op in plan.saves)  # read before it returned
    worker.unregister()  # idempotent

    old = _remap(rank.kv)
    fetch_go.set()
    result = sleeper.deliver(plan)  # the fetch is back and reported; its blocks wait
    assert result.finished == set() and result.failed == set()
    for tensor in old.values():
        assert bool((tensor == SENTINEL).all())  # nothing written into the given-up memory
    assert torch.isnan(rank.kv["attn0"][7:11]).all()  # nor yet into the new memory

    worker.restore(rank.kv)  # fresh views of the tensors as they are now
    assert worker.kv_registered
    worker.restore(rank.kv)  # idempotent
    done, failed, _ = worker.take_transfer_results()
    assert done == {"a"} and failed == set()
    assert [as_bytes(rank.kv["attn0"][b]) for b in (7, 8, 9)] == stored_a
    for tensor in old.values():
        assert bool((tensor == SENTINEL).all())

    # The saves in flight at the sleep reached Redis with the bytes from before it.
    assert worker.flush_redis(30.0)
    sleeper.step()
    assert [rank.stored(sleeper.key(s, 0, n)) for n in (32, 64, 96)] == before
    # After wake-up a CPU-tier hit is served into the new memory, from what was stored.
    again = _req("s")
    again.request_id = "s2"
    assert sleeper.lookup(again) == (96, False)
    sleeper.admit(again, [[Blk(11), Blk(12), Blk(13), Blk(14)]], 96)
    result = sleeper.step({"s2": 100})
    assert result.load_errors == set()
    assert [as_bytes(rank.kv["attn0"][b]) for b in (11, 12, 13)] == before
    # ... and a save reads the new memory.
    fresh = _req("f")
    sleeper.fill([4], seed=99)
    sleeper.admit(fresh, _blocks([4]), 0)
    sleeper.step({"f": BS})
    assert worker.flush_redis(30.0)
    sleeper.step()
    assert rank.stored(sleeper.key(fresh, 0, BS)) == as_bytes(rank.kv["attn0"][4])
    assert bool((old["attn0"] == SENTINEL).all())


def test_a_step_while_unregistered_copies_nothing_and_fails_its_loads(engines: Any) -> None:
    """vLLM does not step while asleep; were it to, kvtier writes and reads no KV block:
    its CPU loads fail (vLLM recomputes), its saves are dropped (counted)."""
    e = engines()
    rank = e.ranks[0]
    s = _req("s")
    _store(e, s, [1, 2, 3], seed=3)
    rank.worker.unregister()
    old = _remap(rank.kv)
    again = _req("s")
    again.request_id = "s2"
    assert e.lookup(again) == (96, False)
    e.admit(again, [[Blk(5), Blk(6), Blk(7), Blk(8)]], 96)
    other = _req("o")
    e.admit(other, _blocks([9]), 0)
    drops = e.counter("store_drops")[0]
    result = e.step({"s2": 100, "o": BS})
    assert result.load_errors == {5, 6, 7}
    assert e.counter("store_drops")[0] == drops + 1  # "o"'s block: not read, not saved
    assert bool((old["attn0"] == SENTINEL).all())
    assert torch.isnan(rank.kv["attn0"]).all()


def test_restore_refuses_tensors_of_another_layout(engines: Any) -> None:
    e = engines()
    worker: TieredWorker = e.ranks[0].worker
    worker.unregister()
    smaller = {"attn0": torch.zeros(e.num_blocks, 2, BS, 4)}
    with pytest.raises(LayoutError, match="restart the engine"):
        worker.restore(smaller)
    assert not worker.kv_registered
    worker.restore(e.ranks[0].kv)
    assert worker.kv_registered


def test_the_connector_declares_sleep_mode_and_overrides_the_hooks() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from connector.vllm_connector import vllm_api

    assert TieredOffloadingConnector.supports_sleep_mode(None) is True
    for hook in ("unregister_kv_caches", "restore_kv_caches"):
        assert getattr(TieredOffloadingConnector, hook) is not getattr(
            KVConnectorBase_V1, hook, None)
    assert vllm_api.HAS_SLEEP_HOOKS == hasattr(KVConnectorBase_V1, "unregister_kv_caches")
