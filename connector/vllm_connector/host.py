"""The host tier (``kvtier daemon --cpu-bytes``) as seen by the two halves.

In this mode the host's shared CPU tier sits between each engine's own CPU tier and Redis:

* the scheduler half finds a key there by reading a local mirror of the daemon's directory
  (:class:`~offload_tiers.host_tier.client.HostTierClient`, subscribed; no IPC on the
  scheduler's path), pins the slots of every rank's shard, and plans a *host fetch*: each
  worker checks its shard where it lies in the shared segment on an I/O thread (header,
  save id, checksum of its bytes: a slot evicted or reused since the look-up is a failed
  fetch, recomputed), then loads it from there straight into vLLM's KV cache and checks
  that no write began on the slot meanwhile (its seqlock). No slot of the engine's own CPU
  tier is used: the host keeps one copy. The pins go once every rank has reported;
* a worker copies every block it saves (the scheduler says which: ``SaveOp.to_host``) from
  its CPU-tier slot into a slot leased from the daemon in the step, and commits it (the
  checksum) on an I/O thread.

Every rank's shard of one save carries the save's one id (``SaveOp.save_id``, the id its
Redis value carries too); a look-up is a hit only when every rank's shard is of the same
save, so shards of two saves are never served as one block.

Keys are stored under each rank's own name plus what the hash covers
(:func:`host_digest`), so a PARTIAL entry never answers a FULL look-up and ranks, layouts,
dtypes and namespaces never mix. The scheduler computes every rank's name from rank 0's
layout (sent by the rank-0 worker); a rank whose layout differs finds its slot's key
unequal and fails the fetch: a miss, never a wrong block.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from connector.vllm_connector.bounded_cache import BoundedCache
from connector.vllm_connector.namespace import rank_fingerprint
from offload_tiers.host_tier.client import HostTierClient, Pins, SlotLease
from offload_tiers.host_tier.directory import Location
from offload_tiers.host_tier.protocol import RedisWrite
from offload_tiers.keys import BlockKey
from offload_tiers.shared_segment import SharedSegment, digest

log = logging.getLogger(__name__)

_RANK_FP_MAX = 4096


def host_digest(storage_key: BlockKey) -> bytes:
    """The host tier's 16-byte key for a rank's storage key (its name, token count, kind)."""
    k = storage_key
    return digest(f"{k.name}:{k.num_tokens}:{int(k.kind)}".encode())


#: Slots a worker keeps leased ahead of its saves (held empty: size the tier for them).
WORKER_LEASE_BATCH = 32
#: How long an engine waits, at start, for the daemon's welcome (not on any request path).
WELCOME_WAIT_S = 5.0


def connect(socket_path: str, label: str, *, subscribe: bool,
            presence: bool = False, group: str | None = None) -> HostTierClient:
    """A started client (it connects, and reconnects, on its own thread). Waits up to
    :data:`WELCOME_WAIT_S` for the first welcome (and a writer for its first lease), so the
    first requests can hit and the first saves find slots; without them it goes on
    (misses, counted skipped saves) and attaches whenever the daemon answers. ``presence``:
    a subscriber that takes the daemon's presence feed (``host_tier_redis``). ``group``:
    also trust a daemon of that group (``host_tier_group``)."""
    # a subscriber (the scheduler half) only reads: it leases no slots
    client = HostTierClient(socket_path, label=label, subscribe=subscribe,
                            lease_batch=0 if subscribe else WORKER_LEASE_BATCH,
                            presence=presence, group=group).start()
    # a writer also waits for its first lease, so its first saves find slots at hand
    if not client.wait_until(lambda c: c.available and (subscribe or c.slots_at_hand > 0),
                             WELCOME_WAIT_S):
        log.warning("kvtier: the host tier at %s is not answering (%s); serving without it "
                    "until it does", socket_path, client.last_error or "no welcome yet")
    return client


class WorkerHostTier(Protocol):
    """What a worker uses of the host tier: a client
    (:class:`~offload_tiers.host_tier.client.HostTierClient`), or :class:`NoHostTier`."""

    @property
    def available(self) -> bool: ...

    @property
    def segment(self) -> SharedSegment | None: ...

    def take_slots(self, n: int) -> SlotLease: ...

    def commit(self, lease: SlotLease, saves: list[tuple[bytes, int, int, int]],
               redis: list[RedisWrite | None] | None = None) -> None: ...

    def abandon(self, lease: SlotLease) -> None: ...

    def close(self) -> None: ...


class NoHostTier:
    """A worker without the host tier: never available, no segment, no slot to lease (the
    scheduler then plans no host save, fetch or load for it)."""

    available = False
    segment = None

    def take_slots(self, n: int) -> SlotLease:
        return SlotLease("", -1, None, ())

    def commit(self, lease: SlotLease, saves: list[tuple[bytes, int, int, int]],
               redis: list[RedisWrite | None] | None = None) -> None:
        """Nothing leased: nothing to commit."""

    def abandon(self, lease: SlotLease) -> None:
        """Nothing leased: nothing to give back."""

    def close(self) -> None:
        """Nothing of its own."""


class HostTierMirror:
    """The scheduler half's view: which keys every rank holds in the host tier."""

    def __init__(self, client: HostTierClient, world_size: int) -> None:
        self.client = client
        self.world_size = world_size
        self.layout: str | None = None
        self.mixed = 0  # look-ups that found every rank's shard, of different saves
        self._rank_fps: BoundedCache[tuple[str, int], str] = BoundedCache(_RANK_FP_MAX)

    def set_layout(self, layout: str) -> None:
        if layout != self.layout:
            self.layout = layout
            self._rank_fps.clear()

    @property
    def ready(self) -> bool:
        return self.layout is not None and self.client.available

    def digests(self, key: BlockKey) -> tuple[bytes, ...]:
        """Every rank's host digest of ``key`` (``ready`` must hold)."""
        assert self.layout is not None
        out = []
        for rank in range(self.world_size):
            fp = self._rank_fps.get((key.fingerprint, rank))
            if fp is None:
                fp = rank_fingerprint(key.fingerprint, rank, self.world_size, self.layout)
                self._rank_fps.put((key.fingerprint, rank), fp)
            out.append(host_digest(BlockKey(fp, key.group, key.block_hash, key.num_tokens,
                                            key.kind)))
        return tuple(out)

    def locate(self, key: BlockKey) -> tuple[Location, ...] | None:
        """Where every rank's shard of ``key`` is, or None unless all of them are there
        and are shards of one save (one save id): a hit is never assembled from two saves
        (one rank's shard evicted or dropped and saved again, a rank that skipped a save).
        Shards of different saves are counted (``mixed``)."""
        if not self.ready:
            return None
        where = [self.client.lookup(d) for d in self.digests(key)]
        if None in where:
            return None
        if len({w.save_id for w in where}) != 1:  # type: ignore[union-attr]
            self.mixed += 1
            return None
        return tuple(where)  # type: ignore[arg-type]

    def has(self, key: BlockKey) -> bool:
        return self.locate(key) is not None

    def touch(self, key: BlockKey) -> None:
        """Tell the daemon every rank's shard of ``key`` was just used (its LRU; queued)."""
        if self.ready:
            self.client.touch(list(self.digests(key)))

    def pin(self, where: Sequence[Location]) -> Pins | None:
        return self.client.pin(w.slot for w in where)

    def unpin(self, pins: Pins | None) -> None:
        self.client.unpin(pins)

    def close(self) -> None:
        self.client.close()
