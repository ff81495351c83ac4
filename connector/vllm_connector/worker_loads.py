"""A rank's loads: blocks written into vLLM's KV cache from CPU-tier slots, or straight from
the host tier's segment, once their fetches validated; a slot that does not hold its key
fails its load (vLLM recomputes it), never a wrong block.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from connector.vllm_connector.plan import FetchOp, LoadFrom, LoadOp, StepPlan
from connector.vllm_connector.worker_state import WorkerState, _by_group

log = logging.getLogger("connector.vllm_connector.worker")  # the worker half's log


class WorkerLoads(WorkerState):
    """Loads of one rank: scatter from slots or the host tier, failures, completion."""

    def start_step(self, plan: StepPlan) -> None:
        """Before the forward: probes and fetches go to the I/O threads, CPU loads run."""
        self.fence()  # the last step's saves have read their blocks and filled their slots
        if self._failed_now:
            self._failed_now = set()
        if plan.layout_known:
            self._send_layout = False
        if plan.backfills:
            self._backfill(plan.backfills)
        if self.transfer is None or not plan:
            return  # most steps: nothing to load, probe or fetch
        self._async.update(plan.async_reqs)
        now: list[LoadOp] = []
        for op in plan.loads:
            if op.after_fetch:
                self._waiting.setdefault(op.req_id, []).append(op)
            else:
                now.append(op)
        # CPU loads first: a fetch planned in the same step may reuse a slot they read.
        self._scatter(now)
        for probe in plan.probes:
            self._io.submit(self._probe, probe)
        by_req: dict[str, list[FetchOp]] = {}
        for op in plan.fetches:
            by_req.setdefault(op.req_id, []).append(op)
            if op.slot is not None:  # a slot the fetch refills: no key until it validated
                self.slot_keys[op.slot] = None
        for req_id, ops in by_req.items():
            self._fetching[req_id] = self._fetching.get(req_id, 0) + 1
            self._io.submit(self._fetch, req_id, ops, plan.idle)
        for req_id in plan.async_reqs:
            if req_id not in self._fetching:
                self._finish_recv(req_id)

    def _scatter(self, ops: list[LoadOp]) -> None:
        """Write blocks from their slots; a slot that does not hold its key fails its load."""
        assert self.transfer is not None
        self._scatter_host([op for op in ops if op.source is LoadFrom.HOST])
        ops = [op for op in ops if op.source is not LoadFrom.HOST]
        corrupt = self.config.debug_corrupt_loads
        for group, group_ops in _by_group(ops).items():
            good = [op for op in group_ops if self.slot_keys[op.slot] == op.key]
            for op in group_ops:
                if self.slot_keys[op.slot] != op.key:
                    self._fail_load(op, "slot does not hold the key")
            if not good:
                continue
            t0 = time.perf_counter_ns()
            try:
                moved = self.transfer.scatter(group, [o.block_id for o in good],
                                              [o.slot for o in good], corrupt=corrupt)
            except Exception:
                log.exception("kvtier: load into group %d failed; vLLM recomputes", group)
                for op in good:
                    self._fail_load(op, "copy failed")
                continue
            self.counters.add("bytes_loaded", moved)
            self.counters.add("load_us", (time.perf_counter_ns() - t0) // 1000)
            self.counters.add("blocks_loaded_cpu", sum(o.source is LoadFrom.SLOT for o in good))
            self.counters.add("blocks_loaded_redis",
                              sum(o.source is LoadFrom.FETCHED_SLOT for o in good))

    def _scatter_host(self, ops: list[LoadOp]) -> None:
        """Write blocks straight from the host tier's segment, where their fetch checked
        them; a shard whose slot was written again since (its seqlock moved) fails its
        load (vLLM recomputes it). Where the fetch copied the shard out and checked the copy
        (a weakly ordered CPU: :func:`seqlock_sound`), the block is written from that copy."""
        assert self.transfer is not None
        corrupt = self.config.debug_corrupt_loads
        for group, group_ops in _by_group(ops).items():
            checked = [(op, self._host_shards.get(op.req_id, {}).get(op.key)) for op in group_ops]
            for op, shard in checked:
                if shard is None:
                    self._fail_load(op, "its host-tier shard was not checked")
            by_segment: dict[int, list[tuple[LoadOp, tuple[Any, int, int]]]] = {}
            for op, shard in checked:
                if shard is not None:
                    by_segment.setdefault(id(shard[0]), []).append((op, shard))
            for pairs in by_segment.values():
                segment = pairs[0][1][0]
                slots = [shard[1] for _, shard in pairs]
                t0 = time.perf_counter_ns()
                try:
                    if isinstance(segment, np.ndarray):  # this rank's checked private copy
                        moved = self.transfer.scatter(group, [op.block_id for op, _ in pairs],
                                                      slots, corrupt=corrupt, source=segment)
                        same = [True] * len(pairs)
                    else:
                        pinned = self._segment_pins.pinned(segment)
                        moved = self.transfer.scatter(group, [op.block_id for op, _ in pairs],
                                                      slots, corrupt=corrupt,
                                                      source=segment.payloads,
                                                      source_pinned=pinned)
                        same = segment.unchanged(slots, [shard[2] for _, shard in pairs])
                except Exception:
                    log.exception("kvtier: load from the host tier into group %d failed; vLLM "
                                  "recomputes", group)
                    same = [False] * len(pairs)
                    moved = 0
                for (op, _), ok in zip(pairs, same, strict=True):
                    if not ok:
                        self._fail_load(op, "its host-tier slot was written during the load")
                good = sum(same)
                self.counters.add("bytes_loaded", moved * good // len(pairs))
                self.counters.add("load_us", (time.perf_counter_ns() - t0) // 1000)
                self.counters.add("blocks_loaded_host", good)

    def _fail_load(self, op: LoadOp, why: str) -> None:
        """An asynchronous load fails its request (``failed_recving``: hybrid models have no
        usable block ids); a synchronous one reports its block (single-group models only)."""
        log.warning("kvtier: load of %s for %s failed (%s); vLLM recomputes", op.key.name,
                    op.req_id, why)
        self._failed_now.add(op.req_id)
        if op.req_id in self._async:
            self._fetch_failed.add(op.req_id)
        else:
            self._load_errors.add(op.block_id)
        self.counters.add("load_errors")

    def _finish_recv(self, req_id: str) -> None:
        self._host_shards.pop(req_id, None)
        self._finished.add(req_id)
        self._async.discard(req_id)
        if req_id in self._fetch_failed:
            self._fetch_failed.discard(req_id)
            self._failed_recving.add(req_id)

    def _fetched(self, req_id: str, ops: list[FetchOp], oks: list[bool]) -> None:
        for op, ok in zip(ops, oks, strict=True):
            if op.slot is not None:
                self.slot_keys[op.slot] = op.key if ok else None
            self._report.fetches[op.job] = [int(ok), 1]
            if not ok:
                self._fetch_failed.add(req_id)
        self._fetching[req_id] -= 1
        if self._fetching[req_id]:
            return
        del self._fetching[req_id]
        if req_id not in self._fetch_failed and self.transfer is not None \
                and not self.transfer.attached:
            self._deferred_loads.append(req_id)  # asleep: written by restore()
            return
        waiting = self._waiting.pop(req_id, [])
        if req_id not in self._fetch_failed and self.transfer is not None:
            self._scatter(waiting)
        self._finish_recv(req_id)
