"""A rank's saves: blocks gathered into their CPU-tier slots (on the saver thread, off the
step, on the CPU), copied into the host tier, handed to the remote store, and backfilled.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures

import numpy as np
import torch

from connector.vllm_connector.host import host_digest
from connector.vllm_connector.plan import SaveOp, StepPlan
from connector.vllm_connector.remote_store import (
    PendingSave,
)
from connector.vllm_connector.worker_state import TailsSent, WorkerState, _by_group
from offload_tiers.host_tier.client import SlotLease
from offload_tiers.host_tier.client import new_save_id as new_host_save_id
from offload_tiers.host_tier.protocol import RedisWrite
from offload_tiers.keys import BlockKind

log = logging.getLogger("connector.vllm_connector.worker")  # the worker half's log


class WorkerSaves(WorkerState):
    """Saves of one rank: gather, host-tier copies and commits, Redis hand-over."""

    def save(self, plan: StepPlan) -> None:
        """After the forward: copy blocks into their slots, then hand them to Redis.

        On the CPU the copies run on the saver thread, off the step (its output goes back to
        the scheduler without waiting for them); :meth:`fence`, before anything of the next
        step can write a KV block, waits for them. Finished requests' tails are reported
        sent (their blocks may go) once copied.
        """
        if not plan.saves and not plan.tail_reqs:
            return
        keep = self._claim(plan)
        if self._saver is None or self.closed or not keep:
            self._copy_kept(keep)
            self._finished_sending.update(plan.tail_reqs)
            return
        gathered = self._gathered = threading.Event()
        self._saver_tail = self._saver.submit(self._copy_off_step, keep, list(plan.tail_reqs),
                                              gathered)

    def flush_redis(self, timeout_s: float | None = None) -> bool:
        """Every save handed over so far has its Redis outcome (written or failed): the
        saver's hand-offs are done and the writer's queue is drained; False on timeout."""
        tail = self._saver_tail
        if tail is not None:
            try:
                tail.result(timeout_s)
            except TimeoutError:
                return False
        return self.redis is None or self.redis.flush(timeout_s)

    def fence(self) -> None:
        """Wait until the saves handed to the saver thread have read their blocks into
        their slots: vLLM calls it (``handle_preemptions``) before a step can write any KV
        block, and every step's loads run after it. Their hand-off to Redis may still run
        (the slots stay pinned until written), except with ``write_mode: through``.
        A wait is counted (``save_fence_waits``, ``save_fence_wait_us``): it is time the
        step spends on the previous step's copies."""
        gathered = self._gathered
        if gathered is None:
            return
        done = gathered.is_set()
        self._gathered = None
        if done:
            return
        t0 = time.perf_counter_ns()
        gathered.wait()
        self.counters.add("save_fence_waits")
        self.counters.add("save_fence_wait_us", (time.perf_counter_ns() - t0) // 1000)

    def _copy_off_step(self, keep: list[SaveOp], tails: list[str],
                       gathered: threading.Event) -> None:
        through = self.config.write_mode == "through"
        read = False

        def blocks_read() -> None:
            nonlocal read
            read = True
            self._done.append(TailsSent(tails))  # finished requests' blocks may go now
            if not through:
                gathered.set()

        try:
            self._copy_kept(keep, blocks_read)
        except Exception:
            # A bug (copy failures are reported where they happen). Its saves stay open,
            # their slots pinned: reporting them here could report a job twice, and a rank
            # counted twice could let a slot go while another rank's writer still reads it.
            log.exception("kvtier: saving blocks off the step failed; their slots stay held")
        finally:
            if not read:
                self._done.append(TailsSent(tails))
            gathered.set()

    def _claim(self, plan: StepPlan) -> list[SaveOp]:
        """The saves to copy (main thread: slot books, and the saves that are not made)."""
        if not plan.saves:
            return []
        if self.transfer is None:
            for op in plan.saves:
                self._report_save(op.job, ok=False, gathered=False)
            return []
        # A slot given twice in one plan (a small tier evicting this step's own saves) keeps
        # the scheduler's last choice; the earlier save is gone from its books already.
        last = {op.slot: op for op in plan.saves if op.slot is not None}
        keep: list[SaveOp] = []
        for op in plan.saves:
            if op.slot is not None and last[op.slot] is not op:
                self._report_save(op.job, ok=True, gathered=True)
            elif op.req_id in self._failed_now:
                # Computed over a context that failed to load here. Other ranks may not know
                # (with TP their shards are bad too): this rank writes no shard of this save,
                # so no reader can ever assemble it (shards are served only as one save).
                self.counters.add("saves_skipped_after_failed_load")
                if op.slot is not None:
                    self.slot_keys[op.slot] = None
                self._report_save(op.job, ok=False, gathered=False)
            else:
                if op.slot is not None:
                    self.slot_keys[op.slot] = None
                keep.append(op)
        return keep

    def _copy_kept(self, keep: list[SaveOp],
                   blocks_read: Callable[[], None] | None = None) -> None:
        """Gather the kept saves into their slots and on to the host tier (then
        ``blocks_read()``: no KV block is read after it), then hand them to Redis."""
        handed: list[tuple[int, list[SaveOp], np.ndarray | None, set[int]]] = []
        for group, ops in _by_group(keep).items():
            slotted = [op for op in ops if op.slot is not None]
            if slotted and self._gather(group, slotted, None):
                for op in slotted:
                    self.slot_keys[op.slot] = op.key
                    if not op.to_redis:  # in this engine's tier now: nothing else to wait for
                        self._report_save(op.job, ok=True, gathered=True)
                # on CUDA the host tier's copy reads the KV blocks themselves
                hosted = self._to_host(group, [op for op in slotted if op.to_host])
                handed.append((group, slotted, None, hosted))
            overflow = [op for op in ops if op.slot is None]  # no CPU-tier slot
            if overflow:
                # Rows of a buffer of this step's own; the Redis writer keeps it alive.
                try:
                    buf = np.empty((len(overflow), self._nbytes(group)), dtype=np.uint8)
                except MemoryError:
                    log.warning("kvtier: no memory for %d overflow saves; dropped", len(overflow))
                    for op in overflow:
                        self._report_save(op.job, ok=False, gathered=False)
                    self.counters.add("store_drops", len(overflow))
                    continue
                if self._gather(group, overflow, buf):
                    handed.append((group, overflow, buf, set()))
        if blocks_read is not None:
            blocks_read()
        for group, ops, buf, hosted in handed:
            if buf is None:
                self._to_redis([(op, memoryview(self.slab[op.slot, :self._nbytes(group)]))
                                for op in ops], hosted)
            else:
                self._to_redis([(op, memoryview(buf[i])) for i, op in enumerate(ops)], hosted)

    def _gather(self, group: int, ops: list[SaveOp], buf: np.ndarray | None) -> bool:
        assert self.transfer is not None
        try:
            if buf is None:
                moved = self.transfer.gather(group, [op.block_id for op in ops],
                                             [op.slot for op in ops])
            else:
                moved = self.transfer.gather(group, [op.block_id for op in ops],
                                             list(range(len(ops))), dest=torch.from_numpy(buf))
        except Exception:
            log.exception("kvtier: gathering blocks into the CPU tier failed")
            for op in ops:
                self._report_save(op.job, ok=False, gathered=False)
            self.counters.add("store_drops", len(ops))
            return False
        self.counters.add("bytes_saved_cpu", moved)
        self.counters.add("blocks_saved", len(ops))
        self.counters.add("partial_blocks_saved",
                          sum(op.key.kind is BlockKind.PARTIAL for op in ops))
        return True

    def _to_host(self, group: int, ops: list[SaveOp]) -> set[int]:
        """Copy saved blocks from their CPU-tier slots into leased host-tier slots (in the
        step: the slot may be reused by a later step); the checksums and the commit run on
        an I/O thread. A save with no leased slot at hand is not offered (counted). The
        jobs of the saves offered."""
        if not ops:
            return set()
        nbytes = self._nbytes(group)
        known = self.host.segment
        lease = self.host.take_slots(len(ops) if known is not None
                                     and nbytes <= known.slot_bytes else 0)
        segment, slots = lease.segment, list(lease.slots)
        self.counters.add("host_store_drops", len(ops) - len(slots))
        if not slots or segment is None or nbytes > segment.slot_bytes:
            self.host.abandon(lease)
            return set()
        ops = ops[:len(slots)]
        for slot in slots:
            segment.begin_write(slot)
        assert self.transfer is not None
        try:
            if self.transfer.device.type == "cuda":
                # straight from the KV tensors: one DMA per slot into the page-locked
                # segment (a host memcpy from the slab would hold the step at memcpy speed)
                pinned = self._segment_pins.pinned(segment)
                self.transfer.gather(group, [op.block_id for op in ops], slots,
                                     dest=torch.from_numpy(segment.payloads), dest_pinned=pinned)
            else:
                segment.payloads[slots, :nbytes] = self.slab[[op.slot for op in ops], :nbytes]
        except Exception:
            log.exception("kvtier: copying saves into the host tier failed; not offered")
            for slot in slots:
                segment.invalidate(slot)
            self.host.abandon(lease)  # given back now, not when this process exits
            self.counters.add("host_store_drops", len(ops))
            return set()
        future = self._io.submit(self._commit_host, lease, ops, nbytes)
        self._host_commits.add(future)
        future.add_done_callback(self._host_commits.discard)
        return {op.job for op in ops}

    def flush_host(self, timeout_s: float) -> bool:
        """Wait until every host-tier write begun so far is committed (and its commit
        queued to the daemon); False on timeout."""
        _, not_done = futures.wait(list(self._host_commits), timeout=timeout_s)
        return not not_done

    def _commit_host(self, lease: SlotLease, ops: list[SaveOp], nbytes: int) -> None:
        """Checksum and publish host-tier writes begun in the step (I/O thread), each
        under its save's id (every TP rank's shard of one save carries the same); a slot
        whose commit failed is given back. A lease of an earlier daemon run is dropped
        by the client (its slots may be someone else's in the new run)."""
        assert lease.segment is not None
        segment = lease.segment
        saves = []
        behind: list[RedisWrite | None] = []  # where the daemon writes each behind to Redis
        try:
            for op, slot in zip(ops, lease.slots, strict=False):
                key = self.storage_key(op.key)
                d = host_digest(key)
                save_id = op.save_id or new_host_save_id()
                segment.commit_write(slot, d, save_id, nbytes)
                saves.append((d, slot, save_id, nbytes))
                behind.append(self.redis.host_commit_note(key, op.save_id, self.tp_rank == 0)
                              if op.to_redis and self.redis is not None else None)
        except Exception:
            log.exception("kvtier: committing host-tier writes failed")
        self.host.commit(lease, saves, behind[:len(saves)] if any(behind) else None)
        self.counters.add("blocks_written_host", len(saves))

    def _to_redis(self, items: list[tuple[SaveOp, memoryview]], hosted: set[int]) -> None:
        """Hand the saves for Redis to the remote store (``hosted``: saves whose host-tier
        commits name their Redis keys, for a store that writes through the daemon). Saves
        not for Redis were reported gathered."""
        remote = [PendingSave(op.job, self.storage_key(op.key), view, op.save_id,
                              op.job in hosted) for op, view in items if op.to_redis]
        if not remote:
            return
        if self.redis is None or not self.redis.available:
            self.counters.add("redis_unavailable_steps")
            for save in remote:
                self._report_save(save.job, ok=False, gathered=True)
            self.counters.add("store_drops", len(remote))
            self.counters.add("redis_write_failures", len(remote))
            return
        self.redis.write(remote, self._on_written("write"))

    def _backfill(self, ops: list[SaveOp]) -> None:
        """Hand entries that never reached Redis to its writer, from their slots (the last
        step's saves are in them: :meth:`fence` ran). A slot that does not hold its key on
        this rank fails its op as a failed copy: the scheduler drops the entry."""
        if self.redis is None or not self.redis.backfills:
            for op in ops:
                self._report_save(op.job, ok=False, gathered=True)
            self.counters.add("redis_backfill_failures", len(ops))
            return
        saves = []
        for op in ops:
            if self.transfer is None or op.slot is None or self.slot_keys[op.slot] != op.key:
                self._report_save(op.job, ok=False, gathered=False)
                self.counters.add("redis_backfill_failures")
                continue
            view = memoryview(self.slab[op.slot, :self._nbytes(op.group)])
            saves.append(PendingSave(op.job, self.storage_key(op.key), view, op.save_id))
        if saves:
            self.redis.write(saves, self._on_written("backfill"))  # refusals answer at once
