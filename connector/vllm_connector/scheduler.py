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

It is two planners over one book (:mod:`connector.vllm_connector.slot_book`): the hit planner
(:mod:`connector.vllm_connector.hit_planner`: look-ups, holds, loads and fetches) and the
store planner (:mod:`connector.vllm_connector.store_planner`: saves and backfills); this
module applies the workers' reports to both and ends requests.
"""

from __future__ import annotations

from typing import Any

from connector.events.wire import Medium
from connector.vllm_connector.hit_planner import HitPlanner, whole_prompt_offer
from connector.vllm_connector.jobs import TierChange
from connector.vllm_connector.plan import WorkerReport
from connector.vllm_connector.slot_book import (
    ATTENTION,
    MAMBA,
    BlockLike,
    EventInfo,
    GroupSpec,
    RequestLike,
)
from connector.vllm_connector.store_planner import StorePlanner

__all__ = ["ATTENTION", "MAMBA", "BlockLike", "EventInfo", "GroupSpec", "RequestLike",
           "TieredScheduler", "whole_prompt_offer"]


class TieredScheduler(HitPlanner, StorePlanner):
    """Plans loads, fetches, saves and probes for one engine (all TP ranks at once): the hit
    planner and the store planner over one slot book, and what the workers report."""

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
        self.redis.announce_writes()

    # ------------------------------------------------------------------ lifecycle
    def finished(self, req_id: str) -> None:
        self._tracked.pop(req_id, None)
        self._drop_pending(req_id)
        self._asking.pop(req_id, None)
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
