"""The scheduler half's answer to "may Redis hold this key?", given without waiting.

A :class:`~offload_tiers.presence.PresenceFilter` of Redis key-name digests, fed by

* this engine's own saves (once every rank wrote its shard) and probe answers, and
* a :class:`~offload_tiers.redis.presence_feed.PresenceFeed` thread in this (engine-core)
  process: the key names under the prefix at start, then the announcements of every kvtier
  engine sharing the prefix, this one included.

The feed reads Redis on its own thread, not on the scheduler's path, and not through the
workers: worker reports travel only while the engine steps, so a summary fed by them would
be stale exactly when a request reaches an idle engine. An engine that reaches Redis only
through the host tier's daemon (``host_tier_redis``) gets the daemon's feed instead
(:class:`DaemonFeed`: pushed over the scheduler half's host-tier connection, read from its
mirror thread's buffer; the daemon announces what it writes behind).

A key's presence unit is its name under TP rank 0's fingerprint (the names every engine of
this namespace writes and scans), which depends on rank 0's tensor layout: the rank-0
worker sends it in its reports until a plan says it arrived. Until then (unless the feed
learned nothing at all: then every key is absent, whatever its name), and while the feed is
not synced (walking the key names, or after a Redis failure), every miss asks Redis.

The feed's queues are bounded (an idle engine takes nothing for as long as it idles): at
most ``presence_capacity`` learned digests wait for a step (the summary keeps no more
anyway), at most :data:`~offload_tiers.redis.presence_feed.ANNOUNCE_MAX` of this engine's
stores wait to be announced, the oldest dropped past either; a feed that turned itself off
drops announcements as they come. Drops are counted (``presence_learned_dropped``,
``presence_announce_dropped``): each costs a miss at worst, never a wrong block.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np

from connector.vllm_connector.bounded_cache import BoundedCache
from connector.vllm_connector.config import TieredConfig
from connector.vllm_connector.namespace import rank_fingerprint
from connector.vllm_connector.stats import ConnectorCounters
from offload_tiers.host_tier.client import HostTierClient
from offload_tiers.keys import BlockKey
from offload_tiers.presence import PresenceFilter, name_digest

#: Digests kept in a set until the filter takes them in, in one update of this many: a
#: look-up asks the set and the filter, and never waits for an array update.
_RECENT_MAX = 4096
#: A batch at least this large (the walk of key names, a busy announcement) goes into the
#: filter at once.
_DIRECT_MIN = 1024
#: Base fingerprints whose rank-0 fingerprints are kept.
_RANK0_CACHE_MAX = 4096
#: The feed's socket timeout floor: its blocking reads wait up to a tenth of a second, and a
#: timeout costs a walk of the key names, so it is generous (nothing waits on this thread).
_FEED_TIMEOUT_S = 5.0


#: Digests a feed hands over: a list, or an array (the daemon's, straight off its message).
Digests = Sequence[int] | np.ndarray


class PresenceSource(Protocol):
    """What feeds a summary: Redis's own feed
    (:class:`~offload_tiers.redis.presence_feed.PresenceFeed`) or the daemon's
    (:class:`DaemonFeed`)."""

    @property
    def synced(self) -> bool:
        """It has walked the key names and follows every announcement now."""
        ...

    def take(self) -> Digests:
        """Digests learned since the last call."""
        ...

    def announce_digests(self, digests: Iterable[int]) -> None:
        """Announce this engine's stores to the engines sharing the prefix."""
        ...

    def drop_counts(self) -> tuple[int, int]:
        """``(announce_dropped, learned_dropped)`` so far."""
        ...

    def stats(self) -> dict[str, Any]: ...

    def close(self, timeout: float = 5.0) -> None: ...


class RedisPresence:
    """Which keys Redis may hold, for one engine (all TP ranks)."""

    def __init__(self, config: TieredConfig, world_size: int, counters: ConnectorCounters,
                 feed: PresenceSource) -> None:
        self.filter = PresenceFilter(config.presence_capacity)
        self.feed = feed
        self.world_size = world_size
        self.counters = counters
        self.layout: str | None = None
        self._rank0: BoundedCache[str, str] = BoundedCache(_RANK0_CACHE_MAX)
        self._stored: list[int] = []  # this engine's stores since the last refresh
        self._recent: set[int] = set()  # digests not in the filter yet
        self._drops = (0, 0)  # the feed's (announce_dropped, learned_dropped) counted so far
        counters.set_gauge("presence_memory_bytes", self.filter.memory_bytes)

    @classmethod
    def from_config(cls, config: TieredConfig, world_size: int,
                    counters: ConnectorCounters) -> RedisPresence | None:
        """The summary with its feed thread started; None when Redis or the summary is off."""
        if not config.redis_url or not config.presence:
            return None
        from offload_tiers.redis.presence_feed import PresenceFeed

        factory = config.client_factory(min_timeout_s=_FEED_TIMEOUT_S)
        # learned digests wait for a step: no more than the summary keeps (its capacity)
        feed = PresenceFeed(factory, config.redis_prefix, max_keys=config.presence_capacity,
                            learned_max=config.presence_capacity,
                            scan_keys_per_s=config.presence_scan_keys_per_s,
                            skip_own=True)  # this engine's stores reach its filter directly
        return cls(config, world_size, counters, feed.start())

    @classmethod
    def from_daemon(cls, client: HostTierClient, config: TieredConfig, world_size: int,
                    counters: ConnectorCounters) -> RedisPresence | None:
        """The summary fed by the host tier's daemon (``host_tier_redis``); None when the
        summary is off."""
        if not config.presence:
            return None
        return cls(config, world_size, counters, DaemonFeed(client))

    def set_layout(self, layout: str) -> None:
        if layout != self.layout:
            self.layout = layout
            self._rank0.clear()

    def announce(self) -> None:
        """Tell the others what this engine stored since the last call (one announcement
        for all): after each worker report, so an engine idle after it tells them too."""
        if self._stored:
            self.feed.announce_digests(self._stored)
            self._learn(self._stored)
            self._stored = []

    def refresh(self) -> bool:
        """Every step: announce this engine's stores and collect what the feed learned; True
        when the feed is synced."""
        self.announce()
        synced = bool(self.feed.synced)  # read before draining: the walk's digests precede it
        learned = self.feed.take()  # a list, or an array (the daemon's feed)
        if len(learned):
            self._learn(learned)
            self.counters.add("presence_learned", len(learned))
        drops = self.feed.drop_counts()
        if drops != self._drops:
            (announce, learn), (announce_was, learn_was) = drops, self._drops
            self._drops = drops
            self.counters.add("presence_announce_dropped", announce - announce_was)
            self.counters.add("presence_learned_dropped", learn - learn_was)
        self.counters.set_gauge("presence_synced", int(synced))
        return synced

    def ready(self) -> bool:
        """True when an "absent" answer can be trusted (up to what is still in flight):
        the feed is synced and rank 0's layout known — or nothing at all was learned (an
        empty prefix holds no key whatever its names)."""
        synced = self.refresh()
        return synced and (self.layout is not None or not self._learned_any())

    def _learned_any(self) -> bool:
        return self.filter.added > 0 or bool(self._recent)

    def _digest(self, key: BlockKey) -> int:
        assert self.layout is not None
        fp = self._rank0.get(key.fingerprint)
        if fp is None:
            fp = rank_fingerprint(key.fingerprint, 0, self.world_size, self.layout)
            self._rank0.put(key.fingerprint, fp)
        return name_digest(f"{fp}:{key.group}:{key.block_hash.hex()}".encode())

    def may_hold(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key: False = no kvtier engine announced it (Redis is not asked)."""
        if self.layout is None:
            assert not self._learned_any(), "ask ready() first"
        return [self.may_hold_key(k) for k in keys]

    def may_hold_key(self, key: BlockKey) -> bool:
        """One key, asked after :meth:`ready`: False = no kvtier engine announced it."""
        if self.layout is None:
            return False  # ready(): nothing learned, so nothing stored
        digest = self._digest(key)
        return digest in self._recent or self.filter.may_contain(digest)

    def stored(self, key: BlockKey) -> None:
        """This engine stored ``key`` (every rank): remember it and tell the others (at the
        end of the report, :meth:`announce`)."""
        if self.layout is None:
            return  # not yet told rank 0's layout (it comes with the first worker report)
        self._stored.append(self._digest(key))

    def confirmed(self, key: BlockKey) -> None:
        """A probe found ``key`` in Redis."""
        if self.layout is not None:
            self._learn([self._digest(key)])

    def _learn(self, digests: Digests) -> None:
        """Remember ``digests``: a large batch goes into the filter now; a small one waits
        in the set until :data:`_RECENT_MAX` digests share one update (no array work per
        step or per look-up)."""
        if len(digests) >= _DIRECT_MIN:
            self.filter.add_many(np.asarray(digests, dtype=np.uint64))
            return
        self._recent.update(int(d) for d in digests)
        if len(self._recent) >= _RECENT_MAX:
            self.filter.add_many(np.fromiter(self._recent, dtype=np.uint64,
                                             count=len(self._recent)))
            self._recent.clear()

    def close(self) -> None:
        self.feed.close()


#: How the scheduler half builds its summary (None: off): ``(config, world_size, counters)``.
PresenceFactory = Callable[[TieredConfig, int, ConnectorCounters], "RedisPresence | None"]


def presence_source(config: TieredConfig, host_client: HostTierClient | None
                    ) -> PresenceFactory:
    """How the scheduler half builds its summary: from the daemon's feed for a
    ``host_tier_redis`` engine (``host_client``: its subscribed host-tier client), else
    from Redis (``RedisPresence.from_config``)."""
    if config.host_tier_redis and host_client is not None:
        return functools.partial(RedisPresence.from_daemon, host_client)
    return RedisPresence.from_config


class DaemonFeed:
    """The daemon's presence feed as a :class:`RedisPresence` reads a feed: digests the
    daemon pushed to this subscriber, and whether it is synced (it is not while the
    daemon is gone or its own feed walks). Announcing is the daemon's (it announces what it
    writes behind): this engine writes nothing to Redis itself."""

    def __init__(self, client: HostTierClient) -> None:
        self.client = client

    @property
    def synced(self) -> bool:
        return bool(self.client.available and self.client.presence_synced)

    def take(self) -> Digests:
        return self.client.take_presence()

    def announce_digests(self, digests: Iterable[int]) -> None:
        """Nothing to do: the daemon announces the saves it writes behind."""

    def drop_counts(self) -> tuple[int, int]:
        """Nothing dropped here: the daemon's feed counts its own drops."""
        return 0, 0

    def stats(self) -> dict[str, Any]:
        return {"synced": int(self.synced)}

    def close(self, timeout: float = 5.0) -> None:
        """Nothing of its own: the host-tier client is the scheduler half's."""
