"""The tier stack: the CPU tier in front of the Redis tier.

* ``write_mode="through"``: every put goes to the CPU tier and is queued for Redis
  (write-behind, never blocking); CPU evictions just drop.
* ``write_mode="back"``: puts go to the CPU tier only; an entry evicted from the CPU tier
  is demoted to Redis (unless it came from Redis unchanged).
* A Redis hit is promoted into the CPU tier.
* :meth:`TierStack.lookup_prefix` answers "how much of this chain of block keys can be
  loaded, and from where": FULL entries count whole, a PARTIAL entry only as the chain's
  last, and nothing extends past a partial or a miss.

Keys are content-addressed (the block hash covers the tokens; the fingerprint covers the
model, layout, shard and tenant), so one key always names the same bytes; the stack does
not order racing overwrites of one key with different bytes across the two tiers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from offload_tiers._types import BytesLike
from offload_tiers.cpu_tier import CpuTier
from offload_tiers.keys import BlockKey, BlockKind
from offload_tiers.redis.tier import RedisTier

log = logging.getLogger(__name__)

WriteMode = Literal["through", "back"]


@dataclass(frozen=True, slots=True)
class TierAvailability:
    """How much of a chain one tier can supply, from its start."""

    num_tokens: int = 0
    full_blocks: int = 0
    ends_partial: bool = False

    @property
    def num_blocks(self) -> int:
        """Entries to load: the full blocks plus the trailing partial, if any."""
        return self.full_blocks + int(self.ends_partial)


@dataclass(frozen=True, slots=True)
class PrefixAvailability:
    cpu: TierAvailability
    redis: TierAvailability
    any: TierAvailability


def chain_availability(keys: Sequence[BlockKey], present: Sequence[bool]) -> TierAvailability:
    """Longest usable prefix of ``keys`` given per-key presence (pure logic)."""
    tokens = full = 0
    for key, here in zip(keys, present, strict=True):
        if not here or key.num_tokens <= tokens:  # a miss, or not a chain (tokens must grow)
            break
        if key.kind is BlockKind.FULL:
            tokens, full = key.num_tokens, full + 1
            continue
        if key.kind is BlockKind.PARTIAL:
            return TierAvailability(key.num_tokens, full, True)
        break
    return TierAvailability(tokens, full, False)


def _usable_chain(keys: Sequence[BlockKey]) -> Sequence[BlockKey]:
    """Keys up to and including the first non-FULL one (nothing extends past it)."""
    for i, key in enumerate(keys):
        if key.kind is not BlockKind.FULL:
            return keys[: i + 1]
    return keys


class TierStack:
    """CPU tier in front of an optional Redis tier."""

    def __init__(self, cpu: CpuTier, redis: RedisTier | None = None,
                 write_mode: WriteMode = "through", *, promote_on_hit: bool = True) -> None:
        if write_mode not in ("through", "back"):
            raise ValueError(f"write_mode must be 'through' or 'back', got {write_mode!r}")
        self.cpu = cpu
        self.redis = redis
        self.write_mode = write_mode
        self.promote_on_hit = promote_on_hit
        self._lock = threading.Lock()
        self._clean: set[BlockKey] = set()  # CPU entries that Redis already holds (write-back)
        self._n = dict.fromkeys(("puts", "cpu_hits", "redis_hits", "misses", "promotions",
                                 "demotions", "demotion_drops", "write_through",
                                 "write_through_drops"), 0)
        # write-through pins at most a quarter of the CPU slots while Redis writes them
        # (zero copy); beyond that the payload is copied, so puts are never starved.
        self._wt_pin_limit = cpu.num_slots // 4
        self._wt_pinned = 0
        self._user_on_evict = cpu.on_evict
        cpu.on_evict = self._on_evict

    # ------------------------------------------------------------------ writes
    def put(self, key: BlockKey, data: BytesLike) -> bool:
        """Store in the CPU tier (and queue for Redis in write-through). True if cached."""
        with self._lock:
            self._clean.discard(key)
        stored = self.cpu.put(key, data)
        self._bump("puts", int(stored))
        if self.redis is not None and self.write_mode == "through":
            self._write_through(key, data, stored)
        elif self.redis is not None and not stored:
            self._demote(key, data)  # write-back with a full CPU tier: go straight down
        return stored

    def put_many(self, items: Sequence[tuple[BlockKey, BytesLike]]) -> int:
        return sum(self.put(key, data) for key, data in items)

    def _write_through(self, key: BlockKey, data: BytesLike, in_cpu: bool) -> None:
        assert self.redis is not None
        slot = None
        if in_cpu and not isinstance(data, bytes):
            with self._lock:
                pin = self._wt_pinned < self._wt_pin_limit
                self._wt_pinned += pin
            slot = self.cpu.acquire(key) if pin else None
            if pin and slot is None:
                self._unpin_count()
        if slot is not None:  # zero copy: the slot stays pinned until Redis has it
            def done(_ok: bool, key: BlockKey = key) -> None:
                self.cpu.release(key)
                self._unpin_count()

            ok = self.redis.submit_put(key, self.cpu.view(slot), on_done=done)
        else:
            ok = self.redis.submit_put(key, data)
        self._bump("write_through" if ok else "write_through_drops")

    def _unpin_count(self) -> None:
        with self._lock:
            self._wt_pinned -= 1

    def _demote(self, key: BlockKey, data: BytesLike) -> None:
        assert self.redis is not None
        ok = self.redis.submit_put(key, bytes(memoryview(data).cast("B")))
        self._bump("demotions" if ok else "demotion_drops")

    def _on_evict(self, key: BlockKey, view: memoryview) -> None:
        if self._user_on_evict is not None:
            try:
                self._user_on_evict(key, view)
            except Exception:
                log.exception("on_evict listener failed for %s", key.name)
        with self._lock:
            clean = key in self._clean
            self._clean.discard(key)
        if self.redis is not None and self.write_mode == "back" and not clean:
            self._demote(key, view)

    def promote(self, partial_key: BlockKey, full_key: BlockKey, data: BytesLike) -> bool:
        """A partial entry became full: store the FULL one, drop the PARTIAL everywhere."""
        stored = self.put(full_key, data)
        self.cpu.remove(partial_key)
        with self._lock:
            self._clean.discard(partial_key)
        if self.redis is not None and partial_key.name != full_key.name:
            self.redis.delete_many([partial_key])
        return stored

    def remove(self, key: BlockKey, *, redis_too: bool = False) -> None:
        self.cpu.remove(key)
        with self._lock:
            self._clean.discard(key)
        if redis_too and self.redis is not None:
            self.redis.delete_many([key])

    # ------------------------------------------------------------------ reads
    def get(self, key: BlockKey) -> BytesLike | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[BlockKey]) -> list[BytesLike | None]:
        """Bytes for each key (CPU first, then one Redis batch; Redis hits promoted)."""
        out: list[BytesLike | None] = [self.cpu.get(k) for k in keys]
        hits = sum(v is not None for v in out)
        missing = [i for i, v in enumerate(out) if v is None]
        redis_hits = 0
        if missing and self.redis is not None:
            got = self.redis.get_many([keys[i] for i in missing])
            for i, value in zip(missing, got, strict=True):
                if value is None:
                    continue
                out[i] = value
                redis_hits += 1
                if self.promote_on_hit:
                    self._promote_into_cpu(keys[i], value)
        self._bump("cpu_hits", hits)
        self._bump("redis_hits", redis_hits)
        self._bump("misses", len(keys) - hits - redis_hits)
        return out

    def prefetch(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Make ``keys`` resident in the CPU tier (one Redis batch); which ones are."""
        present = self.cpu.contains_many(keys)
        missing = [i for i, here in enumerate(present) if not here]
        if missing and self.redis is not None:
            got = self.redis.get_many([keys[i] for i in missing])
            for i, value in zip(missing, got, strict=True):
                if value is not None:
                    present[i] = self._promote_into_cpu(keys[i], value)
                    self._bump("redis_hits")
        return present

    def _promote_into_cpu(self, key: BlockKey, value: BytesLike) -> bool:
        if memoryview(value).nbytes > self.cpu.slot_bytes:
            return False
        with self._lock:
            self._clean.add(key)
        ok = self.cpu.put(key, value)
        if not ok:
            with self._lock:
                self._clean.discard(key)
        self._bump("promotions", int(ok))
        return ok

    def lookup_prefix(self, keys: Sequence[BlockKey]) -> PrefixAvailability:
        """Per tier (cpu, redis, either) how much of the chain ``keys`` is available."""
        chain = _usable_chain(keys)
        in_cpu = self.cpu.contains_many(chain)
        if self.redis is not None and chain:
            in_redis = self.redis.exists_many(chain)
        else:
            in_redis = [False] * len(chain)
        either = [a or b for a, b in zip(in_cpu, in_redis, strict=True)]
        return PrefixAvailability(
            cpu=chain_availability(chain, in_cpu),
            redis=chain_availability(chain, in_redis),
            any=chain_availability(chain, either),
        )

    # ------------------------------------------------------------------ housekeeping
    def _bump(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._n[name] += n

    def flush(self, timeout: float | None = None) -> bool:
        return self.redis.flush(timeout) if self.redis is not None else True

    def stats(self) -> dict[str, object]:
        with self._lock:
            out: dict[str, object] = dict(self._n)
        out["write_mode"] = self.write_mode
        out["cpu"] = self.cpu.stats()
        out["redis"] = self.redis.stats() if self.redis is not None else None
        return out

    def close(self, timeout: float = 5.0) -> None:
        if self.redis is not None:
            self.redis.close(timeout)
