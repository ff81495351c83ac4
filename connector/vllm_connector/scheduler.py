"""The scheduler half: what to load (the longest prefix the tiers supply) and what to store.

It runs in vLLM's engine-core process and keeps books only: which key sits in which CPU-tier
slot (a slot directory, no bytes), which jobs are still out, and, through the chain of
secondary tiers after the CPU tier (:mod:`connector.vllm_connector.secondary`: the host tier,
then Redis), where else a key may be. It never touches the network or a KV tensor; the
workers (one per TP rank, other processes) do, and report back through
:class:`~connector.vllm_connector.plan.WorkerReport`.

Pure logic over small interfaces, so it is tested without vLLM:

* a request exposes ``request_id``, ``block_hashes`` (one hash per hash unit, cumulative),
  ``num_tokens``, ``all_token_ids`` and ``cache_salt``;
* a block exposes ``block_id``, ``block_hash_num_tokens`` and ``is_null``.

Rules (see docs/connector.md): a hit is a run of FULL attention blocks, optionally ended by
one PARTIAL entry; every group must be restorable at the hit's end (attention blocks for
every attention group, the recurrent state for every Mamba group) or the hit is rounded down
to the longest end where it is. Fullness comes from ``block_hash_num_tokens`` only. A key
held only in Redis is asked about asynchronously (the lookup answers ``None``, "ask again",
until the workers' probe is back) and restored as an asynchronous load.
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
from connector.vllm_connector.jobs import JobBook, SlotJob, TierChange
from connector.vllm_connector.plan import (
    BACKFILL_REQ,
    OVERFLOW_SLOT,
    LoadOp,
    SaveOp,
    StepPlan,
    WorkerReport,
)
from connector.vllm_connector.presence import PresenceFactory, RedisPresence
from connector.vllm_connector.secondary import (
    ASK,
    Held,
    HitSource,
    HostTierBooks,
    RedisBooks,
    SecondaryTier,
    TierLookup,
)
from connector.vllm_connector.stats import ConnectorCounters
from offload_tiers.codec import new_save_id
from offload_tiers.cpu_tier import CpuTier
from offload_tiers.keys import BlockKey, BlockKind, kind_for

log = logging.getLogger(__name__)

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
class _Need:
    group: int
    block_index: int
    key: BlockKey


#: Where a key of a hit is: the engine's own CPU tier (None), or a tier of the chain.
Source = SecondaryTier | None


@dataclass(slots=True)
class _Lookup:
    start: int
    end: int
    needs: list[_Need]
    tiers: dict[BlockKey, Source]
    where: dict[BlockKey, object]  # each secondary key's place, as its tier gave it
    held: dict[BlockKey, Held]  # pinned CPU slots; what each secondary tier holds
    offered: int  # tokens offered to vLLM: end - start, or one less for a whole-prompt hit
    load_async: bool


@dataclass(slots=True)
class _Reach:
    """One look-up's candidates: the keys of every end a hit may reach, where the tiers
    hold them, and the keys each tier was asked to find (in order)."""

    prefix: dict[int, list[_Need]] = field(default_factory=dict)
    ending: dict[int, list[_Need]] = field(default_factory=dict)
    tiers: dict[BlockKey, Source] = field(default_factory=dict)
    where: dict[BlockKey, object] = field(default_factory=dict)
    asked: dict[int, list[BlockKey]] = field(default_factory=dict)  # chain index -> keys


@dataclass(slots=True)
class _Restore:
    """A hit being fetched: counted (by tier) once its last fetch job is back, if all ok."""

    split: dict[str, int]
    jobs: set[int]
    ok: bool = True


@dataclass(slots=True)
class _Tracked:
    request: Any
    saved: set[tuple[int, int, int]] = field(default_factory=set)  # (group, index, tokens)
    cursor: dict[int, int] = field(default_factory=dict)  # group -> first block not done


def whole_prompt_offer(end: int, num_tokens: int) -> int:
    """The hit length to give vLLM for a hit ending at ``end``.

    vLLM (0.32) accepts an external hit of at most ``num_tokens - 1`` tokens (a hit of the
    whole prompt leaves nothing to schedule), so a whole-prompt hit is offered one token
    short; the last token is recomputed, as vLLM does after an asynchronous whole-prompt load.
    """
    return min(end, num_tokens - 1)


class TieredScheduler:
    """Plans loads, fetches, saves and probes for one engine (all TP ranks at once)."""

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
        self._pending: dict[str, _Lookup] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._plan = StepPlan()
        self._hit_tiers: dict[str, dict[str, int]] = {}
        self._restoring: dict[str, _Restore] = {}
        self._fetching: dict[int, SecondaryTier] = {}  # fetch job -> the tier it reads
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

    # ------------------------------------------------------------------ lookups
    def lookup(self, request: RequestLike, num_computed: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed`` every group can restore, and whether the load is
        asynchronous; ``(None, False)`` while a Redis probe for this request is out.

        The hit's CPU entries are pinned and its Redis entries get reserved slots until the
        plan that loads them, so a load cannot lose its source.
        """
        self._drop_pending(request.request_id)
        if not self.supported:
            return 0, False
        # Attention-only models may restore the whole prompt (vLLM then recomputes only the
        # last token). With a Mamba group the hit must end where a state was saved, at most
        # num_tokens - 1 (the state at the prompt end already contains the last token).
        limit = request.num_tokens if not self.mamba else request.num_tokens - 1
        max_end = min(limit, len(request.block_hashes) * self.hash_unit)
        if max_end - num_computed < self.hash_unit:
            return 0, False
        fp = self._fingerprint(self.tenant(request))
        ends = list(range(num_computed + self.hash_unit, max_end + 1, self.hash_unit))
        lookups = [tier.lookup(request.request_id) for tier in self.chain]
        reach = self._reach(request, fp, ends, lookups)
        ends = ends[:len(reach.prefix)]
        for index, (tier, asked) in enumerate(zip(self.chain, lookups, strict=True)):
            found = asked.settle(reach.asked.get(index, []))
            if found is None:
                return None, False  # asked of the workers: ask again
            for key, where in found.items():
                reach.tiers[key], reach.where[key] = tier, where
        self.counters.add("lookups")
        self.counters.add("lookup_tokens", request.num_tokens - num_computed)
        return self._choose(request, num_computed, ends, reach)

    def may_load_async(self, request: RequestLike, num_computed: int) -> bool:
        """Whether :meth:`lookup` from ``num_computed`` may answer with an asynchronous load
        (vLLM 0.34's ``may_load_async``): a hit may need the host tier or Redis (the
        presence summary's "maybe"; any miss without a synced summary), or any hit on a
        hybrid model. The same walk as a lookup's, on books only: no probe, nothing held."""
        if not self.supported or (self.mamba and not self.config.hybrid_hits):
            return False
        limit = request.num_tokens if not self.mamba else request.num_tokens - 1
        max_end = min(limit, len(request.block_hashes) * self.hash_unit)
        if max_end - num_computed < self.hash_unit:
            return False
        fp = self._fingerprint(self.tenant(request))
        ends = list(range(num_computed + self.hash_unit, max_end + 1, self.hash_unit))
        reach = self._reach(request, fp, ends,
                            [tier.lookup(request.request_id, dry=True) for tier in self.chain])
        if reach.asked or any(t is not None for t in reach.tiers.values()):
            return True
        ends = ends[:len(reach.prefix)]
        return self.hybrid and self._best(ends, reach.prefix, reach.ending, reach.tiers)[0] > 0

    def _needs_at(self, request: RequestLike, fp: str, end: int
                  ) -> tuple[list[_Need], list[_Need]]:
        """The keys of candidate ``end``: its prefix keys (the FULL attention blocks ending
        there; a hit past ``end`` needs them too) and its end keys (the PARTIAL attention
        entry and every Mamba state, needed only by a hit ending exactly there)."""
        prefix = [_Need(g.group, end // g.block_size - 1, self.key(request, fp, g, end))
                  for g in self.attention if end % g.block_size == 0]
        ending = [_Need(g.group, end // g.block_size, self.key(request, fp, g, end))
                  for g in self.attention if end % g.block_size != 0]
        ending += [_Need(g.group, (end - 1) // g.block_size, self.key(request, fp, g, end))
                   for g in self.mamba]
        return prefix, ending

    def _reach(self, request: RequestLike, fp: str, ends: list[int],
               lookups: list[TierLookup]) -> _Reach:
        """Where each key of each candidate end is, end by end (the CPU tier, then each tier
        of the chain in order), up to the first end with a FULL block in no tier and worth
        asking of none. No hit reaches past it, so nothing past it is looked at: a miss
        costs the keys of its first block, not of its prompt."""
        reach = _Reach()
        for end in ends:
            prefix, ending = self._needs_at(request, fp, end)
            keys = [n.key for n in prefix + ending]
            asked: dict[BlockKey, int] = {}  # key -> the chain index of the tier to ask
            for key, in_cpu in zip(keys, self.directory.contains_many(keys), strict=True):
                if in_cpu:
                    reach.tiers[key] = None
                    continue
                for index, lookup in enumerate(lookups):
                    where = lookup.locate(key)
                    if where is ASK:
                        asked[key] = index
                    elif where is not None:
                        reach.tiers[key], reach.where[key] = self.chain[index], where
                    else:
                        continue
                    break
            if any(n.key not in reach.tiers and n.key not in asked for n in prefix):
                break  # a FULL block of this end is nowhere: no hit reaches it
            reach.prefix[end], reach.ending[end] = prefix, ending
            for key, index in asked.items():
                reach.asked.setdefault(index, []).append(key)
        return reach

    def _choose(self, request: RequestLike, num_computed: int, ends: list[int],
                reach: _Reach) -> tuple[int, bool]:
        tiers = reach.tiers
        for _attempt in range(3):
            best, needs, present = self._best(ends, reach.prefix, reach.ending, tiers)
            if best == 0:
                if present:
                    self.counters.add("rounded_down_tokens", present - num_computed)
                return 0, False
            if self.mamba and not self.config.hybrid_hits:
                # Operator switch: store hybrid blocks, never restore them (counted).
                self.counters.add("rounded_down_tokens", max(present, best) - num_computed)
                self.counters.add("hybrid_hits_withheld", best - num_computed)
                return 0, False
            held = self._hold_hit(needs, tiers, reach.where)
            if held is None:
                continue  # a key could not be held: a miss now; choose a shorter end
            if present > best:
                self.counters.add("rounded_down_tokens", present - best)
            load_async = self.hybrid or any(tiers[n.key] is not None for n in needs)
            offered = whole_prompt_offer(best, request.num_tokens) - num_computed
            self._pending[request.request_id] = _Lookup(num_computed, best, needs, tiers,
                                                        reach.where, held, offered,
                                                        load_async)
            return offered, load_async
        return 0, False

    @staticmethod
    def _best(ends: list[int], prefix: dict[int, list[_Need]], ending: dict[int, list[_Need]],
              tiers: dict[BlockKey, Source]) -> tuple[int, list[_Need], int]:
        """The longest end every group can restore, its keys, and the longest end seen."""
        best = present = 0
        needs: list[_Need] = []
        chain: list[_Need] = []
        for end in ends:
            if not all(n.key in tiers for n in prefix[end]):
                break
            chain.extend(prefix[end])
            if any(n.key in tiers for n in prefix[end] + ending[end]):
                present = end
            if all(n.key in tiers for n in ending[end]):
                best = end
                needs = chain + ending[end]
        return best, list(needs), present

    def _hold_hit(self, needs: list[_Need], tiers: dict[BlockKey, Source],
                  where: dict[BlockKey, object]) -> dict[BlockKey, Held] | None:
        """Hold every key of a hit where it is, all or none: a CPU key's slot pinned; a
        secondary tier's key as that tier holds it (Redis: a reserved slot to fetch into;
        the host tier: every rank's shard pinned, loaded from there).

        Keys are held in hit order, so holding one never evicts an earlier key of the same
        hit. On failure everything is let go, the failed key leaves ``tiers`` (the next
        attempt chooses a shorter end) and ``None`` is returned.
        """
        held: dict[BlockKey, Held] = {}
        for need in needs:
            if need.key in held:
                continue
            tier = tiers[need.key]
            if tier is None:
                slot = self.directory.acquire(need.key)
                got = Held(slot) if slot is not None else None
            else:
                got = tier.hold(need.key, where[need.key])
            if got is None:
                tiers.pop(need.key, None)
                self._let_go(held, tiers)
                return None
            held[need.key] = got
        return held

    def _let_go(self, held: dict[BlockKey, Held], tiers: dict[BlockKey, Source]) -> None:
        for key, h in held.items():
            tier = tiers.get(key)
            if tier is None:
                self._unpin(key)
            else:
                tier.let_go(key, h)
        held.clear()

    def _drop_pending(self, req_id: str) -> None:
        pending = self._pending.pop(req_id, None)
        if pending is not None:
            self._let_go(pending.held, pending.tiers)

    def _unpin(self, key: BlockKey) -> None:
        try:
            self.directory.release(key)
        except KeyError:
            log.warning("kvtier: %s was not pinned", key.name)

    def _unhold(self, key: BlockKey) -> None:
        """The ranks are done writing ``key`` to Redis: its slot may go (its place in the
        LRU order never changed: a write elsewhere is not a use)."""
        try:
            self.directory.unhold(key)
        except KeyError:
            log.warning("kvtier: %s was not held", key.name)

    # ------------------------------------------------------------------ allocation
    def on_alloc(self, request: RequestLike, blocks: Sequence[Sequence[BlockLike]],
                 num_external: int) -> None:
        """vLLM allocated blocks; turn an accepted hit into loads (and fetches)."""
        req_id = request.request_id
        self._tracked.setdefault(req_id, _Tracked(request))
        pending = self._pending.pop(req_id, None)
        if pending is None:
            return
        if num_external != pending.offered:
            # vLLM took less (or more) than offered: a hit cut short would leave a hole with
            # no Mamba state at its end, so the load is refused and vLLM computes it all.
            if num_external > 0:
                log.warning("kvtier: vLLM accepted %d external tokens for %s, offered %d; "
                            "not loading", num_external, req_id, pending.offered)
                self.counters.add("refused_loads")
            self._let_go(pending.held, pending.tiers)
            return
        per_source = dict.fromkeys([HitSource.CPU, *(t.source for t in self.chain)], 0)
        lead = self.attention[0]
        fetched: dict[BlockKey, int] = {}
        for need in pending.needs:
            group_blocks = blocks[need.group]
            block = group_blocks[need.block_index] \
                if need.block_index < len(group_blocks) else None
            if block is None or block.is_null:
                raise RuntimeError(
                    f"kvtier: vLLM allocated no block for group {need.group} index "
                    f"{need.block_index} of {req_id}; refusing a partial restore")
            tier = pending.tiers[need.key]
            held = pending.held[need.key]
            if tier is not None and need.key not in fetched:
                job = fetched[need.key] = self.jobs.open_fetch(need.key, held.slot, req_id)
                self._fetching[job] = tier
                self._plan.fetches.append(tier.fetch(job, req_id, need.key, held,
                                                     pending.where[need.key]))
            self._plan.loads.append(LoadOp(req_id, need.group, block.block_id, held.slot,
                                           need.key, after_fetch=tier is not None,
                                           from_host=tier is not None and tier.loads_in_place))
            self._remember(request, need.key, self._group(need.group))
            if need.group == lead.group:
                start = max(need.block_index * lead.block_size, pending.start)
                per_source[HitSource.CPU if tier is None else tier.source] += \
                    max(min(need.key.num_tokens, pending.end) - start, 0)
        # A CPU slot is read by this step's loads, which every worker runs before any later
        # save can reuse it: the pins go now. Fetches hold theirs until their job ends.
        for key in pending.held:
            if pending.tiers[key] is None:
                self._unpin(key)
        if pending.load_async:
            self._plan.async_reqs.append(req_id)
        split = self._hit_split(per_source, num_external)
        self._hit_tiers[req_id] = split
        if fetched:
            # Counted once every fetch is back and valid (a bad value is no hit).
            self._restoring[req_id] = _Restore(split, set(fetched.values()))
        else:
            self._count_hit(split)

    def _hit_split(self, per_source: dict[str, int], num_external: int) -> dict[str, int]:
        """The tokens vLLM took, by the tier they came from, in chain order (the last tier
        gets the rest: a whole-prompt hit is offered one token short)."""
        split: dict[str, int] = {}
        left = num_external
        for source in list(per_source)[:-1]:
            split[source] = min(per_source[source], left)
            left -= split[source]
        split[list(per_source)[-1]] = left
        return split

    def _count_hit(self, split: dict[str, int]) -> None:
        self.counters.add("hit_requests")
        for source, tokens in split.items():
            self.counters.add(f"hit_tokens_{source}", tokens)

    def _restore_progress(self, req_id: str, job: int, ok: bool) -> None:
        entry = self._restoring.get(req_id)
        if entry is None:
            return
        entry.jobs.discard(job)
        entry.ok = entry.ok and ok
        if entry.jobs:
            return
        del self._restoring[req_id]
        if entry.ok:
            self._count_hit(entry.split)
        else:
            self.counters.add("failed_restores")
            self.counters.add("failed_restore_tokens", sum(entry.split.values()))

    def hit_tiers(self, req_id: str) -> dict[str, int]:
        """Tokens of ``req_id``'s last hit by tier (for vLLM's hit-source split)."""
        return self._hit_tiers.pop(req_id, {})

    def _group(self, group: int) -> GroupSpec:
        return self.groups[group] if self.groups[group].group == group else next(
            g for g in self.groups if g.group == group)

    # ------------------------------------------------------------------ stores
    def plan(self, computed_after: dict[str, int],
             boundary_states: dict[str, list[tuple[int, int, int]]],
             gone: set[str]) -> StepPlan:
        """This step's loads, fetches, probes and saves.

        ``computed_after``: request id -> tokens computed once this step has run.
        ``boundary_states``: vLLM's exact Mamba state hand-offs (group, block id, tokens).
        ``gone``: requests finished or preempted this step (their hand-offs are dropped).
        """
        plan, self._plan = self._plan, StepPlan()
        known = [k for k in (tier.begin_step() for tier in self.chain) if k is not None]
        plan.layout_known = bool(known) and all(known)
        if not self.supported:
            return plan
        for req_id, done in computed_after.items():
            tracked = self._tracked.get(req_id)
            if tracked is None or req_id in gone:
                continue
            self._plan_attention(tracked, done, plan)
        for req_id, entries in boundary_states.items():
            tracked = self._tracked.get(req_id)
            if tracked is None or req_id in gone:
                continue
            self._plan_mamba(tracked, entries, computed_after.get(req_id, 0), plan)
        self._plan_backfills(plan)
        return plan

    def _plan_backfills(self, plan: StepPlan) -> None:
        """A batch of entries that never reached Redis, once it answers: each slot held
        until every rank wrote its shard from it (in its place in the LRU order)."""
        backfill = self.redis.backfill
        if not backfill:  # off, or nothing to write (most steps)
            return
        for key in backfill.take(self.redis.up):
            if key in self.redis.written or not self.directory.contains(key):
                continue  # written since, or evicted
            slot = self.directory.hold(key)
            assert slot is not None
            job = self.jobs.open_save(key, slot, BACKFILL_REQ, None, True)
            plan.backfills.append(SaveOp(job, BACKFILL_REQ, key.group, -1, slot, key, True,
                                         new_save_id()))
        backfill.sent(len(plan.backfills))
        self.counters.add("redis_backfills", len(plan.backfills))

    def _plan_attention(self, tracked: _Tracked, done: int, plan: StepPlan) -> None:
        request = tracked.request
        per_group = self._blocks_of(request.request_id)
        fp: str | None = None
        for g in self.attention:
            if g.group >= len(per_group):
                continue
            group_blocks = per_group[g.group]
            first = tracked.cursor.get(g.group, 0)
            for index in range(first, len(group_blocks)):
                block = group_blocks[index]
                if block.is_null:
                    continue
                n = block.block_hash_num_tokens
                if n is None or n > done or (g.group, index, n) in tracked.saved:
                    continue
                tracked.saved.add((g.group, index, n))
                kind = kind_for(n, index, g.block_size)
                if kind is BlockKind.PARTIAL and not self.config.store_partial:
                    continue
                if n % self.hash_unit or n // self.hash_unit > len(request.block_hashes):
                    continue
                fp = fp or self._fingerprint(self.tenant(request))
                self._save(plan, request, g, block.block_id, self.key(request, fp, g, n),
                           (g.group, index, n))
            tracked.cursor[g.group] = self._advance(tracked, g, group_blocks, first, done)

    @staticmethod
    def _advance(tracked: _Tracked, g: GroupSpec, group_blocks: Sequence[BlockLike], first: int,
                 done: int) -> int:
        """Skip leading blocks that are FULL, computed and handled: they never change."""
        index = first
        while index < len(group_blocks):
            block = group_blocks[index]
            n = block.block_hash_num_tokens
            full_end = (index + 1) * g.block_size
            if not block.is_null and (n != full_end or n > done
                                      or (g.group, index, n) not in tracked.saved):
                break
            index += 1
        return index

    def _plan_mamba(self, tracked: _Tracked, entries: list[tuple[int, int, int]], done: int,
                    plan: StepPlan) -> None:
        request = tracked.request
        fp: str | None = None
        for group_id, block_id, tokens in entries:
            g = self._group(group_id)
            if g.kind != MAMBA or tokens <= 0 or tokens % self.hash_unit:
                continue
            if tokens // self.hash_unit > len(request.block_hashes) or tokens > max(done, 0):
                continue
            block = self._pool_block(block_id)
            n = block.block_hash_num_tokens
            # A hand-off whose block has no hash, or a hash of another length, is not the
            # state at ``tokens``: skip it.
            if block.is_null or n != tokens:
                continue
            kind = kind_for(tokens, (tokens - 1) // g.block_size, g.block_size)
            if kind is BlockKind.PARTIAL and not self.config.store_partial:
                continue
            fp = fp or self._fingerprint(self.tenant(request))
            self._save(plan, request, g, block_id, self.key(request, fp, g, tokens), None)

    def _save(self, plan: StepPlan, request: RequestLike, g: GroupSpec, block_id: int,
              key: BlockKey, mark: tuple[int, int, int] | None) -> None:
        """Give ``key`` a slot now (committed: the workers fill it in this step, before any
        later step's load reads it) and plan the copy; a slot for Redis stays pinned until
        every rank has written it."""
        if self.directory.contains(key):
            return
        for tier in self.chain:
            if tier.has(key):
                # The host tier holds every rank's shard (restored from there, or another
                # engine's save): one copy per host, none in this engine's own tier.
                self.counters.add(f"{tier.source}_held_saves_skipped")
                return
        slot = self.directory.reserve(key)
        to_redis = self.redis.accepts_saves
        if slot is None and to_redis:
            # Every slot is pinned (loads, queued Redis writes): the block goes to Redis
            # through a buffer of the worker's own, bounded by its write queue.
            self.counters.add("overflow_saves")
            job = self.jobs.open_save(key, OVERFLOW_SLOT, request.request_id, mark, True)
            plan.saves.append(SaveOp(job, request.request_id, g.group, block_id,
                                     OVERFLOW_SLOT, key, True, new_save_id()))
            self._remember(request, key, g)
            return
        if slot is None:
            self.counters.add("store_drops")
            if mark is not None:
                self._tracked[request.request_id].saved.discard(mark)
            return
        self.directory.commit(key)
        if to_redis:
            self.directory.hold(key)
        elif self.redis.configured:
            self.counters.add("redis_unavailable_saves")
            if self.redis.backfill is not None:
                self.redis.backfill.note(key)
        job = self.jobs.open_save(key, slot, request.request_id, mark, to_redis)
        to_host = any(tier.takes_copies for tier in self.chain)
        plan.saves.append(SaveOp(job, request.request_id, g.group, block_id, slot, key,
                                 to_redis, new_save_id() if to_redis or to_host else 0,
                                 to_host))
        self.outbox.append(TierChange(key, Medium.CPU, stored=True))
        self._remember(request, key, g)

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

    # ------------------------------------------------------------------ worker reports
    def on_report(self, report: WorkerReport) -> None:
        """Apply what the workers finished: saves, fetches, probes, Redis health."""
        if report.rank0_layout:
            for tier in self.chain:
                tier.set_layout(report.rank0_layout)
        if report.redis_up:
            self.redis.set_up(report.redis_up)
        for job, (ok, n, gather_failed) in report.saves.items():
            done = self.jobs.report(job, ok, n, gather_failed)
            if done is not None:
                self._save_done(*done)
        for job, (ok, n) in report.fetches.items():
            done = self.jobs.report(job, ok, n)
            if done is not None:
                self._fetch_done(job, *done)
        for job, (ids, n) in report.probes.items():
            done = self.jobs.report_probe(job, ids, n)
            if done is not None:
                self.redis.probe_done(job, *done)

    def _save_done(self, info: SlotJob, all_ok: bool) -> None:
        key = info.key
        backfilled = info.req_id == BACKFILL_REQ
        backfill = self.redis.backfill
        if backfilled and backfill is not None:
            backfill.answered()
        if info.to_redis and info.slot != OVERFLOW_SLOT:
            self._unhold(key)
        if not all_ok:
            # A rank could not copy the block: its slot is not trusted.
            if info.gather_failed and self.directory.remove(key):
                self.counters.add("store_drops")
                self.outbox.append(TierChange(key, Medium.CPU, stored=False))
            elif (info.to_redis and info.slot != OVERFLOW_SLOT and not backfilled
                  and backfill is not None):
                backfill.note(key)  # copied, but not written to Redis: later
            tracked = self._tracked.get(info.req_id)
            if tracked is not None and info.mark is not None:
                tracked.saved.discard(info.mark)
                tracked.cursor.pop(info.mark[0], None)
            return
        if info.to_redis:
            self.redis.wrote(key)

    def _fetch_done(self, job: int, info: SlotJob, all_ok: bool) -> None:
        self._restore_progress(info.req_id, job, all_ok)
        self._fetching.pop(job).fetched(job, info.key, all_ok)

    def register_tail(self, request: RequestLike, entries: list[tuple[int, int, int]]) -> bool:
        """A finishing request's Mamba partial tails (group, block id, tokens): save them in
        the next step; True = vLLM must keep the blocks until the workers say they copied
        them (``finished_sending``)."""
        if not self.supported:
            return False
        tracked = self._tracked.get(request.request_id) or _Tracked(request)
        before = len(self._plan.saves)
        self._plan_mamba(tracked, entries, int(getattr(request, "num_computed_tokens", 0)),
                         self._plan)
        if len(self._plan.saves) == before:
            return False
        self._plan.tail_reqs.append(request.request_id)
        self.counters.add("partial_tails_saved", len(self._plan.saves) - before)
        return True

    # ------------------------------------------------------------------ lifecycle
    def finished(self, req_id: str) -> None:
        self._tracked.pop(req_id, None)
        self._drop_pending(req_id)
        for tier in self.chain:
            tier.finished(req_id)
        self._hit_tiers.pop(req_id, None)

    def preempted(self, req_id: str) -> None:
        """A preempted request resumes with new blocks: forget what was saved for it."""
        tracked = self._tracked.get(req_id)
        if tracked is not None:
            tracked.saved.clear()
            tracked.cursor.clear()

    def reset(self) -> int:
        """Empty the CPU tier's directory (connector-cache reset); entries removed."""
        removed = 0
        for key in self.directory.keys():
            if self.directory.remove(key):
                removed += 1
                self.outbox.append(TierChange(key, Medium.CPU, stored=False))
        self.redis.reset()
        return removed

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters.snapshot())
        out["cpu_tier"] = self.directory.stats()
        out["open_jobs"] = len(self.jobs)
        return out
