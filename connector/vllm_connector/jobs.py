"""The scheduler's book of jobs still out on the workers (saves, fetches, probes).

Every rank reports every job once; a job is done when ``world_size`` reports are in, and
is ok only if every rank says so (a hit counts only if every rank can restore it).
"""

from __future__ import annotations

from dataclasses import dataclass

from connector.vllm_connector.plan import merge_save_ids
from offload_tiers.keys import BlockKey


@dataclass(frozen=True, slots=True)
class TierChange:
    """An entry appeared in (stored=True) or left (stored=False) a tier: a KV event."""

    key: BlockKey
    medium: str
    stored: bool


@dataclass(slots=True)
class SlotJob:
    """A save or fetch of ``key`` through CPU-tier ``slot`` (None: none, an overflow save or
    a host-tier fetch), with the ranks' answers so far."""

    key: BlockKey
    slot: int | None
    req_id: str
    mark: tuple[int, int, int] | None = None  # the save's (group, index, tokens)
    to_redis: bool = False
    ok: int = 0
    reports: int = 0
    gather_failed: bool = False


@dataclass(slots=True)
class ProbeJob:
    keys: tuple[BlockKey, ...]
    save_ids: list[int] | None = None  # merged over the ranks that answered so far
    reports: int = 0


class JobBook:
    """Job ids and the reports collected for them."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._next = 1
        self._slots: dict[int, SlotJob] = {}
        self._probes: dict[int, ProbeJob] = {}

    def __len__(self) -> int:
        return len(self._slots) + len(self._probes)

    def _id(self) -> int:
        job, self._next = self._next, self._next + 1
        return job

    def open_save(self, key: BlockKey, slot: int | None, req_id: str,
                  mark: tuple[int, int, int] | None, to_redis: bool) -> int:
        job = self._id()
        self._slots[job] = SlotJob(key, slot, req_id, mark, to_redis)
        return job

    def open_fetch(self, key: BlockKey, slot: int | None, req_id: str) -> int:
        job = self._id()
        self._slots[job] = SlotJob(key, slot, req_id)
        return job

    def open_probe(self, keys: tuple[BlockKey, ...]) -> int:
        job = self._id()
        self._probes[job] = ProbeJob(keys)
        return job

    def report(self, job: int, ok: int, reports: int,
               gather_failed: int = 0) -> tuple[SlotJob, bool] | None:
        """Add ranks' answers; ``(job, all ranks ok)`` once every rank has answered."""
        entry = self._slots.get(job)
        if entry is None:
            return None
        entry.ok += ok
        entry.reports += reports
        entry.gather_failed = entry.gather_failed or gather_failed > 0
        if entry.reports < self.world_size:
            return None
        del self._slots[job]
        return entry, entry.ok >= self.world_size

    def report_probe(self, job: int, save_ids: list[int], reports: int
                     ) -> tuple[tuple[BlockKey, ...], list[int]] | None:
        """Add ranks' save ids; ``(keys, save_ids)`` once every rank has answered (a key is
        present only where every rank read the same save: an id > 0)."""
        entry = self._probes.get(job)
        if entry is None:
            return None
        entry.save_ids = list(save_ids) if entry.save_ids is None \
            else merge_save_ids(entry.save_ids, save_ids)
        entry.reports += reports
        if entry.reports < self.world_size:
            return None
        del self._probes[job]
        return entry.keys, entry.save_ids
