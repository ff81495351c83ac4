"""The scheduler half with a presence summary: a miss nobody announced is answered at once,
only keys that may be in Redis are probed, and without a trustworthy summary every miss is
probed as before. The feed is a hand-fed stand-in (pure logic); tests/connector/
test_presence_halves.py runs the real feed on Redis."""

from __future__ import annotations

from typing import Any

from connector.vllm_connector.config import TieredConfig
from connector.vllm_connector.namespace import rank_fingerprint
from connector.vllm_connector.plan import WorkerReport
from connector.vllm_connector.presence import RedisPresence
from connector.vllm_connector.scheduler import ATTENTION, GroupSpec, TieredScheduler
from offload_tiers.keys import BlockKey
from offload_tiers.presence import name_digest
from rigs.sched_doubles import Req

UNIT = 32
FP = "ab" * 16
LAYOUT = "cpu|g0:attention:32:float32[2x32x8]@0"
DEAD_REDIS = "redis://127.0.0.1:1/0"  # never contacted: the feed is a stand-in
LLAMA = [GroupSpec(0, ATTENTION, UNIT)]


class HandFedFeed:
    """What the scheduler reads of a PresenceFeed, fed by the test."""

    def __init__(self) -> None:
        self.synced = True
        self.learned: list[int] = []
        self.announced: list[int] = []
        self.drops = (0, 0)  # (announce_dropped, learned_dropped), as the feed counts them
        self.closed = False

    def take(self) -> list[int]:
        out, self.learned = self.learned, []
        return out

    def announce_digests(self, digests: list[int]) -> None:
        self.announced.extend(digests)

    def drop_counts(self) -> tuple[int, int]:
        return self.drops

    def close(self) -> None:
        self.closed = True


def _sched(world_size: int = 1, **cfg: Any) -> tuple[TieredScheduler, HandFedFeed]:
    feed = HandFedFeed()

    def presence(config: TieredConfig, ws: int, counters: Any) -> RedisPresence:
        return RedisPresence(config, ws, counters, feed)

    s = TieredScheduler(TieredConfig(redis_url=DEAD_REDIS, **cfg), LLAMA, UNIT, 64, 16,
                        world_size, lambda tenant: FP, lambda rid: [], lambda bid: None,
                        presence=presence)
    return s, feed


def _stored_name_digest(key: BlockKey, world_size: int = 1) -> int:
    """The digest of the name TP rank 0 stores ``key`` under (what the feed learns)."""
    fp = rank_fingerprint(key.fingerprint, 0, world_size, LAYOUT)
    return name_digest(f"{fp}:{key.group}:{key.block_hash.hex()}".encode())


def _ready(s: TieredScheduler) -> None:
    s.on_report(WorkerReport(rank0_layout=LAYOUT, redis_up={0: 1}))


def _counters(s: TieredScheduler) -> dict[str, int]:
    return s.counters.snapshot()


def test_a_miss_nobody_announced_is_answered_in_the_step_it_arrives() -> None:
    s, _ = _sched()
    _ready(s)
    assert s.lookup(Req("new", 130), 0) == (0, False)  # not None: no "ask again"
    plan = s.plan({}, {}, set())
    assert plan.probes == [] and plan.layout_known
    c = _counters(s)
    assert c["presence_known_absent"] == 1 and c.get("probe_waits", 0) == 0
    assert c["presence_keys_skipped"] == 1  # the first block's key: nothing past it is read


def test_a_miss_reads_the_keys_of_its_first_block_only() -> None:
    """No hit reaches past a FULL block that is in no tier, so a miss asks the CPU tier and
    the summary about its first block alone, whatever the prompt's length."""
    s, _ = _sched()
    _ready(s)
    asked: list[int] = []
    contains_many = s.directory.contains_many
    s.directory.contains_many = lambda keys: (  # type: ignore[method-assign]
        asked.extend(k.num_tokens for k in keys) or contains_many(keys))
    assert s.lookup(Req("long", 32 * 40 + 5), 0) == (0, False)
    assert asked == [32]
    assert _counters(s)["presence_keys_skipped"] == 1


def test_only_announced_keys_up_to_the_first_unannounced_block_are_probed() -> None:
    s, feed = _sched(world_size=2)
    s.on_report(WorkerReport(rank0_layout=LAYOUT, redis_up={0: 1}))
    req = Req("r", 130)
    keys = [s.key(req, FP, LLAMA[0], n) for n in (32, 64, 96, 128)]
    # another engine announced the 32, 96 and 128 blocks, not the 64 one: no hit can pass 64
    feed.learned = [_stored_name_digest(keys[i], 2) for i in (0, 2, 3)]
    assert s.lookup(req, 0) == (None, False)
    probe = s.plan({}, {}, set()).probes[0]
    assert [k.num_tokens for k in probe.keys] == [32]
    s.on_report(WorkerReport(probes={probe.job: ([5], 2)}))
    assert s.lookup(req, 0) == (32, True)
    assert _counters(s)["probe_waits"] == 1


def test_before_rank_0s_layout_is_known_only_an_empty_summary_answers() -> None:
    s, feed = _sched()
    assert s.lookup(Req("first", 100), 0) == (0, False)  # nothing learned: nothing stored
    feed.learned = [12345]  # some key exists under the prefix: its name is unreadable yet
    assert s.lookup(Req("r", 100), 0) == (None, False)
    assert [k.num_tokens for k in s.plan({}, {}, set()).probes[0].keys] == [32, 64, 96]


def test_without_a_trustworthy_summary_every_miss_is_probed() -> None:
    s2, feed2 = _sched()
    _ready(s2)
    feed2.synced = False  # walking the key names, or after a Redis failure
    assert s2.lookup(Req("r", 100), 0) == (None, False)
    assert len(s2.plan({}, {}, set()).probes[0].keys) == 3
    assert _counters(s2)["presence_not_ready"] == 1
    off = TieredScheduler(TieredConfig(redis_url=DEAD_REDIS, presence=False), LLAMA, UNIT, 64,
                          16, 1, lambda tenant: FP, lambda rid: [], lambda bid: None,
                          presence=RedisPresence.from_config)
    assert off.presence is None  # presence: false — no feed thread, every miss probed


def test_own_saves_are_announced_and_probe_answers_remembered() -> None:
    s, feed = _sched()
    _ready(s)
    req = Req("r", 100)
    key = s.key(req, FP, LLAMA[0], 32)
    s.presence.stored(key)
    assert feed.announced == []  # batched: announced with the step's other stores
    assert s.presence.refresh()
    assert feed.announced == [_stored_name_digest(key)]
    assert s.presence.may_hold([key]) == [True]
    other = s.key(req, FP, LLAMA[0], 64)
    assert s.presence.may_hold([other]) == [False]
    s.presence.confirmed(other)
    assert s.presence.may_hold([other]) == [True]
    s.close()
    assert feed.closed


def test_redis_reported_down_skips_redis_whatever_the_summary_says() -> None:
    s, feed = _sched()
    s.on_report(WorkerReport(rank0_layout=LAYOUT, redis_up={0: 0}))
    req = Req("r", 100)
    feed.learned = [_stored_name_digest(s.key(req, FP, LLAMA[0], 32))]
    assert s.lookup(req, 0) == (0, False)
    assert s.plan({}, {}, set()).probes == []
    assert _counters(s)["redis_lookup_skips"] == 1
