"""What the two halves tell each other: the step plan (scheduler → every worker) and the
worker report (each worker → scheduler, summed over ranks by vLLM).

Rules this module keeps:

* The halves run in different processes and share nothing else. vLLM pickles what they
  exchange every step; the plan and the report go inside as msgpack (:func:`to_wire`,
  :func:`plan_from_wire`, :func:`report_from_wire`), typed and validated on decoding, and
  several times cheaper than pickling the dataclasses.
* Keys carry the engine's *base* fingerprint; each rank derives the fingerprint it stores
  under (:func:`connector.vllm_connector.namespace.rank_fingerprint`).
* Slots are chosen by the scheduler (it owns the CPU tier's bookkeeping); the bytes live in
  each worker's slab. A job id names each asynchronous piece of work (a probe, a fetch, a
  save); every rank reports each job exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from offload_tiers.keys import BlockKey


@dataclass(frozen=True, slots=True)
class LoadOp:
    """Write CPU-tier ``slot`` (holding ``key``) into block ``block_id`` of ``group``.

    ``after_fetch``: the slot is being filled from Redis by a fetch of the same request;
    the worker writes the block once that fetch has validated. ``slot`` is
    :data:`HOST_SLOT` for a host-tier restore: the block is written straight from the
    shared segment once the fetch (a check in place) has validated it.
    """

    req_id: str
    group: int
    block_id: int
    slot: int
    key: BlockKey
    after_fetch: bool = False
    from_host: bool = False  # the fetch reads the host tier (else Redis)


@dataclass(frozen=True, slots=True)
class FetchOp:
    """Read ``key`` from Redis into CPU-tier ``slot`` (in the background), then validate;
    with ``host`` (``slot`` is :data:`HOST_SLOT`), check this rank's shard in place in the
    host tier's shared segment, for the load to copy from there."""

    job: int
    req_id: str
    slot: int
    key: BlockKey
    # The save every rank must read (the probe's answer): with TP, shards of other saves
    # (another engine's, or one a failed load left half-written) fail the fetch.
    save_id: int | None = None
    # From the host tier: (slot, save id, length) of every rank's shard, by rank.
    host: tuple[tuple[int, int, int], ...] | None = None


#: The slot of a save that found no CPU-tier slot: the worker copies the block into a buffer
#: of its own, which only the Redis writer reads.
OVERFLOW_SLOT = -1
#: The request id of a backfill's save: no request, an entry of the CPU tier written to
#: Redis after it came back.
BACKFILL_REQ = ""
#: The "slot" of a host-tier restore: no CPU-tier slot; the worker checks the shard where it
#: lies in the shared segment and loads it from there into vLLM's KV cache.
HOST_SLOT = -2


@dataclass(frozen=True, slots=True)
class SaveOp:
    """Copy block ``block_id`` of ``group`` into ``slot``; then to Redis when ``to_redis``.

    ``slot`` is :data:`OVERFLOW_SLOT` when the CPU tier had no slot to give: the block then
    goes to Redis only.
    """

    job: int
    req_id: str
    group: int
    block_id: int
    slot: int
    key: BlockKey
    to_redis: bool
    save_id: int = 0  # written into every rank's value header (one save, one id)
    to_host: bool = False  # also into a slot of the host tier (connector/vllm_connector/host.py)


@dataclass(frozen=True, slots=True)
class ProbeOp:
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
