"""Redis through the host tier's daemon, for a worker with ``host_tier_redis``: the engine's
end of the feature (the daemon's end:
:class:`~offload_tiers.host_tier.redis_service.HostTierRedisService`).

Such an engine opens no Redis connection of its own: ``kvtier daemon --cpu-bytes N
--redis-url URL`` holds the host's. The worker's Redis calls keep their shape
(:class:`HostTierRedisStore` stands where a :class:`~offload_tiers.redis.tier.RedisTier` would):

* a probe asks the daemon which save of each key Redis holds;
* a fetch asks the daemon to read the values from Redis into host-tier slots (checked by
  the daemon's Redis tier: header, key, save id, checksum), then copies each from the
  shared segment into its CPU-tier slot, checked again there (slot header, save id,
  xxh3): a slot evicted or reused since the answer is a failed fetch, recomputed. The
  values stay in the host tier for every engine on the host;
* saves are not sent from here: the worker names each save's Redis key in its host-tier
  commit and the daemon writes it behind (one write per host slot, whichever engine made
  it). A save with no host-tier slot at hand does not reach Redis (counted).

Every call blocks on the daemon's answer, bounded by ``timeout_s``: only the worker's I/O
threads call it, never vLLM's step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from connector.vllm_connector.host import host_digest
from connector.vllm_connector.remote_store import (
    PendingSave,
    SaveDoneCallback,
    SaveKind,
    WriteCounters,
)
from offload_tiers.host_tier.client import HostTierClient
from offload_tiers.host_tier.protocol import KeyTuple
from offload_tiers.keys import BlockKey

#: How long a worker's I/O thread waits for the daemon's answer to a probe or a restore
#: (the daemon's own Redis waits are bounded by its ``redis_timeout_s``); a late answer is
#: a miss, recomputed. Never on vLLM's step.
HOST_TIER_REDIS_TIMEOUT_S = 10.0


def key_tuple(key: BlockKey) -> KeyTuple:
    """``key`` as the host tier's protocol carries it."""
    return (key.fingerprint, key.group, key.block_hash, key.num_tokens, int(key.kind))


#: A save the daemon writes behind counts as one via the daemon; one with no host-tier slot
#: at hand reaches no Redis (a drop). Backfills: the daemon's own (see ``backfills``).
_VIA_DAEMON: WriteCounters = ("redis_saves_via_daemon", None, ("store_drops",))


class HostTierRedisStore:
    """The daemon's Redis, as a worker calls it (a
    :class:`~connector.vllm_connector.remote_store.RemoteStore`: probes and fetches; saves
    ride the host-tier commits)."""

    #: the daemon backfills what it failed to write; this worker has nothing to send
    backfills = False

    def __init__(self, host: HostTierClient, timeout_s: float) -> None:
        self.host = host
        self.timeout_s = timeout_s

    @property
    def available(self) -> bool:
        return self.host.redis

    def save_ids_many(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """Each key's save id in Redis (None: absent, invalid, or no answer)."""
        ids = self.host.probe([key_tuple(k) for k in keys], self.timeout_s)
        if ids is None:
            return [None] * len(keys)
        return [i or None for i in ids]

    def get_many_into(self, keys: Sequence[BlockKey], dests: Sequence[np.ndarray], *,
                      save_ids: Sequence[int | None]) -> list[bool]:
        """Per key: True when ``dests[i]`` (exactly the value's length) now holds that save
        of the key, restored by the daemon into the host tier and read from there."""
        digests = [host_digest(k) for k in keys]
        where = self.host.restore(
            [(d, key_tuple(k), s or 0, dest.nbytes)
             for d, k, s, dest in zip(digests, keys, save_ids, dests, strict=True)],
            self.timeout_s)
        segment = self.host.segment
        if where is None or segment is None:
            return [False] * len(keys)
        # only the save asked for (the daemon answers no other; checked here all the same)
        found = [i for i, w in enumerate(where) if w is not None and w.length == dests[i].nbytes
                 and (not save_ids[i] or w.save_id == save_ids[i])]
        got = segment.read_many_into(
            [where[i].slot for i in found], [digests[i] for i in found],  # type: ignore[union-attr]
            [where[i].save_id for i in found], [dests[i] for i in found])  # type: ignore[union-attr]
        ok = [False] * len(keys)
        for i, good in zip(found, got, strict=True):
            ok[i] = good
        return ok

    def write_counters(self, kind: SaveKind) -> WriteCounters:
        return _VIA_DAEMON

    def write(self, saves: Sequence[PendingSave], done: SaveDoneCallback) -> None:
        """Each save reaches Redis if its host-tier commit names its key (the daemon
        writes it behind); one with no host-tier slot at hand does not."""
        for save in saves:
            done(save, save.in_host_commit)

    def host_commit_note(self, key: BlockKey, save_id: int, rank0: bool
                         ) -> tuple[KeyTuple, int, bool]:
        """The commit names the Redis key and save (rank 0's note announces it)."""
        return key_tuple(key), save_id, rank0

    def flush(self, timeout: float | None = None) -> bool:
        """Nothing queued here: saves ride the host-tier commits (the worker's
        ``flush_host`` waits for those); the daemon's write-behind is its own."""
        return True

    def counts(self) -> dict[str, int]:
        """No outage counters of its own (see :meth:`stats`)."""
        return {}

    #: :meth:`counts` never moves (``RedisTier.events_serial``'s counterpart).
    events_serial = 0

    def close(self, timeout: float = 0.0) -> None:
        """Nothing of its own to close: the host-tier client is the worker's."""
