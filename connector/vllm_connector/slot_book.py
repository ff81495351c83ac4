"""The scheduler half's shared books: the slot directory, the chain of secondary tiers, the
jobs, the counters and what KV events need; the hit planner
(:mod:`connector.vllm_connector.hit_planner`) and the store planner
(:mod:`connector.vllm_connector.store_planner`) both work on them.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from connector.events.wire import Medium
from connector.vllm_connector.config import TieredConfig
from connector.vllm_connector.host import HostTierMirror
from connector.vllm_connector.jobs import JobBook, TierChange
from connector.vllm_connector.plan import (
    StepPlan,
)
from connector.vllm_connector.presence import PresenceFactory, RedisPresence
from connector.vllm_connector.secondary import (
    HostTierBooks,
    RedisBooks,
    SecondaryTier,
)
from connector.vllm_connector.stats import ConnectorCounters
from offload_tiers.cpu_tier import CpuTier
from offload_tiers.keys import BlockKey, BlockKind, kind_for

log = logging.getLogger("connector.vllm_connector.scheduler")  # the scheduler half's log


ATTENTION = "attention"
MAMBA = "mamba"

_EVENT_INFO_MAX = 1 << 16


class RequestLike(Protocol):
    request_id: str
    block_hashes: Sequence[bytes]
    num_tokens: int
    all_token_ids: Sequence[int]
    cache_salt: str | None


class BlockLike(Protocol):
    block_id: int
    block_hash_num_tokens: int | None
    is_null: bool


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV-cache group as the connector sees it."""

    group: int
    kind: str  # ATTENTION, MAMBA, or anything else (unsupported: no hits, no stores)
    block_size: int


@dataclass(frozen=True, slots=True)
class EventInfo:
    """What a BlockStored announcement needs that the tiers do not keep."""

    token_ids: tuple[int, ...]
    parent_hash: bytes | None
    block_size: int
    kind: str


@dataclass(slots=True)
class _Tracked:
    request: Any
    saved: set[tuple[int, int, int]] = field(default_factory=set)  # (group, index, tokens)
    cursor: dict[int, int] = field(default_factory=dict)  # group -> first block not done


class SlotBook:
    """What both planners of one engine's scheduler half read and write."""

    def __init__(self, config: TieredConfig, groups: list[GroupSpec], hash_unit: int,
                 num_slots: int, slot_bytes: int, world_size: int,
                 fingerprint: Callable[[str], str],
                 blocks_of: Callable[[str], Sequence[Sequence[BlockLike]]],
                 pool_block: Callable[[int], BlockLike],
                 presence: PresenceFactory | None = None,
                 host: HostTierMirror | None = None, events: bool = True) -> None:
        self.config = config
        self.events = events  # BlockStored events are published (what they need is kept)
        self.groups = groups
        self.hash_unit = hash_unit
        self.world_size = world_size
        self._fingerprint = fingerprint
        self._blocks_of = blocks_of
        self._pool_block = pool_block
        self.counters = ConnectorCounters()
        self.outbox: deque[TierChange] = deque()
        self.directory = CpuTier(num_slots * slot_bytes, slot_bytes, with_slab=False,
                                 on_evict=self._on_evict)
        self.jobs = JobBook(world_size)
        # Redis: this engine's own, or reached through the host tier's daemon; its books
        # are kept whether or not one is configured (then it holds nothing)
        self.redis = RedisBooks(config, world_size, self.directory, self.jobs, self.counters,
                                self.outbox, self._plan_probe, presence)
        # The tiers after the engine's own CPU tier, in the order a hit is looked for: the
        # host's shared CPU tier (kvtier daemon --cpu-bytes), then Redis.
        self.host = host
        self.chain: list[SecondaryTier] = [
            *([HostTierBooks(host, self.counters)] if host is not None else []), self.redis]
        self.attention = [g for g in groups if g.kind == ATTENTION]
        self.mamba = [g for g in groups if g.kind == MAMBA]
        self.supported = bool(self.attention) and all(
            g.kind in (ATTENTION, MAMBA) for g in groups)
        if not self.supported:
            log.warning("kvtier: KV-cache groups %s include kinds it cannot restore; "
                        "it will neither store nor serve blocks", [g.kind for g in groups])
        for g in groups:
            if g.block_size % hash_unit:
                raise ValueError(f"group {g.group} block size {g.block_size} is not a multiple "
                                 f"of the hash unit {hash_unit}")
        self._tracked: dict[str, _Tracked] = {}
        self._plan = StepPlan()
        self.event_info: OrderedDict[BlockKey, EventInfo] = OrderedDict()
        # Hybrid hits are asynchronous loads: vLLM caches the restored blocks, Mamba state
        # included, before the request runs, so later turns hit vLLM's own cache. A hit that
        # needs Redis is asynchronous too: the workers fetch it in the background.
        self.hybrid = bool(self.mamba)
        self._gauges_at = float("-inf")

    @property
    def presence(self) -> RedisPresence | None:
        """Which keys Redis may hold, known without waiting (None: every miss is probed)."""
        return self.redis.presence

    @property
    def redis_up(self) -> bool:
        return self.redis.up

    def _plan_probe(self, op: Any) -> None:
        self._plan.probes.append(op)

    def close(self) -> None:
        """Stop the presence summary's feed thread and the host tier's client (idempotent)."""
        for tier in self.chain:
            tier.close()

    def _on_evict(self, key: BlockKey, _view: memoryview) -> None:
        self.outbox.append(TierChange(key, Medium.CPU, stored=False))
        self.counters.add("cpu_evictions")

    def refresh_gauges(self, min_interval_s: float = 1.0) -> None:
        """The CPU tier's occupancy gauges (at most once per ``min_interval_s``: O(entries))."""
        now = time.monotonic()
        if now - self._gauges_at < min_interval_s:
            return
        self._gauges_at = now
        st = self.directory.stats()
        for name, value in (("cpu_tier_slots", st["num_slots"]),
                            ("cpu_tier_entries", st["entries"]),
                            ("cpu_tier_pinned", st["pinned"]),
                            ("cpu_tier_reserved", st["reserved"])):
            self.counters.set_gauge(name, int(value))
        for tier in self.chain:
            tier.refresh_gauges()

    # ------------------------------------------------------------------ keys
    def tenant(self, request: RequestLike) -> str:
        salt = getattr(request, "cache_salt", None) or ""
        base = self.config.tenant
        return f"{base}/{salt}" if salt else base

    def key(self, request: RequestLike, fp: str, group: GroupSpec, num_tokens: int) -> BlockKey:
        """The key of the entry of ``group`` whose hash covers ``num_tokens`` tokens."""
        index = (num_tokens - 1) // group.block_size
        kind = kind_for(num_tokens, index, group.block_size)
        assert kind is not None
        block_hash = request.block_hashes[num_tokens // self.hash_unit - 1]
        return BlockKey(fp, group.group, bytes(block_hash), num_tokens, kind)

    def _group(self, group: int) -> GroupSpec:
        return self.groups[group] if self.groups[group].group == group else next(
            g for g in self.groups if g.group == group)

    def _unpin(self, key: BlockKey) -> None:
        try:
            self.directory.release(key)
        except KeyError:
            log.warning("kvtier: %s was not pinned", key.name)

    def _unpin_copy(self, key: BlockKey) -> None:
        """The ranks are done writing ``key`` to Redis: its slot may go (its place in the
        LRU order never changed: a write elsewhere is not a use)."""
        try:
            self.directory.unpin_for_copy(key)
        except KeyError:
            log.warning("kvtier: %s was not pinned for a copy", key.name)

    def _remember(self, request: RequestLike, key: BlockKey, g: GroupSpec) -> None:
        """Keep what the BlockStored events of ``key`` will need."""
        if not self.events:
            return
        if key in self.event_info:
            self.event_info.move_to_end(key)
            return
        n = key.num_tokens
        unit = self.hash_unit
        if g.kind == MAMBA:
            info = EventInfo((), None, 0, MAMBA)  # placeholder shape, as vLLM announces state
        else:
            start = n - g.block_size if key.kind is BlockKind.FULL else n - unit
            parent = bytes(request.block_hashes[start // unit - 1]) if start > 0 else None
            info = EventInfo(tuple(request.all_token_ids[start:n]), parent,
                             g.block_size if key.kind is BlockKind.FULL else unit, ATTENTION)
        self.event_info[key] = info
        while len(self.event_info) > _EVENT_INFO_MAX:
            self.event_info.popitem(last=False)
