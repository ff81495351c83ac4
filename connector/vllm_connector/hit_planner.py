"""The hit planner: what to load, the longest prefix the tiers supply (a look-up, the
hold on what it found, the loads and fetches once vLLM allocated blocks, the hit counted
when every fetch is back).

Rules (see docs/connector.md): a hit is a run of FULL attention blocks, optionally ended by
one PARTIAL entry; every group must be restorable at the hit's end (attention blocks for
every attention group, the recurrent state for every Mamba group) or the hit is rounded down
to the longest end where it is. Fullness comes from ``block_hash_num_tokens`` only. A key
held only in Redis is asked about asynchronously (the lookup answers ``None``, "ask again",
until the workers' probe is back) and restored as an asynchronous load.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from connector.vllm_connector.jobs import SlotJob
from connector.vllm_connector.plan import LoadFrom, LoadOp
from connector.vllm_connector.secondary import (
    ASK,
    Held,
    HitSource,
    SecondaryTier,
    TierLookup,
)
from connector.vllm_connector.slot_book import BlockLike, RequestLike, SlotBook, _Tracked
from offload_tiers.keys import BlockKey

log = logging.getLogger("connector.vllm_connector.scheduler")  # the scheduler half's log


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


def whole_prompt_offer(end: int, num_tokens: int) -> int:
    """The hit length to give vLLM for a hit ending at ``end``.

    vLLM (0.32) accepts an external hit of at most ``num_tokens - 1`` tokens (a hit of the
    whole prompt leaves nothing to schedule), so a whole-prompt hit is offered one token
    short; the last token is recomputed, as vLLM does after an asynchronous whole-prompt load.
    """
    return min(end, num_tokens - 1)


class HitPlanner(SlotBook):
    """Look-ups, holds, loads and fetches of one engine (all TP ranks at once)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: dict[str, _Lookup] = {}
        self._hit_tiers: dict[str, dict[str, int]] = {}
        self._restoring: dict[str, _Restore] = {}
        self._fetching: dict[int, SecondaryTier] = {}  # fetch job -> the tier it reads
        # Requests whose last look-up answered "ask again": what it was asked with
        # (computed tokens, hash units, fingerprint). Asked again with the same, while a
        # tier still waits on an answer, the look-up answers so without walking the prompt.
        self._asking: dict[str, tuple[int, int, str]] = {}

    def lookup(self, request: RequestLike, num_computed: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed`` every group can restore, and whether the load is
        asynchronous; ``(None, False)`` while a Redis probe for this request is out.

        The hit's CPU entries are pinned and its Redis entries get reserved slots until the
        plan that loads them, so a load cannot lose its source.

        Asked again while nothing it was asked with changed and a tier still waits on an
        answer for it (a probe out), it answers "ask again" at once: vLLM asks every step
        while a probe is out, and walking a long prompt's keys each time held the step
        (about 0.6 ms per 1,000-token prompt on this machine's CPU).
        """
        req_id = request.request_id
        self._drop_pending(req_id)
        if not self.supported:
            return 0, False
        fp = self._fingerprint(self.tenant(request))
        asked_with = (num_computed, len(request.block_hashes), fp)
        if self._asking.pop(req_id, None) == asked_with and any(
                tier.asks_again(req_id) for tier in self.chain):
            self._asking[req_id] = asked_with
            return None, False
        # Attention-only models may restore the whole prompt (vLLM then recomputes only the
        # last token). With a Mamba group the hit must end where a state was saved, at most
        # num_tokens - 1 (the state at the prompt end already contains the last token).
        limit = request.num_tokens if not self.mamba else request.num_tokens - 1
        max_end = min(limit, len(request.block_hashes) * self.hash_unit)
        if max_end - num_computed < self.hash_unit:
            return 0, False
        ends = list(range(num_computed + self.hash_unit, max_end + 1, self.hash_unit))
        lookups = [tier.lookup(req_id) for tier in self.chain]
        reach = self._reach(request, fp, ends, lookups)
        ends = ends[:len(reach.prefix)]
        for index, (tier, asked) in enumerate(zip(self.chain, lookups, strict=True)):
            found = asked.settle(reach.asked.get(index, []))
            if found is None:
                self._asking[req_id] = asked_with
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
                                           need.key,
                                           LoadFrom.SLOT if tier is None else tier.load_from))
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

    def _fetch_done(self, job: int, info: SlotJob, all_ok: bool) -> None:
        self._restore_progress(info.req_id, job, all_ok)
        self._fetching.pop(job).fetched(job, info.key, all_ok)
