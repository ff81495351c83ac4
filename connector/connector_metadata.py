"""What the scheduler half tells the worker half each step: keys, slots and block ids only.

Nothing here refers to requests' tokens or to vLLM objects, so a tensor-parallel split can
later send the same plan to every rank (each with its own namespace fingerprint).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from offload_tiers.keys import BlockKey

TIER_CPU = "cpu"
TIER_REDIS = "redis"


@dataclass(frozen=True, slots=True)
class LoadOp:
    """Write stored entry ``key`` into block ``block_id`` of ``group``.

    ``slot`` is the pinned CPU-tier slot (acquired by the scheduler, released by the worker)
    when ``tier`` is cpu; None when the entry must be fetched from Redis on the way.
    """

    req_id: str
    group: int
    block_id: int
    key: BlockKey
    tier: str
    slot: int | None = None


@dataclass(frozen=True, slots=True)
class SaveOp:
    """Copy block ``block_id`` of ``group`` into the tiers under ``key``.

    ``supersedes`` is the PARTIAL entry of the same block that this FULL entry promotes;
    it is dropped once the FULL one is stored.
    """

    req_id: str
    group: int
    block_id: int
    key: BlockKey
    supersedes: BlockKey | None = None


@dataclass(slots=True)
class StepPlan:
    """One step's loads and saves."""

    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    # Requests whose loads in this plan vLLM treats as asynchronous (not scheduled this step):
    # the worker reports them as finished receiving once their loads ran.
    async_reqs: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves or self.async_reqs)
