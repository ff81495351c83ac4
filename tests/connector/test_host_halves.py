"""Both connector halves on the host tier: a real daemon process and real clients, the
scheduler and ``tp_size`` workers in this process over CPU tensors (no vLLM engine).

The scheduler names every rank's shard from rank 0's layout; the workers store under their
own: a restore byte-exact at TP=1 and TP=2 shows they agree. A shard reused between the
look-up and the fetch fails the restore (recomputed), and every pin is let go.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from connector.vllm_connector.config import TieredConfig
from connector.vllm_connector.host import host_digest
from connector.vllm_connector.host_tier_redis import HostTierRedisStore
from connector.vllm_connector.plan import FetchFrom
from connector.vllm_connector.presence import DaemonFeed
from rigs.daemon_proc import HostTierDaemon
from rigs.halves import BS, Blk, Halves, Req

Make = Callable[[int], Halves]
WAIT_S = 60.0


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[HostTierDaemon]:
    with HostTierDaemon(tmp_path / "run" / "host.sock", f"halves-{uuid.uuid4().hex[:12]}",
                        slots=256, slot_bytes=8192).running() as proc:
        yield proc


@pytest.fixture
def engines(daemon: HostTierDaemon) -> Iterator[Make]:
    made: list[Halves] = []

    def make(tp: int) -> Halves:
        config = TieredConfig(cpu_bytes=1 << 20, host_tier_socket=str(daemon.sock))
        made.append(Halves(config, tp_size=tp))
        return made[-1]

    yield make
    for e in made:
        e.close()


def _store(e: Halves, blocks: int = 3) -> None:
    req = Req("a", 100)
    e.fill(range(1, blocks + 1), seed=3)
    e.admit(req, [[Blk(i, i * BS) for i in range(1, blocks + 1)]], 0)
    result = e.step({"a": blocks * BS})
    assert [op.to_host for op in result.plan.saves] == [True] * blocks
    for rank in e.ranks:
        assert rank.worker.flush_host(WAIT_S)
    host = e.sched.host
    assert host is not None
    assert host.client.wait_until(lambda c: len(c.mirror) == blocks * e.tp_size, WAIT_S)


def _pins_held(e: Halves) -> int:
    host = e.sched.host
    assert host is not None and host.client._attached is not None
    attached = host.client._attached
    return int(attached.pins.counts[attached.row].sum())


@pytest.mark.parametrize("tp", [1, 2])
def test_a_new_engine_restores_every_rank_byte_exact(engines: Make, tp: int,
                                                     daemon: HostTierDaemon) -> None:
    first = engines(tp)
    _store(first)
    assert first.counter("blocks_written_host") == [3] * tp
    second = engines(tp)
    req = Req("b", 100)
    assert second.lookup(req) == (96, True)  # from the host tier: an asynchronous load
    assert _pins_held(second) == 3 * tp  # every rank's shard pinned until its fetch is back
    second.admit(req, [[Blk(7), Blk(8), Blk(9), Blk(10)]], 96)
    result = second.step()
    assert [op.source for op in result.plan.fetches] == [FetchFrom.HOST] * 3
    assert result.finished == {"b"} and result.failed == set()
    for r1, r2 in zip(first.ranks, second.ranks, strict=True):
        assert torch.equal(r1.kv["attn0"][[1, 2, 3]], r2.kv["attn0"][[7, 8, 9]])
    snap = second.sched.counters.snapshot()
    assert snap["hit_tokens_host"] == 96 and snap["hit_tokens_cpu"] == 0
    assert second.counter("blocks_loaded_host") == [3] * tp
    assert _pins_held(second) == 0
    # loaded straight from the shared segment: the host keeps one copy, none enters (or
    # reserves a slot in) this engine's own CPU tier
    assert second.cpu()["entries"] == 0 and second.cpu()["reserved"] == 0
    # the restore told the daemon those shards were used (its LRU)
    daemon.wait_for(lambda s: s["host_tier"]["touches"] == 3 * tp, what="the touches")


@pytest.mark.parametrize("tp", [1, 2])
def test_blocks_the_host_tier_holds_are_not_saved_again(engines: Make,
                                                      tp: int) -> None:
    """A third engine computes the same prefix (vLLM took no external tokens): the host
    tier holds it, so it saves nothing — not into the host tier a second time, not into
    its own CPU tier (one copy per host)."""
    first = engines(tp)
    _store(first)
    third = engines(tp)
    third.fill(range(1, 4), seed=3)
    third.admit(Req("a", 100), [[Blk(i, i * BS) for i in range(1, 4)]], 0)
    plan = third.step({"a": 3 * BS}).plan
    assert plan.saves == []
    assert third.sched.counters.snapshot()["host_held_saves_skipped"] == 3
    assert third.counter("blocks_written_host") == [0] * tp
    assert third.cpu()["entries"] == 0


def test_shards_of_two_saves_are_never_one_hit(engines: Make) -> None:
    """Issue 43 item 1. Engine X's rank 1 skips its host saves (its copies are given back
    uncommitted); engine Y then stores the same blocks: rank 0's shards are duplicates
    (dropped: X's stay), rank 1's are new. Every rank's digest is present, of two saves:
    a third engine finds no host hit (counted), never one assembled from X and Y."""
    x = engines(2)
    rank1 = x.ranks[1].worker
    assert rank1.host is not None
    rank1._commit_host = lambda lease, ops, nbytes: rank1.host.abandon(lease)  # type: ignore
    req = Req("a", 100)
    x.fill(range(1, 4), seed=3)
    x.admit(req, [[Blk(i, i * BS) for i in range(1, 4)]], 0)
    x.step({"a": 3 * BS})
    for rank in x.ranks:
        assert rank.worker.flush_host(WAIT_S)
    host = x.sched.host
    assert host is not None
    assert host.client.wait_until(lambda c: len(c.mirror) == 3, WAIT_S)  # rank 0's only
    y = engines(2)
    _store(y)  # rank 1's 3 shards committed, rank 0's 3 dropped as duplicates
    keys = [y.key(req, 0, end) for end in (32, 64, 96)]
    # x's mirror hears of y's commits after y's own does: wait for it, not for y's
    assert host.client.wait_until(lambda c: all(
        None not in [c.lookup(d) for d in host.digests(k)] for k in keys), WAIT_S)
    z = engines(2)
    assert z.lookup(Req("c", 100)) == (0, False)
    snap = z.sched.counters.snapshot()
    assert snap["host_mixed_saves"] >= 1 and snap["hit_tokens_host"] == 0
    assert _pins_held(z) == 0
    # vLLM 0.34's may_load_async walks the same books: it counts nothing, holds nothing
    z.sched.may_load_async(Req("d", 100), 0)
    assert z.sched.counters.snapshot()["host_mixed_saves"] == snap["host_mixed_saves"]
    assert _pins_held(z) == 0


def test_a_shard_reused_after_the_lookup_fails_the_restore_and_frees_the_pins(
        engines: Make) -> None:
    first = engines(2)
    _store(first)
    second = engines(2)
    req = Req("b", 100)
    assert second.lookup(req) == (96, True)
    # rank 1's shard of the second block is overwritten by another save in its slot
    host = second.sched.host
    assert host is not None
    key = first.key(req, 0, 64)
    rank1_digest = host.digests(key)[1]
    where = host.client.mirror[rank1_digest]
    segment = host.client.segment
    assert segment is not None
    segment.write(where.slot, host_digest(first.ranks[0].worker.storage_key(key)), 12345,
                  b"\0" * where.length)
    second.admit(req, [[Blk(7), Blk(8), Blk(9), Blk(10)]], 96)
    result = second.step()
    assert result.failed == {"b"}  # recomputed by vLLM, never loaded
    assert not second.ranks[1].kv["attn0"][8].any()
    snap = second.sched.counters.snapshot()
    assert snap["host_misses_at_fetch"] == 1 and snap["failed_restores"] == 1
    assert snap["hit_tokens_host"] == 0
    assert _pins_held(second) == 0


@pytest.mark.parametrize("tp", [1, 2])
def test_with_host_tier_redis_every_rank_restores_through_a_new_daemon(
        tmp_path: Path, redis_url: str, key_prefix: str, tp: int) -> None:
    """``host_tier_redis``: no Redis connection in either half. Engine A's ranks store
    through the daemon (written behind); the daemon is stopped and a new one, its segment
    empty, walks Redis; engine B's scheduler learns the keys from the new daemon, its ranks
    restore every shard from Redis through it, byte-exact."""
    sock = tmp_path / "run" / "host.sock"
    config = TieredConfig(cpu_bytes=1 << 20, host_tier_socket=str(sock), host_tier_redis=True,
                          redis_prefix=key_prefix)

    def daemon() -> HostTierDaemon:
        return HostTierDaemon(sock, f"halves-{uuid.uuid4().hex[:12]}", slots=256,
                              slot_bytes=8192, redis_url=redis_url, redis_prefix=key_prefix)

    with daemon().running() as first_daemon:
        first = Halves(config, tp_size=tp, presence=True)
        # no Redis connection of their own: the workers' Redis is the daemon's, and so is
        # the scheduler's summary
        assert all(isinstance(rank.worker.redis, HostTierRedisStore) and rank.worker.redis.available
                   for rank in first.ranks)
        assert first.sched.presence is not None
        assert isinstance(first.sched.presence.feed, DaemonFeed)
        _store(first)
        assert first.counter("redis_saves_via_daemon") == [3] * tp
        first_daemon.wait_for(lambda s: s["host_tier"]["redis_writes"] == 3 * tp,
                              what="the daemon writing every rank's shards behind")
        first.close()
    with daemon().running() as second_daemon:
        second_daemon.wait_for(lambda s: s["host_tier"]["presence_synced"] == 1,
                               what="the new daemon's walk of the key names")
        second = Halves(config, tp_size=tp, presence=True)
        try:
            # attached, the summary synced (on a loaded machine the welcome can come after
            # the engine's start-up wait: the engine then serves without it until it does)
            host = second.sched.host
            assert host is not None
            assert host.client.wait_until(lambda c: c.available and c.presence_synced, WAIT_S)
            assert all(r.worker.host is not None and r.worker.host.wait_until(
                lambda c: c.available and c.redis, WAIT_S) for r in second.ranks)
            req = Req("b", 100)
            assert second.lookup(req) == (96, True)  # probed through the daemon: in Redis
            second.admit(req, [[Blk(7), Blk(8), Blk(9), Blk(10)]], 96)
            result = second.step()
            assert result.finished == {"b"} and result.failed == set()
            for r1, r2 in zip(first.ranks, second.ranks, strict=True):
                assert torch.equal(r1.kv["attn0"][[1, 2, 3]], r2.kv["attn0"][[7, 8, 9]])
            snap = second.sched.counters.snapshot()
            assert snap["hit_tokens_redis"] == 96 and snap["hit_tokens_host"] == 0
            assert snap["presence_learned"] >= 3
            assert second_daemon.tier()["redis_restored"] == 3 * tp
            assert second.counter("bytes_fetched_redis") == [3 * second.ranks[0].worker
                                                             ._nbytes(0)] * tp
        finally:
            second.close()
