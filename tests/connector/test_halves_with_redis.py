"""Scheduler and worker halves together (rigs/halves.py), with the real Redis.

One scheduler and one or two workers (TP ranks, each with its own KV tensors and its own
Redis tier), wired as vLLM wires them: plan -> start_step -> save -> merged reports. "Engines"
that share a Redis prefix restore each other's blocks; a value that is missing, damaged or
foreign on any rank is a miss or a failed restore, never a wrong block.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import torch

from connector.vllm_connector.config import TieredConfig
from connector.vllm_connector.remote_store import OwnRedis
from connector.vllm_connector.scheduler import ATTENTION, GroupSpec
from offload_tiers.keys import BlockKey, BlockKind
from rigs.halves import BS, HYBRID, Halves, as_bytes, identity
from rigs.redis_server import RedisServer
from rigs.sched_doubles import Blk, Req

Make = Callable[..., Halves]


@pytest.fixture
def engines(redis_url: str, key_prefix: str) -> Iterator[Make]:
    """Engines on the machine's Redis under this test's prefix; closed afterwards."""
    made: list[Halves] = []

    def make(tp: int = 1, url: str | None = redis_url, cfg: dict[str, Any] | None = None,
             **kw: Any) -> Halves:
        config = TieredConfig(cpu_bytes=1 << 20, redis_url=url, redis_prefix=key_prefix,
                              **(cfg or {}))
        made.append(Halves(config, tp_size=tp, **kw))
        return made[-1]

    yield make
    for e in made:
        e.close()


def _names(url: str, prefix: str) -> list[bytes]:
    return sorted(redis.Redis.from_url(url).scan_iter(match=f"{prefix}:*"))


def _save_prefix(e: Halves, blocks: int = 3, req_id: str = "a", seed: int = 1) -> Req:
    """``req_id`` (100 tokens) computes ``blocks`` full blocks (ids 1..) and saves them."""
    req = Req(req_id, 100)
    e.fill(range(1, blocks + 1), seed=seed)
    e.admit(req, [[Blk(i, i * BS) for i in range(1, blocks + 1)]], 0)
    result = e.step({req_id: blocks * BS})
    assert len(result.plan.saves) == blocks
    return req


def _same_blocks(a: Halves, a_ids: list[int], b: Halves, b_ids: list[int],
                 layer: str = "attn0") -> bool:
    return all(torch.equal(ra.kv[layer][a_ids], rb.kv[layer][b_ids])
               for ra, rb in zip(a.ranks, b.ranks, strict=True))


# ---------------------------------------------------------------------------- restores
@pytest.mark.parametrize("tp", [1, 2])
def test_lookup_asks_again_while_the_probe_is_out(engines: Make, tp: int) -> None:
    first = engines(tp)
    _save_prefix(first)
    second = engines(tp)
    req = Req("b", 100)
    assert second.sched.lookup(req, 0) == (None, False)
    assert second.sched.lookup(req, 0) == (None, False)  # the probe goes with the next plan
    result = second.step()
    assert len(result.plan.probes) == 1
    (save_ids, reports), = result.report.probes.values()
    # every rank read the same save of each key (the ids in the values' headers)
    assert len(save_ids) == 3 and all(i > 0 for i in save_ids) and reports == tp
    assert second.sched.lookup(req, 0) == (96, True)


@pytest.mark.parametrize("write_mode", ["through", "back"])
@pytest.mark.parametrize("tp", [1, 2])
def test_second_engine_restores_from_redis_byte_exact(engines: Make, key_prefix: str,
                                                      redis_url: str, tp: int,
                                                      write_mode: str) -> None:
    first = engines(tp, cfg={"write_mode": write_mode})
    _save_prefix(first)
    assert first.counter("blocks_written_redis") == [3] * tp
    assert len(_names(redis_url, key_prefix)) == 3 * tp
    assert {c.medium for c in first.sched.outbox if c.stored} == {"CPU", "STORAGE"}
    assert first.cpu()["pinned"] == 0

    second = engines(tp, cfg={"write_mode": write_mode})
    req = Req("b", 100)
    assert second.lookup(req) == (96, True)  # from Redis: an asynchronous load
    second.admit(req, [[Blk(7), Blk(8), Blk(9), Blk(10)]], 96)
    result = second.step()
    plan = result.plan
    assert [op.key.num_tokens for op in plan.fetches] == [32, 64, 96]
    assert [(op.block_id, op.after_fetch) for op in plan.loads] == [
        (7, True), (8, True), (9, True)]
    assert plan.async_reqs == ["b"]
    assert result.finished == {"b"} and result.failed == set()
    assert _same_blocks(first, [1, 2, 3], second, [7, 8, 9])
    assert not any(r.kv["attn0"][10].any() for r in second.ranks)
    assert second.sched.counters.snapshot()["hit_tokens_redis"] == 96
    assert second.counter("blocks_loaded_redis") == [3] * tp
    cpu = second.cpu()
    assert cpu["entries"] == 3 and cpu["pinned"] == 0 and cpu["reserved"] == 0
    # Now in this engine's CPU tier: the next hit is synchronous, with no Redis round trip.
    assert second.sched.lookup(Req("c", 100), 0) == (96, False)


@pytest.mark.parametrize("tp", [1, 2])
def test_cpu_hit_is_a_synchronous_load_byte_exact(engines: Make, tp: int) -> None:
    e = engines(tp, url=None)
    _save_prefix(e)
    req = Req("b", 130)
    assert e.sched.lookup(req, 0) == (96, False)  # no Redis configured: answered at once
    e.admit(req, [[Blk(7), Blk(8), Blk(9), Blk(10), Blk(11)]], 96)
    result = e.step()
    assert [(op.block_id, op.after_fetch) for op in result.plan.loads] == [
        (7, False), (8, False), (9, False)]
    assert result.plan.fetches == [] and result.plan.async_reqs == []
    assert result.finished == set() and result.load_errors == set()
    assert _same_blocks(e, [1, 2, 3], e, [7, 8, 9])
    assert e.counter("blocks_loaded_cpu") == [3] * tp


def test_hybrid_restores_every_group_from_redis_and_cpu(engines: Make) -> None:
    first = engines(groups=HYBRID, num_blocks=48)
    req = Req("a", 200)
    first.fill([11, 20, 21], seed=3)
    first.pool[11] = Blk(11, 96)  # vLLM's Mamba hand-off block holding the state at 96
    first.admit(req, [[Blk(0, is_null=True), Blk(11)], [Blk(20, 64), Blk(21, 96)]], 0)
    saved = first.step({"a": 96}, {"a": [(0, 11, 96)]}).plan.saves
    assert [(op.group, op.key.num_tokens, op.key.kind) for op in saved] == [
        (1, 64, BlockKind.FULL), (1, 96, BlockKind.PARTIAL), (0, 96, BlockKind.PARTIAL)]

    second = engines(groups=HYBRID, num_blocks=48)
    again = Req("b", 200)
    assert second.lookup(again) == (96, True)
    second.admit(again, [[Blk(0, is_null=True), Blk(31)], [Blk(40), Blk(41), Blk(42)]], 96)
    result = second.step()
    assert result.finished == {"b"} and result.failed == set()
    assert _same_blocks(first, [20, 21], second, [40, 41], layer="attn1")
    assert _same_blocks(first, [11], second, [31], layer="mamba0")

    # From the CPU tier (the first engine's): asynchronous too, done within the step.
    local = Req("c", 200)
    assert first.sched.lookup(local, 0) == (None, False)  # 128.. is probed in Redis
    assert first.lookup(local) == (96, True)
    first.admit(local, [[Blk(0, is_null=True), Blk(12)], [Blk(22), Blk(23), Blk(24)]], 96)
    result = first.step()
    assert result.plan.fetches == [] and result.finished == {"c"}
    assert _same_blocks(first, [20, 21], first, [22, 23], layer="attn1")
    assert _same_blocks(first, [11], first, [12], layer="mamba0")


@pytest.mark.parametrize("tp", [1, 2])
def test_a_finishing_requests_partial_tail_is_kept_then_released(engines: Make,
                                                                 tp: int) -> None:
    """vLLM hands a finishing hybrid request's Mamba partial tail to the connector: it is
    saved in the next step, reported as finished sending once every rank copied it (vLLM
    frees the blocks then), and a later request restores from it."""
    first = engines(tp, groups=HYBRID, num_blocks=48)
    req = Req("a", 97)
    first.fill([11, 20, 21], seed=4)
    first.pool[11] = Blk(11, 96)  # the exact table block: state at 96 (a PARTIAL tail)
    first.admit(req, [[Blk(0, is_null=True), Blk(11)], [Blk(20, 64), Blk(21, 96)]], 0)
    first.step({"a": 96})  # the attention blocks; no boundary hand-off in a step
    req.num_computed_tokens = 96
    assert first.sched.register_tail(req, [(0, 11, 96)]) is True
    first.sched.finished("a")
    result = first.step()
    tail = [op for op in result.plan.saves if op.group == 0]
    assert [(op.key.num_tokens, op.key.kind) for op in tail] == [(96, BlockKind.PARTIAL)]
    assert result.plan.tail_reqs == ["a"]
    assert all(sent == {"a"} for sent in result.sent.values()) and len(result.sent) == tp
    assert first.sched.counters.snapshot()["partial_tails_saved"] == 1
    # Without the tail there is no Mamba state at 96: the hit exists only because of it.
    again = Req("b", 200)
    again.block_hashes = req.block_hashes + [b"more"] * 3
    assert first.lookup(again) == (96, True)
    first.admit(again, [[Blk(0, is_null=True), Blk(12)], [Blk(22), Blk(23), Blk(24)]], 96)
    assert first.step().finished == {"b"}
    assert _same_blocks(first, [11], first, [12], layer="mamba0")


def test_a_tail_that_is_not_the_state_at_its_tokens_is_refused(engines: Make) -> None:
    e = engines(groups=HYBRID, num_blocks=48)
    req = Req("a", 97)
    e.admit(req, [[Blk(0, is_null=True), Blk(11)], [Blk(20, 64), Blk(21, 96)]], 0)
    req.num_computed_tokens = 96
    e.pool[11] = Blk(11, None)  # the block carries no hash: not the state at 96
    assert e.sched.register_tail(req, [(0, 11, 96)]) is False
    assert e.step().plan.tail_reqs == []


# ---------------------------------------------------------------------------- TP ranks
def test_each_rank_stores_its_own_shard_under_its_own_key(engines: Make, redis_url: str,
                                                          key_prefix: str) -> None:
    e = engines(2)
    req = _save_prefix(e)
    names = _names(redis_url, key_prefix)
    assert len(names) == 6
    fingerprints = {n.decode().split(":")[1] for n in names}
    base = e.key(req, 0, 32).fingerprint
    assert len(fingerprints) == 2 and base not in fingerprints
    for block, tokens in ((1, 32), (2, 64), (3, 96)):
        key = e.key(req, 0, tokens)
        shards = [rank.stored(key) for rank in e.ranks]
        for rank, shard in zip(e.ranks, shards, strict=True):
            assert shard == as_bytes(rank.kv["attn0"][block])
        assert shards[0] != shards[1]
    # A rank's value is not readable under the other rank's key (namespace in the header).
    r0, r1 = e.ranks
    key = e.key(req, 0, 32)
    client = redis.Redis.from_url(redis_url)
    name1 = f"{key_prefix}:{r1.worker.storage_key(key).name}"
    client.set(name1, client.get(f"{key_prefix}:{r0.worker.storage_key(key).name}"))
    assert r1.stored(key) is None


def _rank_name(e: Halves, rank: int, key: BlockKey, prefix: str) -> str:
    return f"{prefix}:{e.ranks[rank].worker.storage_key(key).name}"


def test_a_value_missing_for_one_rank_at_probe_time_is_a_miss(engines: Make, redis_url: str,
                                                              key_prefix: str) -> None:
    first = engines(2)
    req = _save_prefix(first)
    client = redis.Redis.from_url(redis_url)
    assert client.delete(_rank_name(first, 1, first.key(req, 0, 64), key_prefix)) == 1
    second = engines(2)
    again = Req("b", 100)
    assert second.lookup(again) == (32, True)  # the 64 block is whole on rank 0 only
    second.admit(again, [[Blk(7), Blk(8), Blk(9), Blk(10)]], 32)
    result = second.step()
    assert [op.key.num_tokens for op in result.plan.fetches] == [32]
    assert result.finished == {"b"} and result.failed == set()
    assert _same_blocks(first, [1], second, [7])


def _damage(client: redis.Redis, name: str, other: str, how: str) -> None:
    value = client.get(name)
    assert value is not None
    if how == "delete":
        client.delete(name)
    elif how == "flip":  # a payload byte: the header (and so the probe) still looks fine
        data = bytearray(value)
        data[-5] ^= 0x01
        client.set(name, bytes(data))
    elif how == "foreign":  # the other rank's value of the same block
        client.set(name, client.get(other))
    else:  # truncate
        client.set(name, value[: len(value) // 2])


@pytest.mark.parametrize("how", ["delete", "flip", "foreign"])
def test_a_value_lost_for_one_rank_after_the_probe_fails_the_restore(
        engines: Make, redis_url: str, key_prefix: str, how: str) -> None:
    first = engines(2)
    req = _save_prefix(first)
    second = engines(2)
    again = Req("b", 100)
    assert second.lookup(again) == (96, True)
    second.admit(again, [[Blk(7), Blk(8), Blk(9), Blk(10)]], 96)
    bad = first.key(req, 0, 64)
    _damage(redis.Redis.from_url(redis_url), _rank_name(first, 1, bad, key_prefix),
            _rank_name(first, 0, bad, key_prefix), how)
    result = second.step()
    assert result.failed == {"b"} and result.finished == {"b"}  # vLLM recomputes "b"
    # Never a wrong block: the failing rank wrote none of the request's blocks.
    assert not second.ranks[1].kv["attn0"][7:10].any()
    cpu = second.cpu()
    assert cpu["reserved"] == 0 and cpu["pinned"] == 0 and cpu["entries"] == 2
    assert not second.sched.directory.contains(second.key(again, 0, 64))
    assert second.sched.counters.snapshot()["redis_misses_at_fetch"] == 1
    # The bad key is not offered again right away: the hit ends before it, from the CPU
    # tier, with no probe (the answer is immediate).
    assert second.sched.lookup(Req("c", 100), 0) == (32, False)


@pytest.mark.parametrize(("how", "at_probe"), [("flip", False), ("foreign", True),
                                               ("truncate", True)])
def test_damaged_redis_values_are_misses_never_loaded(engines: Make, redis_url: str,
                                                      key_prefix: str, how: str,
                                                      at_probe: bool) -> None:
    first = engines()
    req = _save_prefix(first, blocks=2)
    client = redis.Redis.from_url(redis_url)
    bad, good = first.key(req, 0, 64), first.key(req, 0, 32)
    _damage(client, _rank_name(first, 0, bad, key_prefix),
            _rank_name(first, 0, good, key_prefix), how)
    second = engines()
    again = Req("b", 100)
    if at_probe:  # header or length give it away: only the first block is offered
        assert second.lookup(again) == (32, True)
        return
    assert second.lookup(again) == (64, True)  # a payload byte: caught by the checksum
    second.admit(again, [[Blk(7), Blk(8), Blk(9), Blk(10)]], 64)
    result = second.step()
    assert result.failed == {"b"}
    assert not second.ranks[0].kv["attn0"][7:9].any()
    # Not offered again right away (and not probed: the answer is immediate).
    assert second.sched.lookup(Req("c", 70), 0) == (32, False)


# ---------------------------------------------------------------------------- failures
@pytest.mark.parametrize("tp", [1, 2])
def test_a_failed_load_skips_that_steps_saves_which_are_planned_again(engines: Make,
                                                                      tp: int) -> None:
    e = engines(tp)
    _save_prefix(e, blocks=2)
    req = Req("b", 130)
    assert e.lookup(req) == (64, False)  # the CPU tier has 2 blocks, Redis nothing more
    e.fill([7, 8], seed=5)  # what "b" computes in this step
    e.admit(req, [[Blk(5, 32), Blk(6, 64), Blk(7, 96), Blk(8, 128), Blk(9)]], 64)
    plan = e.plan({"b": 128})
    assert [op.block_id for op in plan.loads] == [5, 6]
    assert [op.key.num_tokens for op in plan.saves] == [96, 128]
    # The last rank's slot no longer holds the first block (a copy it never made).
    victim = e.ranks[-1].worker
    victim.slot_keys[plan.loads[0].slot] = None
    # That rank already holds a valid shard of the 96-token key from an older save: the
    # other ranks' shards of this step must never be served beside it.
    older = victim.storage_key(plan.saves[0].key)
    assert isinstance(victim.redis, OwnRedis)
    assert victim.redis.tier.put_many([(older, as_bytes(e.ranks[-1].kv["attn0"][2]))],
                                      save_ids=[12345]) == 1
    e.run(plan)
    result = e.deliver(plan)
    assert result.load_errors == {5}
    assert e.counter("saves_skipped_after_failed_load") == [0] * (tp - 1) + [2]
    for op in plan.saves:  # computed over a bad context on that rank: not kept anywhere
        assert not e.sched.directory.contains(op.key)
    assert e.cpu()["pinned"] == 0 and e.cpu()["reserved"] == 0
    for rank in e.ranks:
        assert rank.worker.flush_redis(10.0)  # the other ranks' shards have landed
    # A new engine finds no save of the 96/128 keys held by every rank: only the 2 blocks
    # stored before the failed step are a hit (with one rank, the older save is whole).
    assert engines(tp).lookup(Req("b", 130)) == ((96, True) if tp == 1 else (64, True))
    again = e.step({"b": 128})
    assert [op.key for op in again.plan.saves] == [op.key for op in plan.saves]
    assert all(e.sched.directory.contains(op.key) for op in plan.saves)
    for op in plan.saves:
        for rank in e.ranks:
            assert rank.stored(op.key) == as_bytes(rank.kv["attn0"][op.block_id])


@pytest.mark.parametrize("fault", ["pause", "kill"])
@pytest.mark.parametrize("tp", [1, 2])
def test_write_pins_are_released_by_reports_and_redis_down_leaks_no_slot(
        redis_server: RedisServer, key_prefix: str, tp: int, fault: str) -> None:
    # a paused server costs each wait this timeout; 0.25 s failed a write to the restarted,
    # healthy server on a loaded CI machine (the last assertion)
    config = TieredConfig(cpu_bytes=1 << 20, redis_url=redis_server.url,
                          redis_prefix=key_prefix, redis_timeout_s=3.0)
    e = Halves(config, tp_size=tp, num_slots=8)
    try:
        req = Req("a", 16 * BS)
        e.fill(range(16), seed=7)
        e.admit(req, [[Blk(i, (i + 1) * BS) for i in range(16)]], 0)
        plan = e.plan({"a": 2 * BS})
        e.run(plan)
        assert e.cpu()["pinned"] == 2  # queued for Redis: the slots must not be reused
        e.deliver(plan)
        assert e.cpu()["pinned"] == 0 and e.cpu()["entries"] == 2
        assert all(r.stored(op.key) == as_bytes(r.kv["attn0"][op.block_id])
                   for op in plan.saves for r in e.ranks)

        if fault == "pause":
            redis_server.pause()  # SIGSTOP: connected, nothing answers (timeouts)
        else:
            redis_server.kill()  # SIGKILL: connections refused
        result = e.step({"a": 4 * BS})
        assert [op.to_redis for op in result.plan.saves] == [True, True]
        assert e.cpu()["pinned"] == 0  # the failed writes were reported: pins released
        assert e.counter("redis_write_failures") == [2] * tp
        assert 0 in result.report.redis_up.values() and not e.sched.redis_up
        # Redis down: saves go to the CPU tier only, unpinned, counted; more blocks than
        # slots still fit (LRU eviction), nothing reserved or pinned is left behind.
        result = e.step({"a": 16 * BS})
        assert len(result.plan.saves) == 12
        assert not any(op.to_redis for op in result.plan.saves)
        assert e.sched.counters.snapshot()["redis_unavailable_saves"] == 12
        cpu = e.cpu()
        assert cpu["pinned"] == 0 and cpu["reserved"] == 0 and cpu["entries"] == 8
        assert e.sched.counters.snapshot()["store_drops"] == 0

        if fault == "pause":
            redis_server.resume()
        else:
            redis_server.start()  # the same port
        _until_redis_up(e)
        late = Req("z", 2 * BS + 1)
        late.block_hashes = [b"z0", b"z1"]
        e.admit(late, [[Blk(0, BS), Blk(1, 2 * BS)]], 0)
        result = e.step({"z": 2 * BS})
        assert [op.to_redis for op in result.plan.saves] == [True, True]
        assert e.cpu()["pinned"] == 0
        assert all(r.stored(op.key) is not None for op in result.plan.saves for r in e.ranks)
    finally:
        e.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_entries_saved_while_redis_was_down_reach_it_once_it_answers(
        redis_server: RedisServer, key_prefix: str, tp: int) -> None:
    """Saves whose write timed out, and saves planned for the CPU tier only while Redis was
    down, are written from their slots once it answers (each once, counted, no pin left,
    not made recently used): another engine then restores the whole prefix from Redis,
    byte-exact."""
    def config() -> TieredConfig:
        return TieredConfig(cpu_bytes=1 << 20, redis_url=redis_server.url,
                            redis_prefix=key_prefix, redis_timeout_s=1.0)

    e, other = Halves(config(), tp_size=tp), None
    try:
        e.fill(range(1, 7), seed=3)
        e.admit(Req("a", 6 * BS + 4), [[Blk(i, i * BS) for i in range(1, 7)]], 0)
        e.step({"a": 2 * BS})
        assert e.counter("blocks_written_redis") == [2] * tp
        redis_server.pause()  # SIGSTOP: the next writes time out
        try:
            failed = e.step({"a": 4 * BS})
            assert [op.to_redis for op in failed.plan.saves] == [True, True]
            assert e.counter("redis_write_failures") == [2] * tp and not e.sched.redis_up
            cpu_only = e.step({"a": 6 * BS})
            assert [op.to_redis for op in cpu_only.plan.saves] == [False, False]
            assert not e.step().plan.backfills  # nothing is tried while Redis is down
        finally:
            redis_server.resume()
        _until_redis_up(e)
        late = failed.plan.saves + cpu_only.plan.saves
        order, hits = e.sched.directory.keys(), e.cpu()["hits"]
        result = e.step()
        assert {op.key for op in result.plan.backfills} == {op.key for op in late}
        # Held while written, not read: the LRU order and the tier's hits are as they were.
        assert e.sched.directory.keys() == order and e.cpu()["hits"] == hits
        assert e.sched.counters.snapshot()["redis_backfills"] == 4
        assert e.counter("blocks_backfilled_redis") == [4] * tp
        assert e.counter("redis_backfill_failures") == [0] * tp
        assert e.counter("blocks_written_redis") == [2] * tp  # backfills counted apart
        assert e.cpu()["pinned"] == 0
        assert all(r.stored(op.key) == as_bytes(r.kv["attn0"][op.block_id])
                   for op in late for r in e.ranks)
        assert not e.step().plan.backfills  # each entry once

        other = Halves(config(), tp_size=tp)
        req = Req("b", 6 * BS + 4)
        assert other.lookup(req) == (6 * BS, True)
        other.admit(req, [[Blk(i) for i in range(9, 16)]], 6 * BS)
        restored = other.step()
        assert restored.finished == {"b"} and restored.failed == set()
        assert _same_blocks(e, list(range(1, 7)), other, list(range(9, 15)))
    finally:
        e.close()
        if other is not None:
            other.close()


def test_no_backfill_when_it_is_turned_off(redis_server: RedisServer, key_prefix: str) -> None:
    e = Halves(TieredConfig(cpu_bytes=1 << 20, redis_url=redis_server.url,
                            redis_prefix=key_prefix, redis_backfill=False))
    try:
        e.fill(range(1, 3), seed=4)
        e.admit(Req("a", 2 * BS + 4), [[Blk(i, i * BS) for i in range(1, 3)]], 0)
        redis_server.kill()  # refused at once: the write fails, Redis is marked down
        e.step({"a": BS})
        assert e.counter("redis_write_failures") == [1] and not e.sched.redis_up
        assert [op.to_redis for op in e.step({"a": 2 * BS}).plan.saves] == [False]
        redis_server.start()
        _until_redis_up(e)
        assert not e.step().plan.backfills
        assert e.sched.counters.snapshot()["redis_backfills"] == 0
    finally:
        e.close()


def test_a_backfill_whose_slot_moved_on_one_rank_drops_the_entry(
        redis_server: RedisServer, key_prefix: str) -> None:
    """TP=2: rank 1's slot no longer holds the key when the backfill runs. That rank writes
    nothing and fails the op as a failed copy: the scheduler drops the entry, and another
    engine finds no hit (rank 0's lone shard is never served)."""
    def config() -> TieredConfig:
        return TieredConfig(cpu_bytes=1 << 20, redis_url=redis_server.url,
                            redis_prefix=key_prefix)

    e, other = Halves(config(), tp_size=2), None
    try:
        e.fill(range(1, 3), seed=5)
        e.admit(Req("a", 2 * BS + 4), [[Blk(i, i * BS) for i in range(1, 3)]], 0)
        redis_server.kill()
        e.step({"a": BS})  # refused at once: Redis marked down
        assert not e.sched.redis_up
        (op,) = e.step({"a": 2 * BS}).plan.saves
        assert not op.to_redis
        redis_server.start()
        _until_redis_up(e)
        e.ranks[1].worker.slot_keys[op.slot] = None  # as after a copy into it that failed
        result = e.step()
        assert [b.key for b in result.plan.backfills if b.key == op.key] == [op.key]
        assert e.counter("redis_backfill_failures")[1] >= 1
        assert not e.sched.directory.contains(op.key)
        assert e.ranks[1].stored(op.key) is None
        other = Halves(config(), tp_size=2)
        req = Req("b", 2 * BS + 4)
        # the first block (its write was refused, then backfilled on both ranks), never the
        # dropped one
        assert other.lookup(req) == (BS, True)
    finally:
        e.close()
        if other is not None:
            other.close()


def _until_redis_up(e: Halves, deadline_s: float = 120.0) -> None:
    """Run empty steps (a worker reports its Redis health when it changes) until it
    answers."""
    deadline = time.monotonic() + deadline_s
    while not e.sched.redis_up:
        assert time.monotonic() < deadline, "Redis did not come back within the deadline"
        e.step()
        time.sleep(0.02)  # polling interval


def test_closed_worker_reports_its_saves_failed_and_keeps_stats(engines: Make) -> None:
    e = engines(url=None)
    _save_prefix(e, blocks=2)
    worker = e.ranks[0].worker
    worker.close()
    worker.close()  # idempotent
    assert worker.transfer is None and worker.slab is None
    assert worker.counters.snapshot()["blocks_saved"] == 2
    req = Req("b", 200)
    e.admit(req, [[Blk(i, (i + 1) * BS) for i in range(4)]], 0)
    result = e.step({"b": 4 * BS})  # no crash; the two new blocks are not trusted
    assert len(result.plan.saves) == 2
    assert all(not e.sched.directory.contains(op.key) for op in result.plan.saves)
    assert e.sched.stats()["cpu_tier"]["entries"] == 2 and e.sched.stats()["open_jobs"] == 0


# ---------------------------------------------------------------------------- namespaces
@pytest.mark.parametrize("tp", [1, 2])
def test_partial_entry_is_kept_after_its_block_fills(engines: Make, redis_url: str,
                                                     key_prefix: str, tp: int) -> None:
    """Issue 10 item 4: a PARTIAL entry serves every request sharing its prefix."""
    groups = [GroupSpec(0, ATTENTION, 64)]
    e = engines(tp, groups=groups)
    req = Req("a", 200)
    e.fill([1], seed=9)
    e.admit(req, [[Blk(1, 32)]], 0)
    assert [op.key.kind for op in e.step({"a": 32}).plan.saves] == [BlockKind.PARTIAL]
    at_partial = [r.kv["attn0"][1].clone() for r in e.ranks]
    for r in e.ranks:
        r.kv["attn0"][1][:, 32:] = torch.randn(2, 32, 8)  # tokens 32..63 are computed
    e.blocks["a"][0][0] = Blk(1, 64)  # vLLM re-keys the block once it is full
    assert [op.key.kind for op in e.step({"a": 64}).plan.saves] == [BlockKind.FULL]
    partial, full = e.key(req, 0, 32), e.key(req, 0, 64)
    assert e.sched.directory.contains(partial) and e.sched.directory.contains(full)
    assert not [c for c in e.sched.outbox if not c.stored]
    for r, before in zip(e.ranks, at_partial, strict=True):
        assert r.stored(partial) == as_bytes(before)
        assert r.stored(full) == as_bytes(r.kv["attn0"][1])
    assert len(_names(redis_url, key_prefix)) == 2 * tp

    # Another request sharing only the first 32 tokens hits the PARTIAL, here and elsewhere.
    short = Req("b", 50)
    assert e.sched.lookup(short, 0) == (32, False)
    other = engines(tp, groups=groups)
    assert other.lookup(short) == (32, True)
    other.admit(short, [[Blk(5)]], 32)
    assert other.step().finished == {"b"}
    for r, before in zip(other.ranks, at_partial, strict=True):
        assert torch.equal(r.kv["attn0"][5], before)


@pytest.mark.parametrize(("field", "a", "b"), [
    ("weights_version", "w1", "w2"),
    ("kv_cache_dtype", "fp8_e4m3", "fp8_e5m2"),
    ("quantization", "", "fp8"),
    ("revision", "main", "abc123"),
    ("kv_scales", "calc=False", "calc=True"),
])
def test_engines_of_another_identity_never_share_redis_values(
        engines: Make, field: str, a: str, b: str) -> None:
    mine = engines(ident=identity(HYBRID[1:], 1, **{field: a}))
    _save_prefix(mine, blocks=2)
    same = engines(ident=identity(HYBRID[1:], 1, **{field: a}))
    assert same.lookup(Req("b", 100)) == (64, True)
    other = engines(ident=identity(HYBRID[1:], 1, **{field: b}))
    assert other.lookup(Req("b", 100)) == (0, False)


def test_weights_version_setting_and_reset_generation_move_the_namespace(
        engines: Make, redis_url: str, key_prefix: str) -> None:
    e = engines(cfg={"weights_version": "w1"})
    _save_prefix(e, blocks=2)
    assert engines(cfg={"weights_version": "w2"}).lookup(Req("b", 100)) == (0, False)
    assert engines(cfg={"weights_version": "w1"}).lookup(Req("b", 100)) == (64, True)
    assert e.sched.lookup(Req("c", 70), 0) == (64, False)  # its own CPU tier
    e.reset()  # e.g. after a weight update: nothing stored before is served again
    assert e.cpu()["entries"] == 0
    assert e.lookup(Req("d", 100)) == (0, False)
    assert len(_names(redis_url, key_prefix)) == 2  # old values are left to the TTL
    _save_prefix(e, blocks=2, req_id="e")
    assert len(_names(redis_url, key_prefix)) == 4  # the new generation's own keys


# ---------------------------------------------------------------------------- a full tier
def test_a_step_saving_more_blocks_than_cpu_slots_writes_the_rest_to_redis_directly(
        engines: Make, redis_url: str, key_prefix: str) -> None:
    """A batched prefill saves 20 blocks into a 16-slot CPU tier.

    Slots waiting for their Redis write are pinned, so 16 blocks take a slot and the other
    4 go to Redis through a buffer of the worker's own (overflow saves), in the same step:
    none is lost even if the request finishes in that step.
    """
    e = engines(num_slots=16, num_blocks=24)
    e.fill(range(20), seed=11)
    req = Req("a", 20 * BS + 5)
    e.admit(req, [[Blk(i, (i + 1) * BS) for i in range(20)]], 0)
    first = e.step({"a": 20 * BS + 5})
    assert len(first.plan.saves) == 20
    overflow = [op for op in first.plan.saves if op.slot is None]
    assert [op.key.num_tokens for op in overflow] == [17 * BS, 18 * BS, 19 * BS, 20 * BS]
    snap = e.sched.counters.snapshot()
    assert snap["store_drops"] == 0 and snap["overflow_saves"] == 4
    assert e.counter("blocks_written_redis") == [20]
    assert len(_names(redis_url, key_prefix)) == 20
    second = e.step({"a": 20 * BS + 5})
    assert second.plan.saves == []
    cpu = e.cpu()
    assert cpu["entries"] == 16 and cpu["reserved"] == 0 and cpu["pinned"] == 0
    # The overflow blocks are valid in Redis: a fresh engine restores all 20.
    other = engines(num_slots=32, num_blocks=48)
    again = Req("b", 20 * BS + 5)
    again.block_hashes = req.block_hashes
    assert other.lookup(again) == (20 * BS, True)
    other.admit(again, [[Blk(24 + i) for i in range(21)]], 20 * BS)
    assert other.step().finished == {"b"}
    assert _same_blocks(e, list(range(20)), other, list(range(24, 44)))


def test_restore_into_a_cpu_tier_full_of_pins_takes_what_fits(engines: Make) -> None:
    """14 of 16 CPU slots pinned by other requests' loads; a 4-block hit sits in Redis.

    The 2 free slots restore the first 2 blocks (64 tokens); pinned entries are not evicted.
    """
    first = engines(num_slots=16)
    req = Req("a", 4 * BS + 5)
    first.fill(range(4), seed=13)
    first.admit(req, [[Blk(i, (i + 1) * BS) for i in range(4)]], 0)
    first.step({"a": 4 * BS + 5})
    second = engines(num_slots=16)
    directory = second.sched.directory
    for i in range(14):  # other requests' in-flight loads
        key = BlockKey("ef" * 16, 0, i.to_bytes(8, "big"), BS, BlockKind.FULL)
        assert directory.reserve(key) is not None
        directory.commit(key)
        assert directory.acquire(key) is not None
    again = Req("b", 4 * BS + 5)
    assert second.lookup(again) == (2 * BS, True)
    stats = second.cpu()
    assert stats["pinned"] == 14 and stats["reserved"] == 2 and stats["evictions"] == 0
    second.admit(again, [[Blk(i) for i in range(8, 13)]], 2 * BS)
    assert second.step().finished == {"b"}
    assert _same_blocks(first, [0, 1], second, [8, 9])


# ------------------------------------------------------------- defects found while porting
# A CPU hit's pins go at on_alloc; a Redis hit looked up later in the same schedule() may
# reserve (evict) that slot: the worker must run the CPU loads before it starts the fetch.
def test_a_cpu_load_survives_a_fetch_reserved_later_in_the_same_step(engines: Make) -> None:
    source = engines(num_slots=4)
    x = Req("x", 40)
    x.block_hashes = [b"x0"]
    source.fill([3], seed=31)
    source.admit(x, [[Blk(3, BS)]], 0)
    source.step({"x": BS})  # x0 is in Redis

    e = engines(num_slots=2)
    a = Req("a", 40)
    a.block_hashes = [b"a0"]
    e.fill([1], seed=32)
    e.admit(a, [[Blk(1, BS)]], 0)
    e.step({"a": BS})  # a0 in one CPU slot; the other slot is pinned by another load
    other = BlockKey("ef" * 16, 0, b"busy", BS, BlockKind.FULL)
    directory = e.sched.directory
    assert directory.reserve(other) is not None
    directory.commit(other)
    assert directory.acquire(other) is not None
    x2 = Req("x2", 40)
    x2.block_hashes = [b"x0"]
    assert e.sched.lookup(x2, 0) == (None, False)
    e.step()  # the probe is answered
    # One schedule() pass: a2 hits a0 in the CPU tier, then x2 takes its Redis hit.
    a2 = Req("a2", 40)
    a2.block_hashes = [b"a0"]
    assert e.sched.lookup(a2, 0) == (32, False)
    e.admit(a2, [[Blk(5), Blk(6)]], 32)
    assert e.sched.lookup(x2, 0) == (32, True)
    e.admit(x2, [[Blk(8), Blk(9)]], 32)
    result = e.step()
    assert result.finished == {"x2"} and result.failed == set()
    assert result.load_errors == set()
    assert _same_blocks(e, [1], e, [5]) and _same_blocks(source, [3], e, [8])


# A key whose fetch failed is not offered again for a while, but it must be once this
# engine has stored a good value again.
def test_a_key_whose_fetch_failed_is_served_again_once_rewritten(engines: Make,
                                                                 redis_url: str,
                                                                 key_prefix: str) -> None:
    first = engines()
    _save_prefix(first, blocks=1)
    e = engines(num_slots=2)
    b = Req("b", 40)
    assert e.lookup(b) == (32, True)
    e.admit(b, [[Blk(5), Blk(6)]], 32)
    client = redis.Redis.from_url(redis_url)
    client.delete(*_names(redis_url, key_prefix))  # evicted between probe and fetch
    assert e.step().failed == {"b"}
    e.fill([5], seed=33)  # vLLM recomputes b's first block; kvtier stores it again
    e.blocks["b"] = [[Blk(5, BS), Blk(6)]]
    e.sched.preempted("b")
    assert len(e.step({"b": BS}).plan.saves) == 1
    assert len(_names(redis_url, key_prefix)) == 1
    for i in range(2):  # other requests push it out of the 2-slot CPU tier
        q = Req(f"q{i}", 40)
        q.block_hashes = [f"q{i}".encode()]
        e.admit(q, [[Blk(10 + i, BS)]], 0)
        e.step({f"q{i}": BS})
    assert not e.sched.directory.contains(e.key(b, 0, BS))
    assert e.lookup(Req("d", 40)) == (32, True)
