"""Where a worker's saves go past its CPU tier, and where its fetches come from.

:class:`RemoteStore` is the one interface a worker (:mod:`connector.vllm_connector.worker`)
sees; two classes implement it:

* :class:`OwnRedis`: the engine's own connection (``redis_url``), kvtier's Redis tier
  (:class:`~offload_tiers.redis.tier.RedisTier`) written through or behind;
* :class:`~connector.vllm_connector.host_tier_redis.HostTierRedisStore`: the host's Redis through
  ``kvtier daemon`` (``host_tier_redis``), whose saves ride the host tier's commits.

Which one a worker gets is chosen in :mod:`connector.vllm_connector.remote_store_factory`.
A store counts what it does with a save in the worker's counters: :attr:`write_counters`
names them, by what the save was (a new save or a backfill).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np

from offload_tiers.host_tier.protocol import RedisWrite
from offload_tiers.keys import BlockKey

if TYPE_CHECKING:  # redis-py is imported only by an engine that uses Redis
    from offload_tiers.redis.tier import RedisTier

#: What a save's outcome is counted as: (counter when written, bytes counter or None,
#: counters when not).
WriteCounters = tuple[str, str | None, tuple[str, ...]]
SaveKind = Literal["write", "backfill"]


@dataclass(frozen=True, slots=True)
class PendingSave:
    """One rank's shard of a save, on its way to the remote store from its CPU-tier slot
    (``view``: the slot's bytes, held until the save is reported). ``in_host_commit``: the
    shard's host-tier commit names its Redis key (the daemon writes it behind)."""

    job: int
    key: BlockKey  # this rank's storage key
    view: memoryview
    save_id: int
    in_host_commit: bool = False


#: Called once per save, on any thread: whether it reached the store.
SaveDoneCallback = Callable[[PendingSave, bool], None]


class RemoteStore(Protocol):
    """A worker's store past its CPU tier (every call from its I/O or saver threads)."""

    @property
    def available(self) -> bool:
        """It answers now (saves are handed over, probes and fetches asked)."""
        ...

    @property
    def events_serial(self) -> int:
        """Moves whenever :meth:`counts` does (read every step: cheap)."""
        ...

    @property
    def backfills(self) -> bool:
        """Saves made while it was down are written by this worker once it answers."""
        ...

    def write_counters(self, kind: SaveKind) -> WriteCounters:
        """The worker's counters a save's outcome moves."""
        ...

    def save_ids_many(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """Each key's save id (None: absent, invalid, or no answer)."""
        ...

    def get_many_into(self, keys: Sequence[BlockKey], dests: Sequence[np.ndarray], *,
                      save_ids: Sequence[int | None]) -> list[bool]:
        """Per key: True when ``dests[i]`` holds exactly that save of the key, validated."""
        ...

    def write(self, saves: Sequence[PendingSave], done: SaveDoneCallback) -> None:
        """Hand ``saves`` over; ``done`` runs once per save (now, or from a writer)."""
        ...

    def host_commit_note(self, key: BlockKey, save_id: int, rank0: bool
                         ) -> RedisWrite | None:
        """What a host-tier commit of ``key`` tells the daemon to write behind (None:
        nothing: this worker writes its saves itself)."""
        ...

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until what was handed over is written (bounded); False if not all was."""
        ...

    def counts(self) -> dict[str, int]:
        """Outage and corruption counts (``unavailable_events``, ``recoveries``, ...)."""
        ...

    def close(self, timeout: float = 0.0) -> None:
        """Write what is queued within ``timeout``, then let go of the connections."""
        ...


_OWN_WRITES: dict[SaveKind, WriteCounters] = {
    "write": ("blocks_written_redis", "bytes_written_redis",
              ("redis_write_failures", "store_drops")),
    "backfill": ("blocks_backfilled_redis", "bytes_backfilled_redis",
                 ("redis_backfill_failures",)),
}


class OwnRedis:
    """The engine's own Redis connection: kvtier's Redis tier (``tier``), written through
    (the step's saves reach Redis before the next step) or behind (one hand-over to the
    tier's writer per step; each slot stays pinned until its write is reported)."""

    backfills = True

    def __init__(self, tier: RedisTier, write_mode: Literal["through", "back"]) -> None:
        self.tier = tier
        self.write_mode = write_mode

    @property
    def available(self) -> bool:
        return self.tier.available

    @property
    def events_serial(self) -> int:
        return self.tier.events_serial

    def write_counters(self, kind: SaveKind) -> WriteCounters:
        return _OWN_WRITES[kind]

    def save_ids_many(self, keys: Sequence[BlockKey]) -> list[int | None]:
        return self.tier.save_ids_many(keys)

    def get_many_into(self, keys: Sequence[BlockKey], dests: Sequence[np.ndarray], *,
                      save_ids: Sequence[int | None]) -> list[bool]:
        return self.tier.get_many_into(keys, dests, save_ids=save_ids)

    def write(self, saves: Sequence[PendingSave], done: SaveDoneCallback) -> None:
        if self.write_mode == "through":
            # Which values of a short batch landed is unknown: count none (never over-claim).
            all_ok = self.tier.put_many([(s.key, s.view) for s in saves],
                                        save_ids=[s.save_id for s in saves]) == len(saves)
            for save in saves:
                done(save, all_ok)
            return
        self.tier.submit_puts([(s.key, s.view, _bind(done, s), s.save_id) for s in saves])

    def host_commit_note(self, key: BlockKey, save_id: int, rank0: bool) -> None:
        return None

    def flush(self, timeout: float | None = None) -> bool:
        return self.tier.flush(timeout)

    def counts(self) -> dict[str, int]:
        return self.tier.counts()

    def close(self, timeout: float = 0.0) -> None:
        self.tier.close(timeout=timeout)


def _bind(done: SaveDoneCallback, save: PendingSave) -> Callable[[bool], None]:
    return lambda ok: done(save, ok)
