"""The presence feed on a real Redis: what one process stores, another running feed learns
(stream); what Redis holds when a feed starts, it learns by walking the key names. Foreign
entries, outages, ACL refusals and oversized prefixes never break it, and it is never
"synced" while it may have missed names. Its queues are bounded: announcements while Redis
does not answer or after the feed turned itself off, learned digests nobody takes."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from offload_tiers.presence import name_digest, pack_digests, unpack_digests
from offload_tiers.redis.client import ClientFactory
from offload_tiers.redis.janitor import RedisJanitor
from offload_tiers.redis.presence_feed import PresenceFeed, announce_stream
from offload_tiers.redis.tier import RedisTier
from offload_tiers.redis.url import parse_redis_url
from rigs.redis_server import RedisServer
from rigs.tcp_proxy import TcpProxy
from tests.tiers.faults import wait_until
from tests.tiers.helpers import key, payload

SECRET = "f33d-s3cret"


def _feed(url: str, prefix: str, *, start: bool = True, **kw: object) -> PresenceFeed:
    factory = ClientFactory(parse_redis_url(url), timeout_s=5.0)
    feed = PresenceFeed(factory, prefix, backoff_initial_s=0.05, backoff_max_s=0.2,
                        **kw)  # type: ignore[arg-type]
    return feed.start() if start else feed


@pytest.fixture
def feeds() -> Iterator[list[PresenceFeed]]:
    made: list[PresenceFeed] = []
    yield made
    for f in made:
        f.close()


class Learned:
    """Everything a feed handed over so far."""

    def __init__(self, feed: PresenceFeed) -> None:
        self.feed = feed
        self.digests: set[int] = set()

    def has(self, digests: set[int]) -> bool:
        self.digests.update(self.feed.take())
        return digests <= self.digests


def test_a_second_feed_learns_what_the_first_stored_and_what_redis_held(
        redis_url: str, key_prefix: str, feeds: list[PresenceFeed]) -> None:
    with RedisTier.from_url(redis_url, prefix=key_prefix, strict=True) as tier:
        old = [key(i) for i in range(30)]
        assert tier.put_many([(k, payload(k)) for k in old]) == 30
    a = _feed(redis_url, key_prefix)
    feeds.append(a)
    assert wait_until(lambda: a.synced)
    learned_a = Learned(a)
    assert learned_a.has({name_digest(k.name.encode()) for k in old})  # the walk
    assert a.stats()["learned_scan"] == 30  # the stream key is not a block's name

    b = _feed(redis_url, key_prefix)
    feeds.append(b)
    assert wait_until(lambda: b.synced)
    learned_b = Learned(b)
    assert learned_b.has({name_digest(k.name.encode()) for k in old})
    new = [key(i, hash_salt="new").name.encode() for i in range(700)]  # two XADD batches
    a.announce(new)
    assert wait_until(lambda: learned_b.has({name_digest(n) for n in new}))
    assert a.stats()["announced"] == 700
    assert b.synced and b.stats()["bad_entries"] == 0


def test_a_feed_that_skips_its_own_announcements_still_learns_the_others(
        redis_url: str, key_prefix: str, feeds: list[PresenceFeed]) -> None:
    mine = _feed(redis_url, key_prefix, skip_own=True)
    other = _feed(redis_url, key_prefix)
    feeds += [mine, other]
    assert wait_until(lambda: mine.synced and other.synced)
    own = [key(i, hash_salt="own").name.encode() for i in range(600)]  # two XADD batches
    theirs = [key(i, hash_salt="theirs").name.encode() for i in range(5)]
    mine.announce(own)
    assert wait_until(lambda: mine.stats()["announced"] == 600)
    other.announce(theirs)
    learned = Learned(mine)
    assert wait_until(lambda: learned.has({name_digest(n) for n in theirs}))
    # the other feed's entry comes after both of this one's: both were read and skipped
    assert mine.stats()["own_skipped"] == 2
    assert not learned.digests & {name_digest(n) for n in own}
    assert Learned(other).has({name_digest(n) for n in own + theirs})


def test_foreign_stream_entries_are_skipped_and_counted(
        redis_url: str, key_prefix: str, feeds: list[PresenceFeed]) -> None:
    raw = redis.Redis.from_url(redis_url)
    stream = announce_stream(key_prefix)
    a = _feed(redis_url, key_prefix)
    feeds.append(a)
    assert wait_until(lambda: a.synced)
    raw.xadd(stream, {b"d": b"\x01\x02\x03"})  # not a whole digest
    raw.xadd(stream, {b"other": b"12345678"})  # no digest field
    good = name_digest(b"after-the-bad-ones")
    raw.xadd(stream, {b"d": pack_digests([good])})
    learned = Learned(a)
    assert wait_until(lambda: learned.has({good}))
    assert a.stats()["bad_entries"] == 2 and a.synced


def test_an_outage_unsyncs_the_feed_until_it_walked_again(
        redis_server: RedisServer, key_prefix: str, feeds: list[PresenceFeed]) -> None:
    proxy = TcpProxy("127.0.0.1", redis_server.port).start()
    try:
        a = _feed(f"redis://127.0.0.1:{proxy.port}/0", key_prefix)
        feeds.append(a)
        assert wait_until(lambda: a.synced)
        proxy.hold()  # refuse new connections
        proxy.reset_all()
        assert wait_until(lambda: not a.synced and a.stats()["failures"] >= 1)
        # stored while the feed could not read: only a new walk can know it
        with RedisTier.from_url(redis_server.url, prefix=key_prefix, strict=True) as tier:
            k = key(7, hash_salt="during")
            assert tier.put_many([(k, payload(k))]) == 1
        assert not a.synced
        proxy.release()
        learned = Learned(a)
        assert wait_until(lambda: a.synced and learned.has({name_digest(k.name.encode())}))
        assert a.stats()["walks"] == 2
    finally:
        proxy.stop()


def test_acl_refusing_the_stream_turns_the_feed_off_with_a_clear_secret_free_warning(
        tmp_path: Path, key_prefix: str, feeds: list[PresenceFeed],
        caplog: pytest.LogCaptureFixture) -> None:
    server = RedisServer(tmp_path / "acl", password=SECRET).start()
    try:
        server.client().execute_command("ACL", "SETUSER", "nostream", "on", f">{SECRET}",
                                        f"~{key_prefix}:*", "+@all", "-@stream")
        url = f"redis://nostream:{quote(SECRET, safe='')}@127.0.0.1:{server.port}/0"
        with caplog.at_level(logging.WARNING):
            a = _feed(url, key_prefix)
            feeds.append(a)
            assert wait_until(lambda: bool(a.disabled))
        assert not a.synced and "XADD" in a.disabled
        text = caplog.text + a.disabled
        assert "presence feed off" in caplog.text and SECRET not in text
        assert sum("presence feed off" in r.getMessage() for r in caplog.records) == 1
    finally:
        server.stop()


def test_more_names_than_the_summary_holds_turns_the_feed_off(
        redis_url: str, key_prefix: str, feeds: list[PresenceFeed]) -> None:
    with RedisTier.from_url(redis_url, prefix=key_prefix, strict=True) as tier:
        assert tier.put_many([(key(i), payload(key(i), 32)) for i in range(40)]) == 40
    a = _feed(redis_url, key_prefix, max_keys=25)
    feeds.append(a)
    assert wait_until(lambda: bool(a.disabled))
    assert not a.synced and "more than 25" in a.disabled


def test_the_janitor_leaves_the_announcement_stream_alone(
        redis_url: str, key_prefix: str, feeds: list[PresenceFeed]) -> None:
    a = _feed(redis_url, key_prefix)
    feeds.append(a)
    a.announce([b"x"])
    raw = redis.Redis.from_url(redis_url)
    stream = announce_stream(key_prefix)
    assert wait_until(lambda: raw.exists(stream) == 1)
    raw.set(f"{key_prefix}:not-a-block".encode(), b"junk")
    janitor = RedisJanitor(redis_url, prefix=key_prefix)
    try:
        janitor.run_pass()
    finally:
        janitor.stop()
    assert raw.exists(stream) == 1 and raw.type(stream) == b"stream"
    assert raw.exists(f"{key_prefix}:not-a-block".encode()) == 0  # it still judges the rest


def _nostream_url(server: RedisServer, prefix: str) -> str:
    """A user of ``server`` that may touch ``prefix``'s keys but run no stream command."""
    server.client().execute_command("ACL", "SETUSER", "nostream", "on", f">{SECRET}",
                                    f"~{prefix}:*", "+@all", "-@stream")
    return f"redis://nostream:{quote(SECRET, safe='')}@127.0.0.1:{server.port}/0"


BOUND = 64  # the announce / learned queue's bound in the tests below


def test_a_feed_turned_off_drops_its_queued_announcements_and_every_later_one(
        tmp_path: Path, key_prefix: str, feeds: list[PresenceFeed]) -> None:
    """10 x the bound announced before the feed's thread ran (bounded, the oldest dropped);
    the ACL turns it off: the queue is emptied, and later announcements are dropped as they
    come; every drop counted."""
    server = RedisServer(tmp_path / "acl", password=SECRET).start()
    try:
        a = _feed(_nostream_url(server, key_prefix), key_prefix, start=False,
                  announce_max=BOUND)
        feeds.append(a)
        names = [key(i, hash_salt="off").name.encode() for i in range(10 * BOUND)]
        for i in range(0, len(names), BOUND // 2):  # a step's stores at a time
            a.announce(names[i:i + BOUND // 2])
            assert a.stats()["announce_queue"] <= BOUND
        st = a.stats()
        assert st["announce_queue"] == BOUND and st["announce_dropped"] == 9 * BOUND
        a.start()
        assert wait_until(lambda: bool(a.disabled))  # set with the queue emptied, one lock
        st = a.stats()
        assert st["announce_queue"] == 0 and st["announce_dropped"] == 10 * BOUND
        a.announce(names)  # the feed is off: dropped at once
        a.announce_digests([name_digest(n) for n in names])
        st = a.stats()
        assert st["announce_queue"] == 0 and st["announce_dropped"] == 30 * BOUND
        assert st["announced"] == 0 and a.drop_counts() == (30 * BOUND, 0)
    finally:
        server.stop()


def test_announcements_while_redis_does_not_answer_keep_the_newest_bound(
        redis_server: RedisServer, key_prefix: str, feeds: list[PresenceFeed]) -> None:
    """Redis unreachable: 10 x the bound announced; the queue holds the newest ``BOUND``
    (the oldest dropped, counted), and those reach the stream once Redis answers."""
    proxy = TcpProxy("127.0.0.1", redis_server.port).start()
    try:
        a = _feed(f"redis://127.0.0.1:{proxy.port}/0", key_prefix, announce_max=BOUND)
        feeds.append(a)
        assert wait_until(lambda: a.synced)
        proxy.hold()  # refuse new connections
        proxy.reset_all()
        assert wait_until(lambda: not a.synced and a.stats()["failures"] >= 1)
        names = [key(i, hash_salt="down").name.encode() for i in range(10 * BOUND)]
        for i in range(0, len(names), BOUND // 2):
            a.announce(names[i:i + BOUND // 2])
            assert a.stats()["announce_queue"] <= BOUND
        st = a.stats()
        assert st["announce_queue"] == BOUND and st["announce_dropped"] == 9 * BOUND
        proxy.release()
        assert wait_until(lambda: a.stats()["announced"] == BOUND)
        assert a.stats()["announce_queue"] == 0 and not a.disabled
        raw = redis.Redis.from_url(redis_server.url)
        sent = [d for _, fields in raw.xrange(announce_stream(key_prefix))
                for d in unpack_digests(fields[b"d"]).tolist()]
        assert sent == [name_digest(n) for n in names[-BOUND:]]
    finally:
        proxy.stop()


def test_an_idle_consumer_keeps_the_newest_learned_digests_up_to_the_bound(
        redis_url: str, key_prefix: str, feeds: list[PresenceFeed]) -> None:
    """Nobody takes what the feed learns (an idle engine): 10 x the bound arrive on the
    stream from another client; the queue never holds more than ``BOUND``, keeps the
    newest, and counts the rest dropped."""
    a = _feed(redis_url, key_prefix, learned_max=BOUND)
    feeds.append(a)
    assert wait_until(lambda: a.synced)
    raw = redis.Redis.from_url(redis_url)
    stream = announce_stream(key_prefix)
    sent = [name_digest(f"idle-{i}".encode()) for i in range(10 * BOUND)]
    for i in range(0, len(sent), BOUND // 4):
        raw.xadd(stream, {b"d": pack_digests(sent[i:i + BOUND // 4])})
    peak = 0

    def read_all() -> bool:
        nonlocal peak
        st = a.stats()
        peak = max(peak, st["learned_queue"])
        return bool(st["learned_stream"] == len(sent))

    assert wait_until(read_all)
    st = a.stats()
    assert peak <= BOUND and st["learned_queue"] == BOUND
    assert st["learned_dropped"] == 9 * BOUND and st["bad_entries"] == 0
    assert a.take() == sent[-BOUND:]
    assert a.stats()["learned_queue"] == 0 and a.drop_counts() == (0, 9 * BOUND)
