"""A rank's I/O threads and their results: probes and fetches (Redis or the host tier,
validated into slots), and what the main thread hands vLLM each step (transfer results,
load errors, the worker report).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from connector.vllm_connector.gil import short_switch_interval
from connector.vllm_connector.host import host_digest
from connector.vllm_connector.plan import FetchFrom, FetchOp, ProbeOp, WorkerReport
from connector.vllm_connector.worker_state import (
    FetchDone,
    ProbeDone,
    SaveDone,
    TailsSent,
    WorkerState,
    WriteDone,
)
from offload_tiers.shared_segment import seqlock_sound

log = logging.getLogger("connector.vllm_connector.worker")  # the worker half's log


class WorkerIO(WorkerState):
    """Probes, fetches and their collection; what goes back to vLLM."""

    def _probe(self, probe: ProbeOp) -> None:
        """Which save of each key this rank's Redis holds (0: none valid)."""
        ids: list[int | None] = [None] * len(probe.keys)
        try:
            if self.redis is not None:
                ids = self.redis.save_ids_many([self.storage_key(k) for k in probe.keys])
        except Exception:
            log.exception("kvtier: Redis probe failed")
        self._done.append(ProbeDone(probe.job, [i or 0 for i in ids]))

    def forward_starts(self) -> None:
        """A step with a forward begins: fetches on the compute cores leave them."""
        self._cores.forward_starts()

    def _fetch(self, req_id: str, ops: list[FetchOp], idle: bool = False) -> None:
        """Read values from Redis or the host tier straight into their slots, validated (I/O
        thread). ``idle``: planned in a step without a forward (the rank's compute cores
        are free: see :meth:`SpareCores.fetching`)."""
        from_redis = [op for op in ops if op.source is FetchFrom.REDIS]
        from_host = [op for op in ops if op.source is FetchFrom.HOST]
        oks = dict.fromkeys((op.job for op in ops), False)
        if idle and from_redis:
            self.counters.add("fetches_without_forward")
        t0 = time.perf_counter_ns()
        try:
            if self.redis is not None and from_redis:
                dests = [self.slab[op.slot, :self._nbytes(op.key.group)] for op in from_redis]
                with self._cores.fetching(idle), short_switch_interval():
                    # the GIL comes back sooner after each recv
                    got = self.redis.get_many_into(
                        [self.storage_key(op.key) for op in from_redis], dests,
                        save_ids=[op.save_id for op in from_redis])
                oks.update(zip((op.job for op in from_redis), got, strict=True))
        except Exception:
            log.exception("kvtier: fetching from Redis failed")
        t1 = time.perf_counter_ns()
        oks.update(self._read_host(from_host))
        self._count_fetched(from_redis, oks, "redis", t1 - t0)
        self._count_fetched(from_host, oks, "host", time.perf_counter_ns() - t1)
        self._done.append(FetchDone(req_id, ops, [oks[op.job] for op in ops]))

    def _count_fetched(self, ops: list[FetchOp], oks: dict[int, bool], tier: str,
                       elapsed_ns: int) -> None:
        """Bytes fetched (validated) from ``tier`` and the I/O thread's time on them."""
        if ops:
            self.counters.add(f"bytes_fetched_{tier}",
                              sum(self._nbytes(op.key.group) for op in ops if oks[op.job]))
            self.counters.add(f"fetch_us_{tier}", elapsed_ns // 1000)

    def _read_host(self, ops: list[FetchOp]) -> dict[int, bool]:
        """Check this rank's shards of ``ops``' keys in the host tier (I/O thread): only the
        exact saves the scheduler found, against each slot's header and the checksum of its
        bytes. Where the seqlock is sound (x86-64: :func:`seqlock_sound`) the check runs
        where the bytes lie and the loads copy them from there (the scheduler's pins keep
        the slots from reuse until every rank reported; the seqlock catches a write since).
        Elsewhere (aarch64) each shard is copied out into a private buffer and the checksum
        runs over the copy, in the same pass; the loads write from that copy. Job -> ok."""
        if not ops:
            return {}
        oks = dict.fromkeys((op.job for op in ops), False)
        segment = self.host.segment
        if segment is None:
            return oks
        fit = [op for op in ops if op.shards[self.tp_rank].length == self._nbytes(op.key.group)]
        try:
            where = [op.shards[self.tp_rank] for op in fit]
            slots = [w.slot for w in where]
            digests = [host_digest(self.storage_key(op.key)) for op in fit]
            save_ids = [w.save_id for w in where]
            checked: list[tuple[Any, int, int] | None]
            if seqlock_sound():
                seqs = segment.verify_many(slots, digests, save_ids, [w.length for w in where])
                checked = [None if seq is None else (segment, w.slot, seq)
                           for w, seq in zip(where, seqs, strict=True)]
            else:  # copy-then-checksum, into one private buffer per shard size
                rows: list[int] = []
                counts: dict[int, int] = {}
                for w in where:
                    rows.append(counts.get(w.length, 0))
                    counts[w.length] = rows[-1] + 1
                copies = {n: np.empty((k, n), dtype=np.uint8) for n, k in counts.items()}
                got = segment.read_many_into(
                    slots, digests, save_ids, next(iter(copies.values())) if len(copies) == 1
                    else [copies[w.length][row] for w, row in zip(where, rows, strict=True)])
                checked = [(copies[w.length], row, 0) if ok else None
                           for w, row, ok in zip(where, rows, got, strict=True)]
        except Exception:
            log.exception("kvtier: checking the host tier failed")
            return oks
        for op, shard in zip(fit, checked, strict=True):
            if shard is not None:
                self._host_shards.setdefault(op.req_id, {})[op.key] = shard
                oks[op.job] = True
        return oks

    def collect(self) -> None:
        """Main thread: apply what the I/O threads finished since the last call."""
        while self._done:
            match self._done.popleft():
                case ProbeDone(job, save_ids):
                    self._report.probes[job] = (save_ids, 1)
                case FetchDone(req_id, ops, oks):
                    self._fetched(req_id, ops, oks)
                case SaveDone(job, counts):
                    self._report.saves[job] = counts
                case TailsSent(req_ids):
                    self._finished_sending.update(req_ids)
                case WriteDone(kind, job, ok, nbytes):
                    self._report.saves[job] = [int(ok), 1, 0]
                    assert self.redis is not None  # only a store reports writes
                    written, written_bytes, failed = self.redis.write_counters(kind)
                    if ok:
                        self.counters.add(written)
                        if written_bytes is not None:
                            self.counters.add(written_bytes, nbytes)
                    else:
                        for name in failed:
                            self.counters.add(name)

    def take_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """Requests done receiving (failed ones included), the failed ones, and finished
        requests whose partial tails were copied (done sending)."""
        self.collect()
        done, failed, sent = self._finished, self._failed_recving, self._finished_sending
        self._finished, self._failed_recving, self._finished_sending = set(), set(), set()
        return done, failed, sent

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_report(self) -> WorkerReport:
        self.collect()
        report = self._report  # kept (empty) for the next step when nothing is in it
        if self._send_layout and self.layout is not None:
            report.rank0_layout = self.layout.descriptor()
        if self._host_tier_configured:
            self.counters.set_gauge("host_tier_available", int(self.host.available))
        if self.redis is not None:
            up = int(bool(self.redis.available))
            if up != self._redis_up_sent:
                report.redis_up[self.tp_rank] = self._redis_up_sent = up
                self.counters.set_gauge("redis_available", up)
            self._follow_redis_events()
        if report:
            self._report = WorkerReport()
        return report

    def _follow_redis_events(self) -> None:
        """Mirror the Redis tier's outage/recovery counts into the connector's counters
        (read only when they moved: this runs every step)."""
        serial = self.redis.events_serial
        if serial == self._redis_events_serial:
            return
        self._redis_events_serial = serial
        st = self.redis.counts()
        for name, ours in (("unavailable_events", "redis_unavailable_events"),
                           ("recoveries", "redis_recoveries"),
                           ("corrupt", "redis_corrupt_values"),
                           ("corrupt_deleted", "redis_corrupt_deleted"),
                           ("stale_saves", "redis_stale_saves")):
            seen = self._redis_seen.get(name, 0)
            now = int(st.get(name, 0))
            if now > seen:
                self.counters.add(ours, now - seen)
                self._redis_seen[name] = now
