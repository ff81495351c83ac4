"""The store planner: what each step saves (attention blocks as they fill, partial entries,
Mamba states at vLLM's hand-offs, a finishing request's partial tails), where (a CPU-tier
slot, the host tier, Redis), and what a backfill writes once Redis answers again.
"""

from __future__ import annotations

from collections.abc import Sequence

from connector.events.wire import Medium
from connector.vllm_connector.jobs import SlotJob, TierChange
from connector.vllm_connector.plan import BACKFILL_REQ, SaveOp, StepPlan
from connector.vllm_connector.slot_book import (
    MAMBA,
    BlockLike,
    GroupSpec,
    RequestLike,
    SlotBook,
    _Tracked,
)
from offload_tiers.codec import new_save_id
from offload_tiers.keys import BlockKey, BlockKind, kind_for


class StorePlanner(SlotBook):
    """The saves of one engine's steps (all TP ranks at once)."""

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
            slot = self.directory.pin_for_copy(key)
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
            # through a buffer of the worker's own (no slot), bounded by its write queue.
            self.counters.add("overflow_saves")
            job = self.jobs.open_save(key, None, request.request_id, mark, True)
            plan.saves.append(SaveOp(job, request.request_id, g.group, block_id, None, key,
                                     True, new_save_id()))
            self._remember(request, key, g)
            return
        if slot is None:
            self.counters.add("store_drops")
            if mark is not None:
                self._tracked[request.request_id].saved.discard(mark)
            return
        self.directory.commit(key)
        if to_redis:
            self.directory.pin_for_copy(key)
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

    def _save_done(self, info: SlotJob, all_ok: bool) -> None:
        key = info.key
        backfilled = info.req_id == BACKFILL_REQ
        backfill = self.redis.backfill
        if backfilled and backfill is not None:
            backfill.answered()
        if info.to_redis and info.slot is not None:
            self._unpin_copy(key)
        if not all_ok:
            # A rank could not copy the block: its slot is not trusted.
            if info.gather_failed and self.directory.remove(key):
                self.counters.add("store_drops")
                self.outbox.append(TierChange(key, Medium.CPU, stored=False))
            elif (info.to_redis and info.slot is not None and not backfilled
                  and backfill is not None):
                backfill.note(key)  # copied, but not written to Redis: later
            tracked = self._tracked.get(info.req_id)
            if tracked is not None and info.mark is not None:
                tracked.saved.discard(info.mark)
                tracked.cursor.pop(info.mark[0], None)
            return
        if info.to_redis:
            self.redis.wrote(key)

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
