"""The host tier's Redis, held by the daemon: write-behind, restores and probes.

A real ``kvtier daemon --cpu-bytes N --redis-url URL`` process, real Redis (the machine's,
under a prefix of the test's own; a server of the test's own where it is killed), clients
in this process over the real Unix socket. What Redis holds is read back with a
``RedisTier`` of the test's, in the format every kvtier engine reads. Waits are on the
daemon's /stats or a client's state, never on time.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis as redis_py

from connector.vllm_connector.host_tier_redis import key_tuple
from offload_tiers.host_tier.client import HostTierClient, new_save_id
from offload_tiers.host_tier.protocol import Probe
from offload_tiers.keys import BlockKey, BlockKind
from offload_tiers.presence import name_digest, unpack_digests
from offload_tiers.redis.client import ClientFactory
from offload_tiers.redis.presence_feed import PresenceFeed, announce_stream
from offload_tiers.redis.tier import RedisTier
from offload_tiers.redis.url import parse_redis_url
from offload_tiers.shared_segment import digest
from rigs.daemon_proc import HostTierDaemon
from rigs.redis_server import RedisServer

SLOT = 4096
WAIT_S = 60  # bounds a hung wait only; nothing is ordered by it


def key(i: int, kind: BlockKind = BlockKind.FULL, tokens: int = 16) -> BlockKey:
    return BlockKey("f" * 32, 0, i.to_bytes(32, "big"), tokens, kind)


def payload(i: int, n: int = 3000) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def daemon(tmp_path: Path, redis_url: str, key_prefix: str) -> Iterator[HostTierDaemon]:
    with HostTierDaemon(tmp_path / "run" / "host.sock", f"test-{uuid.uuid4().hex[:12]}",
                        slots=8, slot_bytes=SLOT, redis_url=redis_url,
                        redis_prefix=key_prefix).running() as proc:
        yield proc


@pytest.fixture
def tier(redis_url: str, key_prefix: str) -> Iterator[RedisTier]:
    t = RedisTier.from_url(redis_url, prefix=key_prefix, strict=True)
    yield t
    t.close()


def client(daemon: HostTierDaemon, **kw: Any) -> HostTierClient:
    c = HostTierClient(str(daemon.sock), label="test", lease_batch=2, retry_s=0.05, **kw).start()
    assert c.wait_until(lambda c: c.available and (kw.get("subscribe") or len(c._pool) >= 1),
                        WAIT_S), c.last_error
    return c


def commit_one(c: HostTierClient, k: BlockKey, data: bytes, redis_save_id: int,
               announce: bool = True) -> bytes:
    """Write ``data`` into a leased slot and commit it, naming its Redis key."""
    d = digest(repr(k).encode())
    lease = c.take_slots(1)
    slot = lease.slots[0]
    save_id = new_save_id()
    assert lease.segment is not None
    lease.segment.write(slot, d, save_id, data)
    c.commit(lease, [(d, slot, save_id, len(data))], [(key_tuple(k), redis_save_id, announce)])
    return d


def test_a_commit_naming_a_key_is_written_behind_and_announced(
        daemon: HostTierDaemon, tier: RedisTier, redis_url: str, key_prefix: str) -> None:
    """In the Redis tier's format (read back by a RedisTier, save id kept); rank 0's shard
    announced on the presence stream, as an engine announces its own writes, another
    rank's not."""
    c = client(daemon)
    try:
        assert c.redis is True
        data = payload(1)
        commit_one(c, key(1), data, redis_save_id=777)
        commit_one(c, key(3), payload(3), redis_save_id=778, announce=False)
        stats = daemon.wait_for(lambda s: s["host_tier"]["redis_writes"] >= 2
                                and s["host_tier"]["redis_announced"] >= 1,
                                what="the daemon's write-behind and announcement")["host_tier"]
        assert stats["redis_write_failures"] == stats["redis_writes_skipped"] == 0
        assert stats["redis_announced"] == 1
        assert tier.save_ids_many([key(1), key(3)]) == [777, 778]
        assert bytes(tier.get(key(1)) or b"") == data
        stream = redis_py.Redis.from_url(redis_url).xrange(announce_stream(key_prefix))
        announced = {int(d) for _, fields in stream for d in unpack_digests(fields[b"d"])}
        assert announced == {name_digest(key(1).name.encode())}
    finally:
        c.close()


def test_two_engines_committing_one_key_write_it_to_redis_once(
        daemon: HostTierDaemon, tier: RedisTier) -> None:
    a, b = client(daemon), client(daemon)
    try:
        data = payload(2)
        commit_one(a, key(2), data, redis_save_id=5)
        daemon.wait_for(lambda s: s["host_tier"]["redis_writes"] >= 1, what="a's write")
        commit_one(b, key(2), data, redis_save_id=6)
        stats = daemon.wait_for(lambda s: s["host_tier"]["duplicates_dropped"] >= 1,
                                what="b's duplicate commit")["host_tier"]
        assert stats["redis_writes_queued"] == stats["redis_writes"] == 1
        assert tier.save_ids_many([key(2)]) == [5]  # a's save, not overwritten by b's
    finally:
        a.close()
        b.close()


def test_a_restore_reads_redis_into_a_slot_every_client_then_sees(
        daemon: HostTierDaemon, tier: RedisTier) -> None:
    data = [payload(10 + i) for i in range(3)]
    assert tier.put_many([(key(10 + i), d) for i, d in enumerate(data)],
                         save_ids=[100, 101, 102]) == 3
    c = client(daemon)
    watcher = client(daemon, subscribe=True)
    try:
        assert c.probe([key_tuple(key(10)), key_tuple(key(99))], WAIT_S) == [100, 0]
        digests = [digest(b"r%d" % i) for i in range(4)]
        items = [(digests[i], key_tuple(key(10 + i)), 100 + i, len(data[i])) for i in range(3)]
        items.append((digests[3], key_tuple(key(99)), 1, 3000))  # not in Redis
        where = c.restore(items, WAIT_S)
        assert where is not None and where[3] is None
        assert c.segment is not None
        for i in range(3):
            w = where[i]
            assert w is not None and w.length == len(data[i])
            out = bytearray(w.length)
            assert c.segment.read_into(w.slot, digests[i], w.save_id, out)
            assert bytes(out) == data[i]
        # the reply came after the mirror update: a subscriber has every entry
        assert watcher.wait_until(lambda w: all(d in w.mirror for d in digests[:3]), WAIT_S)
        assert digests[3] not in watcher.mirror
        again = c.restore(items[:1], WAIT_S)
        assert again == where[:1]
        tier_stats = daemon.tier()
        assert tier_stats["redis_restored"] == 3
        assert tier_stats["redis_restore_misses"] == 1
        assert tier_stats["redis_restores_already_held"] == 1
        assert tier_stats["entries"] == 3
    finally:
        c.close()
        watcher.close()


def test_a_restore_of_another_save_or_a_corrupt_value_is_a_miss(
        daemon: HostTierDaemon, tier: RedisTier, redis_url: str, key_prefix: str) -> None:
    assert tier.put_many([(key(20), payload(20))], save_ids=[200]) == 1
    raw = redis_py.Redis.from_url(redis_url)
    name = f"{key_prefix}:{key(21).name}".encode()
    raw.set(name, b"not a kvtier value at all" * 10)
    c = client(daemon)
    try:
        where = c.restore([(digest(b"x20"), key_tuple(key(20)), 201, 3000),  # another save
                           (digest(b"x21"), key_tuple(key(21)), 1, 250)], WAIT_S)
        assert where == [None, None]
        stats = daemon.tier()
        assert stats["entries"] == 0 and stats["redis_restore_misses"] == 2
        # the slots the daemon leased for them went back: none lost, none served
        assert stats["free_slots"] + stats["leased_slots"] == stats["num_slots"]
    finally:
        c.close()


def test_a_bad_key_closes_that_connection_only(daemon: HostTierDaemon) -> None:
    good = client(daemon)
    bad = client(daemon)
    try:
        placeholder = ("f" * 32, 0, b"\1" * 32, 16, int(BlockKind.PLACEHOLDER))
        bad._send(Probe(1, [placeholder]))
        daemon.wait_for(lambda s: s["host_tier"]["protocol_errors"] == 1,
                        what="the daemon refusing the bad key")
        assert good.probe([key_tuple(key(30))], WAIT_S) == [0]
    finally:
        good.close()
        bad.close()


def test_without_redis_the_daemon_offers_none(tmp_path: Path) -> None:
    with HostTierDaemon(tmp_path / "run" / "host.sock", f"test-{uuid.uuid4().hex[:12]}",
                        slot_bytes=SLOT).running() as proc:
        c = client(proc)
        assert c.redis is False
        assert c.probe([key_tuple(key(1))], WAIT_S) is None
        assert c.restore([(digest(b"a"), key_tuple(key(1)), 1, 10)], WAIT_S) is None
        assert proc.tier()["redis"] is False
        c.close()


def test_redis_gone_restores_miss_writes_fail_and_the_host_tier_serves_on(
        tmp_path: Path, redis_server: RedisServer) -> None:
    prefix = f"kvtier-test-{uuid.uuid4().hex[:12]}"
    with HostTierDaemon(tmp_path / "run" / "host.sock", f"test-{uuid.uuid4().hex[:12]}",
                        slot_bytes=SLOT, redis_url=redis_server.url,
                        redis_prefix=prefix).running() as proc:
        c = client(proc)
        redis_server.stop()
        d = commit_one(c, key(40), payload(40), redis_save_id=1)
        proc.wait_for(lambda s: s["host_tier"]["redis_write_failures"] >= 1,
                      what="the write-behind failing with Redis gone", timeout=WAIT_S)
        assert c.restore([(digest(b"y"), key_tuple(key(41)), 1, 3000)], WAIT_S) == [None]
        assert c.probe([key_tuple(key(41))], WAIT_S) == [0]
        tier = proc.tier()
        assert tier["entries"] == 1 and tier["commits"] == 1  # the host tier kept its save
        watcher = client(proc, subscribe=True)
        where = watcher.mirror[d]
        out = bytearray(where.length)
        assert watcher.read_into(d, where, out) and bytes(out) == payload(40)
        watcher.close()
        c.close()


def test_what_redis_missed_while_gone_is_backfilled_once_it_answers(
        tmp_path: Path, redis_server: RedisServer) -> None:
    """Writes behind that failed while Redis was gone are written from their slots once it
    answers again, each once, with the engine's save id, and announced as first writes are
    (rank 0's shard only)."""
    prefix = f"kvtier-test-{uuid.uuid4().hex[:12]}"
    with HostTierDaemon(tmp_path / "run" / "host.sock", f"test-{uuid.uuid4().hex[:12]}",
                        slots=8, slot_bytes=SLOT, redis_url=redis_server.url,
                        redis_prefix=prefix).running() as proc:
        c = client(proc)
        try:
            redis_server.stop()
            for i in (50, 51, 52):
                assert c.wait_until(lambda c: len(c._pool) >= 1, WAIT_S), "no slot leased"
                commit_one(c, key(i), payload(i), redis_save_id=i, announce=i != 52)
            proc.wait_for(lambda s: s["host_tier"]["redis_write_failures"] >= 3,
                          what="the write-behind failing with Redis gone", timeout=WAIT_S)
            assert proc.tier()["redis_backfills"] == 0  # nothing is tried while it is gone
            redis_server.start()
            stats = proc.wait_for(lambda s: s["host_tier"]["redis_backfilled"] >= 3,
                                  what="the backfill", timeout=WAIT_S)["host_tier"]
            assert stats["redis_backfills"] == 3 and stats["redis_backfill_failures"] == 0
            assert stats["redis_backfill_skipped"] == stats["redis_backfill_dropped"] == 0
            assert stats["redis_writes"] == 0  # backfills are counted apart
            tier = RedisTier.from_url(redis_server.url, prefix=prefix, strict=True)
            try:
                assert tier.save_ids_many([key(50), key(51), key(52)]) == [50, 51, 52]
                assert [bytes(tier.get(key(i)) or b"") for i in (50, 51, 52)] \
                    == [payload(i) for i in (50, 51, 52)]
            finally:
                tier.close()
            proc.wait_for(lambda s: s["host_tier"]["redis_announced"] >= 2,
                          what="the announcements", timeout=WAIT_S)
            stream = redis_py.Redis.from_url(redis_server.url).xrange(announce_stream(prefix))
            announced = {int(d) for _, fields in stream for d in unpack_digests(fields[b"d"])}
            assert announced == {name_digest(key(i).name.encode()) for i in (50, 51)}
        finally:
            c.close()


def test_subscribers_get_the_daemons_presence_summary(
        daemon: HostTierDaemon, redis_url: str, key_prefix: str) -> None:
    """What the daemon learns Redis holds reaches its subscribers (engines' scheduler
    halves without Redis): a key another engine announces, a key the daemon writes behind
    itself (announced by it, read back from the stream); a later subscriber starts with
    both in its welcome."""
    first = client(daemon, subscribe=True, presence=True)
    plain = client(daemon, subscribe=True)  # a mirror only (an engine with its own Redis)
    writer = client(daemon)
    other = PresenceFeed(ClientFactory(parse_redis_url(redis_url), timeout_s=5.0), key_prefix,
                         learn=False).start()
    seen: set[int] = set()
    want = {name_digest(k.name.encode()) for k in (key(51), key(52))}

    def learned(c: HostTierClient) -> bool:
        seen.update(int(d) for d in c.take_presence())
        return c.presence_synced and want <= seen

    try:
        other.announce([key(51).name.encode()])
        commit_one(writer, key(52), payload(52), redis_save_id=9)
        assert first.wait_until(learned, WAIT_S)
        later = client(daemon, subscribe=True, presence=True)
        assert later.presence_synced
        assert want <= {int(d) for d in later.take_presence()}
        stats = daemon.tier()
        assert stats["presence_synced"] == 1 and stats["presence_window"] >= 2
        # the daemon pushes the feed only to subscribers that take it: nothing piles up
        assert len(plain.take_presence()) == 0 and not plain.presence_synced
        later.close()
    finally:
        other.close()
        first.close()
        plain.close()
        writer.close()


def test_a_daemon_started_on_a_full_prefix_walks_it_for_its_subscribers(
        tmp_path: Path, redis_url: str, key_prefix: str, tier: RedisTier) -> None:
    """Keys stored before the daemon started (no announcement read by it) are learned by
    its walk of the key names; its subscribers see the summary synced only after it."""
    assert tier.put_many([(key(60 + i), payload(60 + i)) for i in range(5)]) == 5
    with HostTierDaemon(tmp_path / "run" / "host.sock", f"test-{uuid.uuid4().hex[:12]}",
                        slot_bytes=SLOT, redis_url=redis_url,
                        redis_prefix=key_prefix).running() as proc:
        c = client(proc, subscribe=True, presence=True)
        seen: set[int] = set()
        want = {name_digest(key(60 + i).name.encode()) for i in range(5)}

        def walked(c: HostTierClient) -> bool:
            seen.update(int(d) for d in c.take_presence())
            return c.presence_synced and want <= seen

        assert c.wait_until(walked, WAIT_S)
        c.close()


def test_untaken_digests_are_bounded_by_the_window(tmp_path: Path) -> None:
    """A subscriber that does not take the feed for a while keeps at most its window of
    digests, the newest (a summary remembers no more); pure bookkeeping, no daemon."""
    c = HostTierClient(str(tmp_path / "none.sock"), subscribe=True, presence=True,
                       presence_window=10)
    for start in range(0, 40, 4):
        c._learn(np.arange(start, start + 4, dtype="<u8"))
    kept = c.take_presence()
    assert 10 <= len(kept) < 14 and kept[-1] == 39
    assert list(kept) == list(range(40 - len(kept), 40))
    assert len(c.take_presence()) == 0


def test_a_daemon_stopped_by_sigterm_leaves_every_write_behind_on_a_cluster(
        tmp_path: Path) -> None:
    """Issue 44: engines commit 8 saves naming Redis keys to a daemon whose Redis is a
    3-master Cluster; the daemon is stopped by SIGTERM as soon as the commits are
    answered: it exits 0 and every save is in the Cluster, in the Redis tier's format."""
    from tests.support.redis_cluster import RedisClusterProcs

    cluster = RedisClusterProcs(tmp_path / "cluster").start()
    prefix = f"kvtier-test-{uuid.uuid4().hex[:12]}"
    proc = HostTierDaemon(tmp_path / "run" / "host.sock", f"test-{uuid.uuid4().hex[:12]}",
                          slots=16, slot_bytes=SLOT, redis_url=cluster.url,
                          redis_prefix=prefix).start()
    try:
        c = client(proc)
        try:
            for i in range(8):
                assert c.wait_until(lambda c: len(c._pool) >= 1, WAIT_S)
                commit_one(c, key(i), payload(i), redis_save_id=1000 + i)
            assert c.wait_until(lambda c: c.counters.commits_kept == 8, WAIT_S)
        finally:
            c.close()
        assert proc.terminate() == 0
        with RedisTier.from_url(cluster.url, prefix=prefix, strict=True) as tier:
            assert tier.save_ids_many([key(i) for i in range(8)]) == [1000 + i for i in range(8)]
            assert [bytes(v or b"") for v in tier.get_many([key(i) for i in range(8)])] == \
                [payload(i) for i in range(8)]
    finally:
        proc.kill()
        proc.remove_files()
        cluster.stop()
