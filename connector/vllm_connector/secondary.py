"""The scheduler half's secondary tiers: where a key the engine's own CPU tier lacks may be.

A hit is found in the first tier that holds every rank's shard of one save: the engine's
CPU tier (the scheduler's own directory), then each :class:`SecondaryTier` of the chain in
order, the host tier (:class:`HostTierBooks`) before Redis (:class:`RedisBooks`). Each one
answers, on books only (no I/O on the scheduler's path):

* a look-up (:meth:`SecondaryTier.lookup`): where a key is (:meth:`TierLookup.locate`: a
  place, :data:`ASK`, or not here), then the keys it was asked to find later
  (:meth:`TierLookup.settle`: found, or "ask again");
* a hit's keys held until loaded (:meth:`~SecondaryTier.hold`, :meth:`~SecondaryTier.let_go`)
  and the fetch op that brings each back (:meth:`~SecondaryTier.fetch`,
  :meth:`~SecondaryTier.fetched`);
* what the store planner and the step need: whether it already holds a save
  (:meth:`~SecondaryTier.has`), the rank-0 layout, gauges, close.

Adding a tier adds a class here, never a branch in the scheduler.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from connector.events.wire import Medium
from connector.vllm_connector.backfill import Backfill
from connector.vllm_connector.config import TieredConfig
from connector.vllm_connector.host import HostTierMirror
from connector.vllm_connector.jobs import JobBook, TierChange
from connector.vllm_connector.plan import FetchFrom, FetchOp, HostShard, LoadFrom, ProbeOp
from connector.vllm_connector.presence import PresenceFactory, RedisPresence
from connector.vllm_connector.stats import ConnectorCounters
from offload_tiers.cpu_tier import CpuTier
from offload_tiers.host_tier.client import Pins
from offload_tiers.keys import BlockKey

log = logging.getLogger(__name__)

class HitSource(enum.StrEnum):
    """Where a hit came from (the ``hit_tokens_<source>`` counters): the engine's own CPU
    tier, or a tier of the chain."""

    CPU = "cpu"
    HOST = "host"  # the host's shared CPU tier (connector/vllm_connector/host.py)
    REDIS = "redis"


#: A place :meth:`TierLookup.locate` cannot give now: the key is worth asking about (a Redis
#: probe); :meth:`TierLookup.settle` answers once the workers did.
ASK = object()
_BAD_KEYS_MAX = 1 << 14


@dataclass(slots=True)
class Held:
    """A hit's key held until it is loaded: the CPU-tier slot its load reads (None: the
    tier's own memory, the host tier's segment), and the host-tier pins if any."""

    slot: int | None
    pins: Pins | None = None


class TierLookup(Protocol):
    """One look-up's questions to one tier."""

    def locate(self, key: BlockKey) -> object | None:
        """Where ``key`` is (the tier's place), :data:`ASK`, or None: not here."""
        ...

    def settle(self, asked: list[BlockKey]) -> dict[BlockKey, object] | None:
        """The places of the ``asked`` keys it holds, once known; None: ask again."""
        ...


class SecondaryTier(Protocol):
    """One tier of the chain, as the scheduler half keeps its books."""

    #: ``hit_tokens_<source>``; the key of :meth:`TieredScheduler.hit_tiers`.
    source: HitSource
    #: where a hit's loads read: a CPU-tier slot its fetch fills, or the tier's own memory
    load_from: LoadFrom

    def lookup(self, req_id: str, dry: bool = False) -> TierLookup:
        """The questions of one look-up (``dry``: vLLM's ``may_load_async``: nothing asked
        of the workers, nothing counted)."""
        ...

    def hold(self, key: BlockKey, where: object) -> Held | None:
        """Keep ``key`` where it is until loaded (None: it cannot be: a miss now)."""
        ...

    def let_go(self, key: BlockKey, held: Held) -> None: ...

    def fetch(self, job: int, req_id: str, key: BlockKey, held: Held, where: object
              ) -> FetchOp:
        """The workers' fetch of ``key`` for its load (job ``job``)."""
        ...

    def asks_again(self, req_id: str) -> bool:
        """A look-up of ``req_id`` asked with what its last "ask again" was asked with may
        answer "ask again" at once: an answer this tier waits on for it is still out (the
        ask is counted, and bounded as a full look-up's)."""
        ...

    def fetched(self, job: int, key: BlockKey, ok: bool) -> None:
        """Every rank reported job ``job`` (``ok``: all read it, valid)."""
        ...

    def has(self, key: BlockKey) -> bool:
        """A save of ``key`` would be a second copy of what this tier holds."""
        ...

    @property
    def takes_copies(self) -> bool:
        """Saves are copied into this tier by the workers (``SaveOp.to_host``)."""
        ...

    def begin_step(self) -> bool | None:
        """A step's plan begins: whether rank 0's layout arrived (None: none needed)."""
        ...

    def set_layout(self, layout: str) -> None: ...

    def finished(self, req_id: str) -> None:
        """``req_id`` is gone: drop what a look-up of it keeps."""
        ...

    def refresh_gauges(self) -> None: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------- host tier
class _HostLookup:
    def __init__(self, host: HostTierMirror, count: Callable[[int], None] | None) -> None:
        self.host = host if host.ready else None
        self.count = count

    def locate(self, key: BlockKey) -> object | None:
        if self.host is None:
            return None
        where = self.host.locate(key)
        if self.host.mixed:  # every rank's shard there, of different saves: a miss
            if self.count is not None:
                self.count(self.host.mixed)
            self.host.mixed = 0
        return where

    def settle(self, asked: list[BlockKey]) -> dict[BlockKey, object] | None:
        return {}


class HostTierBooks:
    """The host's shared CPU tier (``kvtier daemon --cpu-bytes``), through a mirror of its
    directory: a key is there when every rank's shard is, of one save; its slots are pinned
    until every rank loaded it straight from the shared segment."""

    source = HitSource.HOST
    load_from = LoadFrom.HOST  # straight from the shared segment: no CPU-tier slot

    def __init__(self, host: HostTierMirror, counters: ConnectorCounters) -> None:
        self.host = host
        self.counters = counters
        self._fetches: dict[int, Pins | None] = {}  # fetch job -> its shards' pins

    def lookup(self, req_id: str, dry: bool = False) -> TierLookup:
        return _HostLookup(self.host, None if dry else self._count_mixed)

    def _count_mixed(self, n: int) -> None:
        self.counters.add("host_mixed_saves", n)

    def hold(self, key: BlockKey, where: object) -> Held | None:
        assert isinstance(where, tuple)
        return Held(None, self.host.pin(where))

    def let_go(self, key: BlockKey, held: Held) -> None:
        self.host.unpin(held.pins)

    def fetch(self, job: int, req_id: str, key: BlockKey, held: Held, where: object
              ) -> FetchOp:
        assert isinstance(where, tuple)
        self._fetches[job] = held.pins
        held.pins = None  # the job's now: let go when every rank reported
        self.host.touch(key)  # used: last in the daemon's LRU
        return FetchOp(job, req_id, None, key, FetchFrom.HOST, None,
                       tuple(HostShard(w.slot, w.save_id, w.length) for w in where))

    def fetched(self, job: int, key: BlockKey, ok: bool) -> None:
        # Every rank loaded its shard before reporting (or failed): the pins go. The host
        # tier's copy stays the only one on this host.
        self.host.unpin(self._fetches.pop(job, None))
        if not ok:  # evicted or reused since the look-up: the mirror catches up
            self.counters.add("host_misses_at_fetch")

    def asks_again(self, req_id: str) -> bool:
        return False  # its look-ups never wait: the mirror answers at once

    def has(self, key: BlockKey) -> bool:
        return self.host.ready and self.host.has(key)

    @property
    def takes_copies(self) -> bool:
        return self.host.ready

    def begin_step(self) -> bool | None:
        return self.host.layout is not None

    def set_layout(self, layout: str) -> None:
        self.host.set_layout(layout)

    def finished(self, req_id: str) -> None:
        """Nothing per request: pins belong to holds and fetch jobs."""

    def refresh_gauges(self) -> None:
        self.counters.set_gauge("host_tier_available", int(self.host.client.available))
        self.counters.set_gauge("host_tier_entries", len(self.host.client.mirror))

    def close(self) -> None:
        self.host.close()


# ---------------------------------------------------------------------------- Redis
def _always(key: BlockKey) -> bool:
    return True


def _never(key: BlockKey) -> bool:
    return False


@dataclass(slots=True)
class _Probe:
    """One request's Redis question: keys asked (over one or more probe jobs), the save id
    every rank read for each answered key (0 or ``MIXED_SAVES``: not a hit), and how
    many times the lookup answered "ask again" (never reset while the request waits)."""

    asked: set[BlockKey] = field(default_factory=set)
    answers: dict[BlockKey, int] = field(default_factory=dict)
    asks: int = 0
    # The keys worth asking (the presence summary's "maybe"); None = every missing key.
    worth: set[BlockKey] | None = None


class _RedisLookup:
    """A look-up's Redis questions: which missing keys are worth a probe (the presence
    summary decides at the request's first look-up; later asks keep that answer, so a
    growing summary adds no probe rounds), then the probe's answers."""

    def __init__(self, books: RedisBooks, req_id: str, dry: bool) -> None:
        self.books = books
        self.req_id = req_id
        self.dry = dry
        self.may_hold, self.decided_now = books.may_hold(req_id, dry)
        self.ruled_out = 0  # keys the presence summary said no kvtier engine stored

    def locate(self, key: BlockKey) -> object | None:
        if self.books.is_bad(key):
            return None
        if self.may_hold(key):
            return ASK
        self.ruled_out += 1
        return None

    def settle(self, asked: list[BlockKey]) -> dict[BlockKey, object] | None:
        if self.decided_now:
            self.books.remember_worth(self.req_id, asked, self.ruled_out)
        if not asked:
            return {}
        found: dict[BlockKey, object] = {}
        return found if self.books.answer(self.req_id, tuple(asked), found) else None


class RedisBooks:
    """Redis as the scheduler half knows it: whether it is configured and answering (each
    rank's last word), which keys are worth a probe (the presence summary), the probes out
    per request, keys whose value failed a fetch, what this engine wrote (for KV events)
    and what it saved while Redis was down (the backfill). A hit's Redis key gets a
    reserved CPU-tier slot the workers fetch its value into."""

    source = HitSource.REDIS
    load_from = LoadFrom.FETCHED_SLOT
    takes_copies = False  # saves reach Redis from the CPU tier's slots (SaveOp.to_redis)

    def __init__(self, config: TieredConfig, world_size: int, directory: CpuTier,
                 jobs: JobBook, counters: ConnectorCounters, outbox: Any,
                 plan_probe: Callable[[ProbeOp], None],
                 presence: PresenceFactory | None) -> None:
        self.config = config
        self.directory = directory
        self.jobs = jobs
        self.counters = counters
        self.outbox = outbox
        self._plan_probe = plan_probe
        # Redis of this engine's own, or reached through the host tier's daemon
        self.configured = bool(config.redis_url) or config.host_tier_redis
        self.up = self.configured  # until a worker says otherwise
        self._up_by_rank: dict[int, int] = {}  # each rank's last word (on change only)
        if self.configured:
            counters.set_gauge("redis_configured", 1)
        counters.set_gauge("redis_available", int(self.up))
        # Entries saved to the CPU tier only (Redis down, or the write failed): written to
        # Redis from their slots once it answers again (connector/vllm_connector/backfill.py).
        self.backfill = Backfill(directory.num_slots) if (
            config.redis_backfill and config.redis_url and config.write_mode == "back") else None
        # "Ask again" answers one request may get while its Redis probe is out. Answers come
        # back in a later step's worker report whatever the step took (no wall clock); the
        # bound only keeps a request from waiting for ever on an answer that never comes.
        self.max_probe_asks = config.max_probe_asks
        self._probes: dict[str, _Probe] = {}
        self._probe_reqs: dict[int, str] = {}  # probe job -> request
        self.written: OrderedDict[BlockKey, None] = OrderedDict()  # this engine's writes
        # Keys whose Redis value failed a fetch: not offered again until this engine rewrites
        # them or ``bad_key_ttl_s`` passes (so a corrupt value cannot make a request retry
        # forever, and a value rewritten by another engine is served again later).
        self._bad: OrderedDict[BlockKey, float] = OrderedDict()
        self.bad_key_ttl_s = 30.0
        # Which keys Redis may hold, known without waiting (None: every miss is probed).
        self.presence: RedisPresence | None = presence(config, world_size, counters) \
            if presence is not None and self.configured else None

    # ------------------------------------------------------------------ look-ups
    def lookup(self, req_id: str, dry: bool = False) -> TierLookup:
        return _RedisLookup(self, req_id, dry)

    def may_hold(self, req_id: str, dry: bool) -> tuple[Callable[[BlockKey], bool], bool]:
        """Which keys missing from the tiers before it are worth a Redis probe, and whether
        the presence summary decides it in this look-up (its first)."""
        if not self.configured or not self.up:
            return (_never if dry or not self.configured else _always), False
        if self.presence is None:
            return _always, False  # without a summary every miss is probed
        if dry:
            return (self.presence.may_hold_key if self.presence.ready() else _always), False
        probe = self._probes.get(req_id)
        if probe is not None:
            return (_always if probe.worth is None else probe.worth.__contains__), False
        if not self.presence.ready():
            self.counters.add("presence_not_ready")
            return _always, False
        return self.presence.may_hold_key, True

    def remember_worth(self, req_id: str, asked: list[BlockKey], ruled_out: int) -> None:
        """The summary's first answer for a request: its keys to probe are kept for the asks
        that follow; none answers the look-up at once (``presence_known_absent``)."""
        if ruled_out:
            self.counters.add("presence_keys_skipped", ruled_out)
        if asked:
            self._probes[req_id] = _Probe(worth=set(asked))
        elif ruled_out:
            self.counters.add("presence_known_absent")

    def answer(self, req_id: str, missing: tuple[BlockKey, ...],
               found: dict[BlockKey, object]) -> bool:
        """Fill ``found`` with the Redis-held keys among ``missing`` (each with the save every
        rank read); False = ask again.

        Keys not asked yet go to the workers as a probe job; the answer comes through a later
        worker report, counted in engine steps, not seconds. A key is held only where every
        rank read the same save. Redis known down at the first ask skips Redis
        (``redis_lookup_skips``); a request that got ``max_probe_asks`` "ask again" answers
        is answered from what is known (``probe_gave_up``).
        """
        if not self.configured:
            return True
        probe = self._probes.get(req_id)
        if probe is None:
            if not self.up:
                self.counters.add("redis_lookup_skips")
                return True
            probe = self._probes[req_id] = _Probe()
        new = tuple(k for k in missing if k not in probe.asked)
        if new and self.up:
            job = self.jobs.open_probe(new)
            self._probe_reqs[job] = req_id
            probe.asked.update(new)
            self._plan_probe(ProbeOp(job, new))
        if not all(k in probe.answers for k in missing if k in probe.asked):
            if probe.asks < self.max_probe_asks:
                probe.asks += 1
                self.counters.add("probe_waits")
                return False
            self.counters.add("probe_gave_up")
        del self._probes[req_id]
        for k in missing:
            save_id = probe.answers.get(k, 0)
            if save_id > 0:
                found[k] = save_id
        return True

    def asks_again(self, req_id: str) -> bool:
        probe = self._probes.get(req_id)
        if probe is None or probe.asks >= self.max_probe_asks \
                or all(k in probe.answers for k in probe.asked):
            return False
        probe.asks += 1
        self.counters.add("probe_waits")
        return True

    def probe_done(self, job: int, keys: tuple[BlockKey, ...], save_ids: list[int]) -> None:
        req_id = self._probe_reqs.pop(job, None)
        probe = self._probes.get(req_id) if req_id is not None else None
        if probe is not None:
            probe.answers.update(zip(keys, save_ids, strict=True))
        if self.presence is not None:
            for key, save_id in zip(keys, save_ids, strict=True):
                if save_id > 0:
                    self.presence.confirmed(key)

    def is_bad(self, key: BlockKey) -> bool:
        until = self._bad.get(key)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        del self._bad[key]
        return False

    # ------------------------------------------------------------------ hits
    def hold(self, key: BlockKey, where: object) -> Held | None:
        slot = self.directory.reserve(key)
        if slot is None:
            self.counters.add("store_drops")  # every slot pinned or being written
            return None
        return Held(slot)

    def let_go(self, key: BlockKey, held: Held) -> None:
        self.directory.abort(key)

    def fetch(self, job: int, req_id: str, key: BlockKey, held: Held, where: object
              ) -> FetchOp:
        assert isinstance(where, int)
        return FetchOp(job, req_id, held.slot, key, FetchFrom.REDIS, where)

    def fetched(self, job: int, key: BlockKey, ok: bool) -> None:
        if ok:
            self.directory.commit(key)
            self.outbox.append(TierChange(key, Medium.CPU, stored=True))
            self._bad.pop(key, None)
            return
        self.directory.abort(key)
        self.counters.add("redis_misses_at_fetch")
        self._bad[key] = time.monotonic() + self.bad_key_ttl_s
        self._bad.move_to_end(key)
        while len(self._bad) > _BAD_KEYS_MAX:
            self._bad.popitem(last=False)

    # ------------------------------------------------------------------ saves and steps
    def has(self, key: BlockKey) -> bool:
        return False  # a save goes to Redis again (this engine's save id)

    @property
    def accepts_saves(self) -> bool:
        """A save planned now is written to Redis."""
        return self.configured and self.up

    def set_up(self, by_rank: dict[int, int]) -> None:
        """Ranks' words on their Redis (only changes are sent): up when all say so."""
        self._up_by_rank.update(by_rank)
        self.up = all(self._up_by_rank.values())
        self.counters.set_gauge("redis_available", int(self.up))

    def wrote(self, key: BlockKey) -> None:
        """Every rank wrote ``key`` (this engine's save): valid again, announced."""
        self._bad.pop(key, None)  # rewritten by this engine: valid again
        if self.presence is not None:
            self.presence.stored(key)
        if key not in self.written:
            self.written[key] = None
            self.outbox.append(TierChange(key, Medium.STORAGE, stored=True))
            while len(self.written) > self.directory.num_slots * 4:
                self.written.popitem(last=False)

    def announce_writes(self) -> None:
        """A worker report was applied: announce the keys it confirmed written now, not at
        the next step's start (an engine may idle after its last report)."""
        if self.presence is not None:
            self.presence.announce()

    def begin_step(self) -> bool | None:
        """The presence summary takes in what its feed learned."""
        if self.presence is None:
            return None
        self.presence.refresh()
        return self.presence.layout is not None

    def set_layout(self, layout: str) -> None:
        if self.presence is not None:
            self.presence.set_layout(layout)

    def finished(self, req_id: str) -> None:
        self._probes.pop(req_id, None)  # its jobs' answers, when they come, find no one

    def refresh_gauges(self) -> None:
        """Its gauges move as the workers report (``set_up``)."""

    def reset(self) -> None:
        """A connector-cache reset: what this engine wrote and owes Redis is forgotten."""
        self.written.clear()
        if self.backfill is not None:
            self.backfill.clear()

    def close(self) -> None:
        if self.presence is not None:
            self.presence.close()


__all__ = ["ASK", "Held", "HitSource", "HostTierBooks", "RedisBooks", "SecondaryTier",
           "TierLookup"]
