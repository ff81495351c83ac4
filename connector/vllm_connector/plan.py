"""What the two halves tell each other: the step plan (scheduler → every worker) and the
worker report (each worker → scheduler, summed over ranks by vLLM).

Rules this module keeps:

* The halves run in different processes and share nothing else. vLLM pickles what they
  exchange every step; the plan and the report go inside as msgpack (:func:`to_wire`,
  :func:`plan_from_wire`, :func:`report_from_wire`), typed and validated on decoding, and
  several times cheaper than pickling the dataclasses. Each op is an array-like Struct (a
  short msgpack array, no field names).
* Where a load or a fetch reads is a type (:class:`LoadFrom`, :class:`FetchFrom`), never a
  made-up slot number; an op with no CPU-tier slot (a host-tier restore, an overflow save)
  says so with ``slot`` None.
* Keys carry the engine's *base* fingerprint; each rank derives the fingerprint it stores
  under (:func:`connector.vllm_connector.namespace.rank_fingerprint`).
* Slots are chosen by the scheduler (it owns the CPU tier's bookkeeping); the bytes live in
  each worker's slab. A job id names each asynchronous piece of work (a probe, a fetch, a
  save); every rank reports each job exactly once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from offload_tiers.keys import BlockKey


class LoadFrom(enum.IntEnum):
    """Where a load reads its block (one small int on the wire)."""

    SLOT = 0  # a CPU-tier slot that holds the key now
    FETCHED_SLOT = 1  # a CPU-tier slot a fetch of the same request fills from Redis first
    HOST = 2  # the host tier's shared segment, where the fetch checked this rank's shard


class FetchFrom(enum.IntEnum):
    """Where a fetch reads its value (one small int on the wire)."""

    REDIS = 0  # the remote store, read into a CPU-tier slot and validated there
    HOST = 1  # the host tier: this rank's shard checked where it lies, for its load


class HostShard(NamedTuple):
    """One rank's shard of a host-tier save: its slot in the shared segment, the save's
    id and its length in bytes."""

    slot: int
    save_id: int
    length: int


class LoadOp(msgspec.Struct, frozen=True, array_like=True):
    """Write ``key`` into block ``block_id`` of ``group``, from where ``source`` says.

    ``slot``: the CPU-tier slot it reads (None: no CPU-tier slot, a host-tier load). A load
    from a :attr:`LoadFrom.FETCHED_SLOT` or the :attr:`LoadFrom.HOST` tier waits for the
    fetch of the same request to validate its value; the host tier's block is then written
    straight from the shared segment.
    """

    req_id: str
    group: int
    block_id: int
    slot: int | None
    key: BlockKey
    source: LoadFrom = LoadFrom.SLOT

    @property
    def after_fetch(self) -> bool:
        """The load waits for a fetch of its request (its value is not in a slot yet)."""
        return self.source is not LoadFrom.SLOT


class FetchOp(msgspec.Struct, frozen=True, array_like=True):
    """Read ``key`` from where ``source`` says, in the background, and validate it: from
    Redis into CPU-tier ``slot``; from the host tier (``slot`` None), this rank's shard of
    ``shards`` checked in place in the shared segment, for the load to copy from there."""

    job: int
    req_id: str
    slot: int | None
    key: BlockKey
    source: FetchFrom = FetchFrom.REDIS
    # The save every rank must read (the probe's answer): with TP, shards of other saves
    # (another engine's, or one a failed load left half-written) fail the fetch.
    save_id: int | None = None
    # From the host tier: every rank's shard of the save, by rank.
    shards: tuple[HostShard, ...] = ()


#: The request id of a backfill's save: no request, an entry of the CPU tier written to
#: Redis after it came back.
BACKFILL_REQ = ""


class SaveOp(msgspec.Struct, frozen=True, array_like=True):
    """Copy block ``block_id`` of ``group`` into ``slot``; then to Redis when ``to_redis``.

    ``slot`` is None when the CPU tier had no slot to give (an overflow save): the worker
    copies the block into a buffer of its own, which only the Redis writer reads.
    """

    job: int
    req_id: str
    group: int
    block_id: int
    slot: int | None
    key: BlockKey
    to_redis: bool
    save_id: int = 0  # written into every rank's value header (one save, one id)
    to_host: bool = False  # also into a slot of the host tier (connector/vllm_connector/host.py)


class ProbeOp(msgspec.Struct, frozen=True, array_like=True):
    """Ask Redis which save of each of ``keys`` every rank holds (answered through the
    worker report)."""

    job: int
    keys: tuple[BlockKey, ...]


@dataclass(slots=True)
class StepPlan:
    """One step's work for every worker."""

    loads: list[LoadOp] = field(default_factory=list)
    fetches: list[FetchOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    probes: list[ProbeOp] = field(default_factory=list)
    # Requests vLLM loads asynchronously (not scheduled in this step): the worker reports
    # them through get_finished / failed_recving once their loads (and fetches) are done.
    async_reqs: list[str] = field(default_factory=list)
    # Finished requests whose partial tails this plan saves (vLLM keeps their blocks until
    # the workers report them as finished sending, once the saves have copied them).
    tail_reqs: list[str] = field(default_factory=list)
    # The scheduler knows rank 0's layout (the rank-0 worker stops sending it).
    layout_known: bool = False
    # vLLM scheduled no tokens in this step: no forward runs on the workers' compute cores
    # (its fetches may use them: affinity.SpareCores.fetching).
    idle: bool = False
    # CPU-tier entries that never reached Redis, written now from their slots (pinned until
    # every rank wrote its shard): ``block_id`` is unused, ``req_id`` is BACKFILL_REQ.
    backfills: list[SaveOp] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.fetches or self.saves or self.probes or self.async_reqs
                    or self.tail_reqs or self.backfills)


#: A probe answer where ranks read different saves of one key (never a hit).
MIXED_SAVES = -1


def merge_save_ids(mine: list[int], theirs: list[int]) -> list[int]:
    """Per key: the save id both sides read, else :data:`MIXED_SAVES` (0 = absent merges to
    mixed too, unless both found nothing)."""
    return [a if a == b else MIXED_SAVES for a, b in zip(mine, theirs, strict=True)]


@dataclass(slots=True)
class WorkerReport:
    """What workers tell the scheduler; vLLM merges the ranks' reports with :meth:`merge`.

    ``saves``: job -> ``[ranks_ok, ranks_reporting, ranks_whose_copy_failed]`` (a save is
    ok when the block reached the slot and, if asked, Redis); ``fetches``: job ->
    ``[ranks_ok, ranks_reporting]``. ``probes``: job -> ``(save_ids, ranks_reporting)``
    with one save id per key: the id every reporting rank read, 0 where a rank found none,
    :data:`MIXED_SAVES` where ranks read different saves (:func:`merge_save_ids`).
    ``redis_up``: rank -> 1/0, sent by a rank only when its Redis went up or down since its
    last report (none configured: never sent), so a quiet step reports nothing at all.
    ``rank0_layout``: TP rank 0's tensor layout (the presence summary's key names), until
    the scheduler has it.
    """

    saves: dict[int, list[int]] = field(default_factory=dict)
    fetches: dict[int, list[int]] = field(default_factory=dict)
    probes: dict[int, tuple[list[int], int]] = field(default_factory=dict)
    redis_up: dict[int, int] = field(default_factory=dict)
    rank0_layout: str = ""

    def merge(self, other: WorkerReport) -> WorkerReport:
        for mine, theirs in ((self.saves, other.saves), (self.fetches, other.fetches)):
            for job, counts in theirs.items():
                cur = mine.get(job)
                mine[job] = list(counts) if cur is None else [a + b for a, b in
                                                              zip(cur, counts, strict=True)]
        for job, (ids, n) in other.probes.items():
            if job in self.probes:
                old, m = self.probes[job]
                self.probes[job] = (merge_save_ids(old, ids), m + n)
            else:
                self.probes[job] = (list(ids), n)
        self.redis_up.update(other.redis_up)
        self.rank0_layout = self.rank0_layout or other.rank0_layout
        return self

    def __bool__(self) -> bool:
        return bool(self.saves or self.fetches or self.probes or self.rank0_layout
                    or self.redis_up)


_ENCODER = msgspec.msgpack.Encoder()
_PLAN_DECODER = msgspec.msgpack.Decoder(StepPlan)
_REPORT_DECODER = msgspec.msgpack.Decoder(WorkerReport)


def to_wire(message: StepPlan | WorkerReport) -> bytes:
    """A plan or a report as msgpack."""
    return _ENCODER.encode(message)


def plan_from_wire(data: bytes) -> StepPlan:
    """The plan :func:`to_wire` encoded (``msgspec.ValidationError`` on anything else)."""
    return _PLAN_DECODER.decode(data)


def report_from_wire(data: bytes) -> WorkerReport:
    """The report :func:`to_wire` encoded (``msgspec.ValidationError`` on anything else)."""
    return _REPORT_DECODER.decode(data)
