"""The scheduler half: what to load (the longest prefix the tiers supply) and what to store.

Pure logic over small interfaces, so it is tested without vLLM:

* a request exposes ``request_id``, ``block_hashes`` (one hash per hash unit, cumulative),
  ``num_tokens``, ``all_token_ids`` and ``cache_salt``;
* a block exposes ``block_id``, ``block_hash_num_tokens`` and ``is_null``.

Rules (see docs/connector.md): a hit is a run of FULL attention blocks, optionally ended by
one PARTIAL entry; every group must be restorable at the hit's end (attention blocks for
every attention group, the recurrent state for every Mamba group) or the hit is rounded down
to the longest end where it is. Fullness comes from ``block_hash_num_tokens`` only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from connector.connector_metadata import TIER_CPU, TIER_REDIS, LoadOp, SaveOp, StepPlan
from connector.worker_side import MEDIUM_CPU, TierChange, TierRuntime
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


@dataclass(slots=True)
class _Lookup:
    start: int
    end: int
    needs: list[_Need]
    tiers: dict[BlockKey, str]
    pins: dict[BlockKey, int]
    offered: int  # tokens offered to vLLM: end - start, or one less for a whole-prompt hit


@dataclass(slots=True)
class _Tracked:
    request: Any
    saved: set[tuple[int, int, int]] = field(default_factory=set)  # (group, index, tokens)
    partial: dict[tuple[int, int], BlockKey] = field(default_factory=dict)
    cursor: dict[int, int] = field(default_factory=dict)  # group -> first block not done


def whole_prompt_offer(end: int, num_tokens: int) -> int:
    """The hit length to give vLLM for a hit ending at ``end``.

    vLLM (0.32) accepts a synchronous external hit of at most ``num_tokens - 1`` tokens (a
    hit of the whole prompt leaves nothing to schedule: ``assert num_new_tokens > 0`` in
    ``Scheduler.schedule``), so a whole-prompt hit is offered one token short; the last
    token is recomputed, as vLLM does after an asynchronous whole-prompt load.
    """
    return min(end, num_tokens - 1)


class TieredScheduler:
    """Plans loads and saves for one engine; all tier access goes through ``runtime``."""

    def __init__(self, runtime: TierRuntime, groups: list[GroupSpec], hash_unit: int,
                 fingerprint: Callable[[str], str],
                 blocks_of: Callable[[str], Sequence[Sequence[BlockLike]]],
                 pool_block: Callable[[int], BlockLike]) -> None:
        self.rt = runtime
        self.groups = groups
        self.hash_unit = hash_unit
        self._fingerprint = fingerprint
        self._blocks_of = blocks_of
        self._pool_block = pool_block
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
        self._loads: list[LoadOp] = []
        self._async_reqs: list[str] = []
        # Hybrid hits are handed to vLLM as asynchronous loads (copied in the step they are
        # planned, reported done through get_finished): vLLM then caches the restored blocks,
        # Mamba state included, before the request runs, so later requests hit them in vLLM's
        # own cache. A synchronous restore's Mamba block is the request's running state and
        # is overwritten by the step, so the next turn had to load it from kvtier again.
        self.load_async = bool(self.mamba)
        self._hit_tiers: dict[str, dict[str, int]] = {}
        self.event_info: OrderedDict[BlockKey, EventInfo] = OrderedDict()

    # ------------------------------------------------------------------ keys
    def tenant(self, request: RequestLike) -> str:
        salt = getattr(request, "cache_salt", None) or ""
        base = self.rt.config.tenant
        return f"{base}/{salt}" if salt else base

    def key(self, request: RequestLike, fp: str, group: GroupSpec, num_tokens: int) -> BlockKey:
        """The key of the entry of ``group`` whose hash covers ``num_tokens`` tokens."""
        index = (num_tokens - 1) // group.block_size
        kind = kind_for(num_tokens, index, group.block_size)
        assert kind is not None
        block_hash = request.block_hashes[num_tokens // self.hash_unit - 1]
        return BlockKey(fp, group.group, bytes(block_hash), num_tokens, kind)

    # ------------------------------------------------------------------ lookups
    def lookup(self, request: RequestLike, num_computed: int) -> int:
        """Tokens beyond ``num_computed`` that the tiers can restore for every group.

        The hit's entries end up in the CPU tier (Redis values are fetched and validated
        here) and pinned until the worker has loaded them, so a load cannot miss.
        """
        self._drop_pending(request.request_id)
        cpu = self.rt.cpu
        if not self.supported or cpu is None:
            return 0
        self.rt.counters.add("lookups")
        self.rt.counters.add("lookup_tokens", request.num_tokens - num_computed)
        # Attention-only models may restore the whole prompt: vLLM then recomputes only the
        # last token (offered = prompt - 1, loads synchronous). With a Mamba group the hit
        # must end where a state was saved, at most num_tokens - 1 (the state at the prompt
        # end already contains the last token, which vLLM would feed through it again).
        limit = request.num_tokens if not self.mamba else request.num_tokens - 1
        max_end = min(limit, len(request.block_hashes) * self.hash_unit)
        if max_end - num_computed < self.hash_unit:
            return 0
        fp = self._fingerprint(self.tenant(request))
        unit = self.hash_unit
        ends = list(range(num_computed + unit, max_end + 1, unit))
        # Keys per candidate end: prefix keys (FULL attention blocks, cumulative) and end keys
        # (the PARTIAL attention entry and every Mamba state, only for the end itself).
        prefix: dict[int, list[_Need]] = {}
        ending: dict[int, list[_Need]] = {}
        for end in ends:
            prefix[end] = [
                _Need(g.group, end // g.block_size - 1, self.key(request, fp, g, end))
                for g in self.attention if end % g.block_size == 0
            ]
            ending[end] = [
                _Need(g.group, end // g.block_size, self.key(request, fp, g, end))
                for g in self.attention if end % g.block_size != 0
            ] + [
                _Need(g.group, (end - 1) // g.block_size, self.key(request, fp, g, end))
                for g in self.mamba
            ]
        tiers = self._locate(ends, prefix, ending)
        for _attempt in range(3):
            best, needs, present = self._best(ends, prefix, ending, tiers)
            if best == 0:
                if present:
                    self.rt.counters.add("rounded_down_tokens", present - num_computed)
                return 0
            if self.mamba and not self.rt.config.hybrid_hits:
                # Operator switch: store hybrid blocks, never restore them (counted).
                self.rt.counters.add("rounded_down_tokens", max(present, best) - num_computed)
                self.rt.counters.add("hybrid_hits_withheld", best - num_computed)
                return 0
            pins = self._pin_hit(needs, tiers)
            if pins is None:
                continue  # a key was bad, gone or found no slot: a miss now; choose again
            if present > best:
                self.rt.counters.add("rounded_down_tokens", present - best)
            offered = whole_prompt_offer(best, request.num_tokens) - num_computed
            self._pending[request.request_id] = _Lookup(num_computed, best, needs, tiers, pins,
                                                        offered)
            return offered
        return 0

    @staticmethod
    def _best(ends: list[int], prefix: dict[int, list[_Need]], ending: dict[int, list[_Need]],
              tiers: dict[BlockKey, str]) -> tuple[int, list[_Need], int]:
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

    def _pin_hit(self, needs: list[_Need], tiers: dict[BlockKey, str]
                 ) -> dict[BlockKey, int] | None:
        """Pin every key of a hit in the CPU tier (all or nothing), fetching Redis-held keys.

        Redis values are fetched in one call and validated, then every key is pinned in hit
        order, a fetched one right after it is put, so bringing in one key never evicts an
        earlier key of the same hit. (Putting them all first, then pinning, thrashed in a CPU
        tier full of other requests' pins: the hit's keys evicted each other, the pins failed
        on every attempt, each attempt re-fetched from Redis and evicted more entries, and the
        request got no hit at all.) On failure every pin is released and the failed key is
        dropped from ``tiers``, so the next attempt chooses a shorter end. ``None`` then.
        """
        cpu = self.rt.cpu
        assert cpu is not None
        remote = [n for n in needs if tiers.get(n.key) == TIER_REDIS and not cpu.contains(n.key)]
        payloads: dict[BlockKey, Any] = {}
        if remote:
            assert self.rt.layout is not None
            sizes = {g.group: g.nbytes for g in self.rt.layout.groups}
            values = self.rt.redis.get_many([n.key for n in remote]) \
                if self.rt.refresh_redis_gauge() else [None] * len(remote)
            for need, payload in zip(remote, values, strict=True):
                if payload is None or memoryview(payload).nbytes != sizes.get(need.group):
                    tiers.pop(need.key, None)
                    self.rt.counters.add("redis_misses_at_fetch")
                else:
                    payloads[need.key] = payload
            if len(payloads) < len(remote):
                return None
        pins: dict[BlockKey, int] = {}
        for need in needs:
            slot = cpu.acquire(need.key)
            if slot is None and need.key in payloads:
                if cpu.put(need.key, payloads[need.key]):
                    self.rt.outbox.append(TierChange(need.key, MEDIUM_CPU, stored=True))
                    slot = cpu.acquire(need.key)
                else:
                    self.rt.counters.add("store_drops")  # every slot pinned or being written
            if slot is None:
                tiers.pop(need.key, None)
                self._unpin(list(pins))
                return None
            pins[need.key] = slot
        return pins

    def _drop_pending(self, req_id: str) -> None:
        pending = self._pending.pop(req_id, None)
        if pending is not None:
            self._unpin(list(pending.pins))

    def _unpin(self, keys: list[BlockKey]) -> None:
        cpu = self.rt.cpu
        assert cpu is not None
        for key in keys:
            try:
                cpu.release(key)
            except KeyError:
                log.warning("kvtier: %s was not pinned", key.name)

    def _locate(self, ends: list[int], prefix: dict[int, list[_Need]],
                ending: dict[int, list[_Need]]) -> dict[BlockKey, str]:
        """Which tier holds each candidate key: CPU first, then Redis for the rest."""
        cpu = self.rt.cpu
        assert cpu is not None
        ordered: list[BlockKey] = []
        for end in ends:
            ordered.extend(n.key for n in prefix[end])
            ordered.extend(n.key for n in ending[end])
        ordered = list(dict.fromkeys(ordered))
        found = dict.fromkeys(
            (k for k, ok in zip(ordered, cpu.contains_many(ordered), strict=True) if ok), TIER_CPU)
        missing = [k for k in ordered if k not in found]
        if missing and self.rt.redis is not None:
            if not self.rt.refresh_redis_gauge():
                self.rt.counters.add("redis_lookup_skips")
            else:
                # Only keys that could extend the run matter: stop after the first missing
                # FULL prefix key in Redis.
                for k, ok in zip(missing, self.rt.redis.exists_many(missing), strict=True):
                    if ok:
                        found[k] = TIER_REDIS
        return found

    # ------------------------------------------------------------------ allocation
    def on_alloc(self, request: RequestLike, blocks: Sequence[Sequence[BlockLike]],
                 num_external: int) -> None:
        """vLLM allocated blocks; turn an accepted hit into load operations."""
        req_id = request.request_id
        self._tracked.setdefault(req_id, _Tracked(request))
        pending = self._pending.pop(req_id, None)
        if pending is None:
            return
        if num_external <= 0:
            self._unpin(list(pending.pins))
            return
        accepted = pending.start + num_external
        # A whole-prompt hit is offered one token short (vLLM recomputes the last token), but
        # its last entry is loaded whole: that token's KV is the same either way.
        end = pending.end if num_external == pending.offered else accepted
        if num_external != pending.offered:
            log.warning("kvtier: vLLM accepted %d external tokens for %s, planned %d",
                        num_external, req_id, pending.offered)
        per_tier = {TIER_CPU: 0, TIER_REDIS: 0}
        lead = self.attention[0]
        ops: list[LoadOp] = []
        unused: list[BlockKey] = []
        for need in pending.needs:
            if need.key.num_tokens > end:
                unused.append(need.key)
                continue
            group_blocks = blocks[need.group]
            block = group_blocks[need.block_index] \
                if need.block_index < len(group_blocks) else None
            if block is None or block.is_null:
                raise RuntimeError(
                    f"kvtier: vLLM allocated no block for group {need.group} index "
                    f"{need.block_index} of {req_id}; refusing a partial restore")
            tier = pending.tiers.get(need.key, TIER_CPU)
            ops.append(LoadOp(req_id, need.group, block.block_id, need.key, tier,
                              pending.pins[need.key]))
            self._remember(request, need.key, self._group(need.group))
            if need.group == lead.group:
                start = max(need.block_index * lead.block_size, pending.start)
                per_tier[tier] += max(min(need.key.num_tokens, accepted) - start, 0)
        self._unpin(unused)
        self._loads.extend(ops)
        if self.load_async:
            self._async_reqs.append(req_id)
        self.rt.counters.add("hit_requests")
        self.rt.counters.add("hit_tokens_cpu", per_tier[TIER_CPU])
        self.rt.counters.add("hit_tokens_redis", per_tier[TIER_REDIS])
        self._hit_tiers[req_id] = per_tier

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
        """This step's loads and saves.

        ``computed_after``: request id -> tokens computed once this step has run.
        ``boundary_states``: vLLM's exact Mamba state hand-offs (group, block id, tokens).
        ``gone``: requests finished or preempted this step (their hand-offs are dropped).
        """
        plan = StepPlan(loads=self._loads, async_reqs=self._async_reqs)
        self._loads, self._async_reqs = [], []
        if not self.supported or self.rt.cpu is None:
            return plan
        self._mirror_mamba_loads(plan, computed_after)
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
        return plan

    def _mirror_mamba_loads(self, plan: StepPlan, computed_after: dict[str, int]) -> None:
        """Also write each restored Mamba state into the step's running-state block.

        In "align" mode vLLM's worker copies the state of block ``(L-1)//B`` into the running
        block ``ceil(end/B)-1`` before the forward (``preprocess_mamba``) — before connector
        loads run. When the two differ, the copy would take the not-yet-loaded block; writing
        the restored state into the running block too gives the kernel what the copy would.
        """
        cpu = self.rt.cpu
        assert cpu is not None
        extra: list[LoadOp] = []
        for op in plan.loads:
            g = self._group(op.group)
            if g.kind != MAMBA or op.req_id not in computed_after:
                continue
            bs = g.block_size
            start_idx = (op.key.num_tokens - 1) // bs
            run_idx = -(-computed_after[op.req_id] // bs) - 1
            if run_idx == start_idx:
                continue
            group_blocks = self._blocks_of(op.req_id)[op.group]
            if run_idx >= len(group_blocks) or group_blocks[run_idx].is_null:
                raise RuntimeError(f"kvtier: no running Mamba block {run_idx} for {op.req_id}")
            slot = cpu.acquire(op.key)  # a second pin: the worker releases once per op
            if slot is None:
                raise RuntimeError(f"kvtier: pinned entry {op.key.name} vanished")
            extra.append(LoadOp(op.req_id, op.group, group_blocks[run_idx].block_id, op.key,
                                op.tier, slot))
        plan.loads.extend(extra)

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
                if n is None or n > done:
                    continue
                kind = kind_for(n, index, g.block_size)
                if (g.group, index, n) in tracked.saved:
                    continue
                tracked.saved.add((g.group, index, n))
                if kind is BlockKind.PARTIAL and not self.rt.config.store_partial:
                    continue
                if n % self.hash_unit or n // self.hash_unit > len(request.block_hashes):
                    continue
                fp = fp or self._fingerprint(self.tenant(request))
                key = self.key(request, fp, g, n)
                supersedes = None
                if kind is BlockKind.FULL:
                    supersedes = tracked.partial.pop((g.group, index), None)
                else:
                    tracked.partial[(g.group, index)] = key
                plan.saves.append(SaveOp(request.request_id, g.group, block.block_id, key,
                                         supersedes))
                self._remember(request, key, g)
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
            if block.is_null or (n is not None and n != tokens):
                continue
            kind = kind_for(tokens, (tokens - 1) // g.block_size, g.block_size)
            if kind is BlockKind.PARTIAL and not self.rt.config.store_partial:
                continue
            fp = fp or self._fingerprint(self.tenant(request))
            key = self.key(request, fp, g, tokens)
            plan.saves.append(SaveOp(request.request_id, g.group, block_id, key))
            self._remember(request, key, g)

    def _remember(self, request: RequestLike, key: BlockKey, g: GroupSpec) -> None:
        """Keep what the BlockStored events of ``key`` will need."""
        if key in self.event_info:
            self.event_info.move_to_end(key)
            return
        n = key.num_tokens
        unit = self.hash_unit
        if g.kind == MAMBA:
            info = EventInfo((), None, 0, MAMBA)  # placeholder shape, as vLLM announces state
        elif key.kind is BlockKind.FULL:
            start = n - g.block_size
            parent = bytes(request.block_hashes[start // unit - 1]) if start > 0 else None
            info = EventInfo(tuple(request.all_token_ids[start:n]), parent, g.block_size,
                             ATTENTION)
        else:
            start = n - unit
            parent = bytes(request.block_hashes[start // unit - 1]) if start > 0 else None
            info = EventInfo(tuple(request.all_token_ids[start:n]), parent, unit, ATTENTION)
        self.event_info[key] = info
        while len(self.event_info) > _EVENT_INFO_MAX:
            self.event_info.popitem(last=False)

    # ------------------------------------------------------------------ lifecycle
    def finished(self, req_id: str) -> None:
        self._tracked.pop(req_id, None)
        self._drop_pending(req_id)
        self._hit_tiers.pop(req_id, None)

    def preempted(self, req_id: str) -> None:
        """A preempted request resumes with new blocks: forget what was saved for it."""
        tracked = self._tracked.get(req_id)
        if tracked is not None:
            tracked.saved.clear()
            tracked.partial.clear()
            tracked.cursor.clear()
