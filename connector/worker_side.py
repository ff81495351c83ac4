"""The worker half: owns the tiers, copies blocks between vLLM's KV cache and them.

``TierRuntime`` is what the two halves share inside one process: the CPU tier (created once
the worker knows the slot size from the KV tensors), the Redis tier, the counters and an
outbox of tier changes from which the scheduler half builds vLLM's KV events.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from connector.connector_config import TieredConfig
from connector.connector_metadata import TIER_CPU, TIER_REDIS, LoadOp, SaveOp, StepPlan
from connector.connector_stats import ConnectorCounters
from connector.kv_layout import KVLayout, build_layout
from connector.transfer import BlockTransfer
from offload_tiers.cpu_tier import CpuTier
from offload_tiers.keys import BlockKey, BlockKind

log = logging.getLogger(__name__)

MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


@dataclass(frozen=True, slots=True)
class TierChange:
    """An entry appeared in (stored=True) or left (stored=False) a tier."""

    key: BlockKey
    medium: str
    stored: bool


class TierRuntime:
    """The tiers and bookkeeping shared by the scheduler and worker halves of one engine."""

    def __init__(self, config: TieredConfig) -> None:
        self.config = config
        self.counters = ConnectorCounters()
        self.outbox: deque[TierChange] = deque()
        self.cpu: CpuTier | None = None
        self.layout: KVLayout | None = None
        self.redis: Any = None
        self.closed = False
        self.on_close: list[Any] = []
        self._final_cpu_stats: dict[str, Any] | None = None
        self._lock = threading.Lock()
        if config.redis_url:
            from offload_tiers.redis_tier import RedisTier

            self.redis = RedisTier.from_url(
                config.redis_url, prefix=config.redis_prefix, ttl_s=config.redis_ttl_s,
                socket_timeout_s=config.redis_timeout_s,
                ssl_ca_certs=config.redis_ssl_ca_certs,
            )
            self.counters.set_gauge("redis_configured", 1)
            if not self.redis.available:
                log.warning("kvtier: Redis at %s is not answering (%s); serving from the CPU "
                            "tier until it does", self.redis.target.redacted,
                            self.redis.last_error)
        self.refresh_redis_gauge()

    def attach_cpu(self, layout: KVLayout) -> None:
        """Create the CPU tier sized for ``layout``'s slots."""
        self.layout = layout
        slot_bytes = layout.slot_bytes
        if self.config.cpu_bytes < slot_bytes:
            raise ValueError(
                f"cpu_bytes={self.config.cpu_bytes} holds no block of {slot_bytes} bytes. "
                f"Fix: set cpu_bytes >= {slot_bytes}"
            )
        self.cpu = CpuTier(self.config.cpu_bytes, slot_bytes, on_evict=self._on_evict)

    def _on_evict(self, key: BlockKey, _view: memoryview) -> None:
        self.outbox.append(TierChange(key, MEDIUM_CPU, stored=False))

    def redis_available(self) -> bool:
        return self.redis is not None and bool(self.redis.available)

    def refresh_redis_gauge(self) -> bool:
        up = self.redis_available()
        self.counters.set_gauge("redis_available", int(up))
        return up

    def stats(self) -> dict[str, Any]:
        """Cumulative counters plus each tier's own stats."""
        out: dict[str, Any] = dict(self.counters.snapshot())
        out["redis_available"] = int(self.redis_available())
        if self.cpu is not None:
            out["cpu_tier"] = self.cpu.stats()
        elif self._final_cpu_stats is not None:
            out["cpu_tier"] = self._final_cpu_stats
        if self.redis is not None:
            out["redis_tier"] = self.redis.stats()
        return out

    def close(self) -> None:
        """Flush and close Redis, free the CPU slab; counters stay readable. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.redis is not None:
            self.redis.close(timeout=2.0)
        if self.cpu is not None:
            self._final_cpu_stats = self.cpu.stats()
            self.cpu = None
        for callback in self.on_close:
            callback()


class TieredWorker:
    """Registers the KV tensors; executes each step's loads (before) and saves (after)."""

    def __init__(self, runtime: TierRuntime) -> None:
        self.runtime = runtime
        self.transfer: BlockTransfer | None = None
        self._load_errors: set[int] = set()
        self._finished_recving: set[str] = set()
        self._counted_unavailable = False  # this step's redis_unavailable_steps is counted

    def register(self, kv_caches: dict[str, Any], groups: list[tuple[int, str, int, list[str]]],
                 num_blocks: int) -> KVLayout:
        layout = build_layout(kv_caches, groups, num_blocks)
        self.runtime.attach_cpu(layout)
        assert self.runtime.cpu is not None
        self.transfer = BlockTransfer(kv_caches, layout, self.runtime.cpu.slab)
        self.runtime.on_close.append(self._drop_transfer)
        return layout

    def _drop_transfer(self) -> None:
        self.transfer = None  # releases the slab and the KV tensors

    # ------------------------------------------------------------------ loads
    def load(self, plan: StepPlan) -> None:
        """Write every planned block from its pinned CPU slot, then unpin.

        A failed copy is remembered for ``take_load_errors`` (vLLM then recomputes those
        blocks); it never leaves a block half-used without saying so.
        """
        # Asynchronous loads are done once this returns (copied now, or failed and reported).
        self._finished_recving.update(plan.async_reqs)
        if not plan.loads or self.transfer is None:
            return
        rt = self.runtime
        assert rt.cpu is not None
        corrupt = rt.config.debug_corrupt_loads
        for group, ops in _by_group(plan.loads).items():
            try:
                moved = self.transfer.scatter(group, [o.block_id for o in ops],
                                              [o.slot for o in ops], corrupt=corrupt)
            except Exception:
                log.exception("kvtier: load into group %d failed; vLLM recomputes", group)
                self._fail(ops)
                continue
            finally:
                for op in ops:
                    try:
                        rt.cpu.release(op.key)
                    except KeyError:
                        log.warning("kvtier: slot of %s was not pinned", op.key.name)
            rt.counters.add("bytes_loaded", moved)
            rt.counters.add("blocks_loaded_cpu", sum(o.tier == TIER_CPU for o in ops))
            rt.counters.add("blocks_loaded_redis", sum(o.tier == TIER_REDIS for o in ops))

    def _fail(self, ops: list[LoadOp]) -> None:
        self._load_errors.update(op.block_id for op in ops)
        self.runtime.counters.add("load_errors", len(ops))

    def take_finished_recving(self) -> set[str]:
        """Requests whose asynchronous loads ran since the last call."""
        done, self._finished_recving = self._finished_recving, set()
        return done

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ------------------------------------------------------------------ saves
    def save(self, plan: StepPlan) -> None:
        """Copy planned blocks into CPU slots, then write them to Redis.

        A step may save more blocks than the CPU tier has slots (a batched prefill into a
        small tier): a reserved slot cannot be evicted until it is committed, so the saves
        go in chunks — reserve until the tier is out of slots, gather, commit and write that
        chunk to Redis, then go on (the committed entries are evictable again). Only a block
        that finds no slot even then (every slot pinned by loads) is dropped.
        """
        if not plan.saves or self.transfer is None:
            return
        rt = self.runtime
        assert rt.cpu is not None
        self._counted_unavailable = False
        reserved: list[tuple[SaveOp, int]] = []
        for op in plan.saves:
            if rt.cpu.contains(op.key):
                continue
            nbytes = self.transfer.group(op.group).nbytes
            slot = rt.cpu.reserve(op.key, nbytes)
            if slot is None and reserved:
                self._save_chunk(reserved)
                reserved = []
                slot = rt.cpu.reserve(op.key, nbytes)
            if slot is None:
                rt.counters.add("store_drops")
                continue
            reserved.append((op, slot))
        if reserved:
            self._save_chunk(reserved)

    def _save_chunk(self, reserved: list[tuple[SaveOp, int]]) -> None:
        """Gather reserved blocks into their slots, commit them, then write them to Redis."""
        rt = self.runtime
        assert rt.cpu is not None and self.transfer is not None
        committed: list[tuple[SaveOp, int]] = []
        for group, items in _by_group_pairs(reserved).items():
            try:
                moved = self.transfer.gather(group, [op.block_id for op, _ in items],
                                             [slot for _, slot in items])
            except Exception:
                log.exception("kvtier: gathering blocks into the CPU tier failed")
                for op, _ in items:
                    rt.cpu.abort(op.key)
                rt.counters.add("store_drops", len(items))
                continue
            rt.counters.add("bytes_saved_cpu", moved)
            for op, slot in items:
                rt.cpu.commit(op.key)
                committed.append((op, slot))
                rt.outbox.append(TierChange(op.key, MEDIUM_CPU, stored=True))
                rt.counters.add("blocks_saved")
                if op.key.kind is BlockKind.PARTIAL:
                    rt.counters.add("partial_blocks_saved")
                if op.supersedes is not None and rt.cpu.remove(op.supersedes):
                    rt.outbox.append(TierChange(op.supersedes, MEDIUM_CPU, stored=False))
                    rt.counters.add("promotions")
        if rt.redis is not None and committed:
            self._write_redis(committed)

    def _write_redis(self, committed: list[tuple[SaveOp, int]]) -> None:
        rt = self.runtime
        assert rt.cpu is not None
        if not rt.refresh_redis_gauge():
            rt.counters.add("store_drops", len(committed))
            rt.counters.add("redis_write_failures", len(committed))
            if not self._counted_unavailable:  # once per step, however many chunks
                rt.counters.add("redis_unavailable_steps")
                self._counted_unavailable = True
            return
        superseded = [op.supersedes for op, _ in committed if op.supersedes is not None]
        if rt.config.write_mode == "through":
            items = [(op.key, bytes(rt.cpu.view(slot))) for op, slot in committed]
            stored = rt.redis.put_many(items)
            nbytes = sum(len(p) for _, p in items)
            if stored == len(items):
                rt.counters.add("blocks_written_redis", stored)
                rt.counters.add("bytes_written_redis", nbytes)
                for op, _ in committed:
                    rt.outbox.append(TierChange(op.key, MEDIUM_STORAGE, stored=True))
            else:
                # Which ones landed is unknown: announce none (never over-announce).
                rt.counters.add("redis_write_failures", len(items) - stored)
                rt.counters.add("store_drops", len(items) - stored)
        else:
            for op, slot in committed:
                self._submit(op.key, bytes(rt.cpu.view(slot)))
        if superseded and rt.redis_available():
            rt.redis.delete_many(superseded)
            for key in superseded:
                rt.outbox.append(TierChange(key, MEDIUM_STORAGE, stored=False))

    def _submit(self, key: BlockKey, payload: bytes) -> None:
        rt = self.runtime

        def done(ok: bool) -> None:
            if ok:
                rt.counters.add("blocks_written_redis")
                rt.counters.add("bytes_written_redis", len(payload))
                rt.outbox.append(TierChange(key, MEDIUM_STORAGE, stored=True))
            else:
                rt.counters.add("redis_write_failures")
                rt.counters.add("store_drops")

        rt.redis.submit_put(key, payload, on_done=done)


def _by_group(ops: list[LoadOp]) -> dict[int, list[LoadOp]]:
    out: dict[int, list[LoadOp]] = {}
    for op in ops:
        out.setdefault(op.group, []).append(op)
    return out


def _by_group_pairs(items: list[tuple[SaveOp, int]]) -> dict[int, list[tuple[SaveOp, int]]]:
    out: dict[int, list[tuple[SaveOp, int]]] = {}
    for op, slot in items:
        out.setdefault(op.group, []).append((op, slot))
    return out
