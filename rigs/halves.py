"""kvtier's two halves wired together in one process, the way vLLM wires them (no vLLM).

One :class:`TieredScheduler` (vLLM's engine-core process; with ``presence=True`` its presence
summary's feed thread reads the real Redis, as in an engine) and ``tp_size`` :class:`TieredWorker`
(one per TP rank, each with its own CPU KV tensors and, when ``redis_url`` is set, its own
real :class:`RedisTier` built as the connector builds it: ``open_remote_store``). A step is:

    plan = scheduler.plan(...)            # build_connector_meta
    worker.start_step(plan)  (each rank)  # start_load_kv
    worker.save(plan)        (each rank)  # wait_for_save, after the forward
    reports, merged with WorkerReport.merge  -> scheduler.on_report (update_connector_output)

The halves share nothing but the plan and the reports. Waiting for the workers' I/O threads
and Redis write-behind is polling with a deadline until every job of the plans sent so far is
reported by every rank (a job never reported is a ``TimeoutError`` naming it).

Transfer results are combined as vLLM's output aggregator does: a request has finished
receiving once every rank said so; it failed when any rank said so.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from connector.identity.engine import EngineIdentity
from connector.identity.generation import Generation
from connector.vllm_connector.config import TieredConfig
from connector.vllm_connector.host import HostTierMirror
from connector.vllm_connector.host import connect as host_connect
from connector.vllm_connector.layout import build_layout
from connector.vllm_connector.plan import StepPlan, WorkerReport
from connector.vllm_connector.presence import presence_source
from connector.vllm_connector.remote_store import OwnRedis
from connector.vllm_connector.remote_store_factory import open_remote_store
from connector.vllm_connector.scheduler import ATTENTION, MAMBA, GroupSpec, TieredScheduler
from connector.vllm_connector.slot_sizing import slot_count
from connector.vllm_connector.worker import TieredWorker
from offload_tiers.keys import BlockKey
from rigs.sched_doubles import Blk, Req

BS = 32
LLAMA = [GroupSpec(0, ATTENTION, BS)]
HYBRID = [GroupSpec(0, MAMBA, 64), GroupSpec(1, ATTENTION, 64)]
MAMBA_BYTES = 300


def identity(groups: Sequence[GroupSpec], tp_size: int, **fields: Any) -> EngineIdentity:
    """An engine identity for the tiny stand-in model (fields override the defaults)."""
    base: dict[str, Any] = dict(
        model="tiny", revision="", weights_version="", checkpoint="unresolved", dtype="float32",
        kv_cache_dtype="auto", quantization="", kv_scales="calc=False", architecture="0" * 16,
        kv_layout=";".join(f"{g.kind}:{g.block_size}" for g in groups),
        block_size=min(g.block_size for g in groups), parallel=f"tp={tp_size}",
        tp_size=tp_size, device="cpu")
    base.update(fields)
    return EngineIdentity(**base)


@dataclass
class StepResult:
    plan: StepPlan
    report: WorkerReport
    finished: set[str] = field(default_factory=set)  # finished receiving on every rank
    failed: set[str] = field(default_factory=set)  # failed receiving on some rank
    load_errors: set[int] = field(default_factory=set)  # block ids, any rank
    sent: dict[int, set[str]] = field(default_factory=dict)  # rank -> finished sending


class Rank:
    """One TP rank: its KV tensors and its worker."""

    def __init__(self, worker: TieredWorker, kv: dict[str, torch.Tensor]) -> None:
        self.worker = worker
        self.kv = kv
        self.outstanding: set[int] = set()  # job ids sent to this rank, not yet reported

    def stored(self, key: BlockKey) -> bytes | None:
        """The payload this rank's Redis holds for ``key`` (under its own fingerprint)."""
        assert isinstance(self.worker.redis, OwnRedis)
        got = self.worker.redis.tier.get(self.worker.storage_key(key))
        return None if got is None else bytes(got)


class Halves:
    """One engine: a scheduler half and ``tp_size`` worker halves over CPU tensors.

    Attention layers are named ``attn<group>`` (``[blocks, 2, block_size, width]`` float32),
    Mamba layers ``mamba<group>`` (``[blocks, 1, 1, MAMBA_BYTES]`` int8).
    """

    def __init__(self, config: TieredConfig, *, tp_size: int = 1,
                 groups: Sequence[GroupSpec] = LLAMA, hash_unit: int = BS,
                 num_blocks: int = 16, width: int = 8, num_slots: int | None = None,
                 ident: EngineIdentity | None = None, presence: bool = False) -> None:
        self.config = config
        self.groups = list(groups)
        self.tp_size = tp_size
        self.num_blocks = num_blocks
        self.identity = ident or identity(groups, tp_size,
                                          weights_version=config.weights_version)
        self.generation = Generation()
        self.blocks: dict[str, list[list[Blk]]] = {}
        self.pool: dict[int, Blk] = {}  # blocks the scheduler looks up by id (Mamba states)
        self._recv: Counter[str] = Counter()
        layers = [(g.group, g.kind, g.block_size, [self._layer(g)]) for g in self.groups]
        kvs = [self._tensors(width) for _ in range(tp_size)]
        slot_bytes = build_layout(kvs[0], layers, num_blocks).slot_bytes
        self.num_slots = num_slots or slot_count(config.cpu_bytes, slot_bytes)
        self.ranks: list[Rank] = []
        for tp_rank, kv in enumerate(kvs):
            host = host_connect(config.host_tier_socket, f"worker {tp_rank}", subscribe=False) \
                if config.host_tier_socket else None
            worker = TieredWorker(config, tp_rank, tp_size, self.num_slots,
                                  open_remote_store(config, host), host)
            worker.register(kv, layers, num_blocks)
            self.ranks.append(Rank(worker, kv))
        host_view = None
        if config.host_tier_socket:  # rank 0's layout as vLLM's handshake brings it
            host_view = HostTierMirror(host_connect(
                config.host_tier_socket, "scheduler", subscribe=True,
                presence=config.host_tier_redis and presence), tp_size)
            layout = self.ranks[0].worker.layout
            assert layout is not None
            host_view.set_layout(layout.descriptor())
        self.sched = TieredScheduler(
            config, self.groups, hash_unit, self.num_slots, slot_bytes, tp_size,
            self._fingerprint, lambda rid: self.blocks[rid],
            lambda bid: self.pool.get(bid, Blk(bid)),
            presence=presence_source(config, host_view.client if host_view else None)
            if presence else None, host=host_view)

    # ------------------------------------------------------------------ set-up helpers
    @staticmethod
    def _layer(g: GroupSpec) -> str:
        return f"{'mamba' if g.kind == MAMBA else 'attn'}{g.group}"

    def _tensors(self, width: int) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for g in self.groups:
            if g.kind == MAMBA:
                out[self._layer(g)] = torch.zeros(self.num_blocks, 1, 1, MAMBA_BYTES,
                                                  dtype=torch.int8)
            else:
                out[self._layer(g)] = torch.zeros(self.num_blocks, 2, g.block_size, width)
        return out

    def _fingerprint(self, tenant: str) -> str:
        return self.identity.fingerprint(tenant, self.generation.name)

    def fill(self, block_ids: Sequence[int], seed: int = 0) -> None:
        """Random contents in ``block_ids`` of every layer; every rank differs."""
        gen = torch.Generator().manual_seed(seed)
        for rank in self.ranks:
            for tensor in rank.kv.values():
                for b in block_ids:
                    if tensor.dtype == torch.int8:
                        tensor[b] = torch.randint(-128, 128, tensor[b].shape, generator=gen,
                                                  dtype=torch.int8)
                    else:
                        tensor[b] = torch.randn(tensor[b].shape, generator=gen)

    def key(self, req: Req, group: int, tokens: int) -> BlockKey:
        """The (base-fingerprint) key of ``req``'s entry of ``group`` covering ``tokens``."""
        g = next(x for x in self.groups if x.group == group)
        return self.sched.key(req, self._fingerprint(self.sched.tenant(req)), g, tokens)

    def reset(self) -> None:
        """A connector-cache reset, as the adapter does it: CPU directory emptied, new
        namespace generation."""
        self.sched.reset()
        self.generation.reset(None)

    # ------------------------------------------------------------------ the scheduler's side
    def admit(self, req: Req, blocks: list[list[Blk]], num_external: int) -> None:
        """vLLM allocated ``blocks`` for ``req`` and took ``num_external`` tokens of its hit."""
        self.blocks[req.request_id] = blocks
        self.sched.on_alloc(req, blocks, num_external)

    def lookup(self, req: Req, num_computed: int = 0, max_steps: int = 3
               ) -> tuple[int | None, bool]:
        """Ask as vLLM does: while the answer is ``None`` (a probe is out), run a step and
        ask again, at most ``max_steps`` times."""
        answer = self.sched.lookup(req, num_computed)
        for _ in range(max_steps):
            if answer[0] is not None:
                break
            self.step()
            answer = self.sched.lookup(req, num_computed)
        return answer

    def plan(self, computed_after: dict[str, int] | None = None,
             boundary: dict[str, list[tuple[int, int, int]]] | None = None,
             gone: set[str] | None = None) -> StepPlan:
        return self.sched.plan(computed_after or {}, boundary or {}, gone or set())

    # ------------------------------------------------------------------ the workers' side
    def run(self, plan: StepPlan) -> None:
        """Every rank runs ``plan``: loads and fetches before the forward, saves after it."""
        jobs = {op.job for op in plan.saves} | {op.job for op in plan.fetches} \
            | {op.job for op in plan.probes} | {op.job for op in plan.backfills}
        for rank in self.ranks:
            rank.outstanding |= jobs
            rank.worker.start_step(plan)
        for rank in self.ranks:
            rank.worker.save(plan)

    def collect(self, deadline_s: float = 60.0) -> WorkerReport:
        """Every rank's report, merged, once every job sent so far is reported (polling)."""
        merged = WorkerReport()
        deadline = time.monotonic() + deadline_s
        for rank in self.ranks:
            while True:
                report = rank.worker.take_report()
                rank.outstanding -= set(report.saves) | set(report.fetches) | set(report.probes)
                merged.merge(report)
                if not rank.outstanding:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank.worker.tp_rank}: jobs "
                                       f"{sorted(rank.outstanding)} not reported in {deadline_s}s")
                time.sleep(0.002)  # polling interval, not a synchronisation
        return merged

    def deliver(self, plan: StepPlan, deadline_s: float = 60.0) -> StepResult:
        """Wait for the workers, hand their merged report to the scheduler, gather results."""
        report = self.collect(deadline_s)
        self.sched.on_report(report)
        result = StepResult(plan, report)
        for rank in self.ranks:
            done, failed, sent = rank.worker.take_transfer_results()
            result.failed |= failed
            result.sent[rank.worker.tp_rank] = sent
            result.load_errors |= rank.worker.take_load_errors()
            for req_id in done:
                self._recv[req_id] += 1
                if self._recv[req_id] == self.tp_size:
                    del self._recv[req_id]
                    result.finished.add(req_id)
        return result

    def presence_ready(self) -> None:
        """One step (rank 0's layout reaches the scheduler), then the presence feed's walk
        of the key names is done."""
        self.step()
        deadline = time.monotonic() + 60.0
        while not (self.sched.presence is not None and self.sched.presence.ready()):
            assert time.monotonic() < deadline, "the presence feed's walk never finished"
            time.sleep(0.05)

    def step(self, computed_after: dict[str, int] | None = None,
             boundary: dict[str, list[tuple[int, int, int]]] | None = None,
             gone: set[str] | None = None, deadline_s: float = 60.0) -> StepResult:
        plan = self.plan(computed_after, boundary, gone)
        self.run(plan)
        return self.deliver(plan, deadline_s)

    # ------------------------------------------------------------------ inspection
    def counter(self, name: str) -> list[int]:
        """A worker counter, per rank."""
        return [r.worker.counters.snapshot()[name] for r in self.ranks]

    def cpu(self) -> dict[str, Any]:
        return self.sched.directory.stats()

    def close(self) -> None:
        for rank in self.ranks:
            rank.worker.close()
        self.sched.close()


def as_bytes(tensor: torch.Tensor) -> bytes:
    """A block's raw bytes, as a worker stores them (one slice per tensor)."""
    return np.ascontiguousarray(tensor.contiguous().view(torch.uint8).numpy()).tobytes()
