"""The presence summary's feed holds bounded memory, and what it drops reaches the
connector's counters: an idle engine (no step takes what the feed learns) keeps at most the
summary's capacity of learned digests, the newest; an engine whose feed turned itself off
(an ACL user without stream commands) drops its stores' announcements as they come. Real
Redis, real feed thread; the counters are the connector's own (``presence_*_dropped``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from connector.vllm_connector.config import TieredConfig
from connector.vllm_connector.presence import DaemonFeed, RedisPresence
from connector.vllm_connector.stats import ConnectorCounters
from offload_tiers.presence import name_digest, pack_digests
from offload_tiers.redis.presence_feed import announce_stream
from rigs.redis_server import RedisServer
from tests.tiers.faults import wait_until
from tests.tiers.helpers import key

CAPACITY = 1024  # the smallest presence_capacity: the learned queue's bound
LAYOUT = "cpu|g0:attention:32:float32[2x32x8]@0"
SECRET = "pr3sence-m3mory"


@pytest.fixture
def summaries() -> Iterator[list[RedisPresence]]:
    made: list[RedisPresence] = []
    yield made
    for p in made:
        p.close()


def _summary(url: str, prefix: str, made: list[RedisPresence]) -> RedisPresence:
    config = TieredConfig(redis_url=url, redis_prefix=prefix, presence_capacity=CAPACITY)
    presence = RedisPresence.from_config(config, 1, ConnectorCounters())
    assert presence is not None
    made.append(presence)
    return presence


def test_an_idle_engine_keeps_the_newest_learned_digests_up_to_the_summarys_capacity(
        redis_url: str, key_prefix: str, summaries: list[RedisPresence]) -> None:
    presence = _summary(redis_url, key_prefix, summaries)
    feed = presence.feed
    assert feed.learned_max == CAPACITY
    assert wait_until(lambda: feed.synced)
    raw = redis.Redis.from_url(redis_url)
    sent = [name_digest(f"idle-engine-{i}".encode()) for i in range(10 * CAPACITY)]
    for i in range(0, len(sent), 512):  # another engine's announcements, no step between
        raw.xadd(announce_stream(key_prefix), {b"d": pack_digests(sent[i:i + 512])})
    peak = 0

    def read_all() -> bool:
        nonlocal peak
        st = feed.stats()
        peak = max(peak, st["learned_queue"])
        return bool(st["learned_stream"] == len(sent))

    assert wait_until(read_all)
    assert peak <= CAPACITY and feed.stats()["learned_queue"] == CAPACITY
    assert presence.refresh()  # the engine's next step
    c = presence.counters.snapshot()
    assert c["presence_learned"] == CAPACITY
    assert c["presence_learned_dropped"] == 9 * CAPACITY
    assert c["presence_announce_dropped"] == 0
    assert all(presence.filter.may_contain(d) for d in sent[-CAPACITY:])
    presence.refresh()  # nothing new: counted once
    assert presence.counters.snapshot()["presence_learned_dropped"] == 9 * CAPACITY


def test_an_engine_whose_feed_is_off_drops_its_announcements_and_counts_them(
        tmp_path: Path, key_prefix: str, summaries: list[RedisPresence]) -> None:
    server = RedisServer(tmp_path / "acl", password=SECRET).start()
    try:
        server.client().execute_command("ACL", "SETUSER", "nostream", "on", f">{SECRET}",
                                        f"~{key_prefix}:*", "+@all", "-@stream")
        url = f"redis://nostream:{quote(SECRET, safe='')}@127.0.0.1:{server.port}/0"
        presence = _summary(url, key_prefix, summaries)
        assert wait_until(lambda: bool(presence.feed.disabled))
        presence.set_layout(LAYOUT)
        for i in range(5):
            presence.stored(key(i, hash_salt="off"))
        assert not presence.refresh()
        st = presence.feed.stats()
        assert st["announce_queue"] == 0 and st["announce_dropped"] == 5
        c = presence.counters.snapshot()
        assert c["presence_announce_dropped"] == 5 and c["presence_learned_dropped"] == 0
        # the engine's own stores still reach its own summary
        assert all(presence.may_hold_key(key(i, hash_salt="off")) for i in range(5))
    finally:
        server.stop()


class _Feed:
    """A feed whose drop counts the test sets."""

    synced = True
    drops = (0, 0)

    def take(self) -> list[int]:
        return []

    def announce_digests(self, digests: list[int]) -> None:
        pass

    def drop_counts(self) -> tuple[int, int]:
        return self.drops

    def close(self) -> None:
        pass


def test_the_feeds_drops_reach_the_counters_as_they_grow() -> None:
    feed = _Feed()
    presence = RedisPresence(TieredConfig(), 1, ConnectorCounters(), feed)
    presence.refresh()
    feed.drops = (3, 7)
    presence.refresh()
    feed.drops = (4, 7)
    presence.refresh()
    c = presence.counters.snapshot()
    assert c["presence_announce_dropped"] == 4 and c["presence_learned_dropped"] == 7
    assert DaemonFeed(object()).drop_counts() == (0, 0)  # the daemon counts its own
