"""The running daemon: ingest thread + the state the HTTP handlers read, and its parts
(:mod:`connector.daemon.parts`: janitor, host tier, presence feed), started and stopped
with it."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from connector.daemon.config import DaemonConfig
from connector.daemon.ingest import Ingestor
from connector.daemon.parts import DaemonParts, build_parts
from connector.daemon.requests import LookupRequest, ScoreRequest
from connector.daemon.subscriber import Subscriber
from connector.events.index import KIND_NAMES, ResidencyPolicy, publisher_id
from connector.events.score import check_unit, prefixes, rank
from connector.events.token_hashing import TokenHasher
from connector.events.wire import Medium

if TYPE_CHECKING:  # imported only when the daemon runs it
    from offload_tiers.host_tier.server import HostTierServer

__all__ = ["Daemon", "LookupRequest", "ScoreRequest"]


class Daemon:
    """Wires config -> subscriber -> ingestor, and holds the daemon's parts (janitor, host
    tier, presence feed); answers look-ups, stats and metrics."""

    def __init__(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg
        self.lock = threading.Lock()
        self.ingestor = Ingestor(cfg.block_sizes, max_entries=cfg.max_entries,
                                 policy=residency_policy(cfg))
        self.subscriber = Subscriber(cfg, self.ingestor, self.lock)
        self.started = time.time()
        th = cfg.token_hashing
        self.token_hasher = (TokenHasher(th.algo, th.hash_block_size, th.seed)
                             if th is not None else None)
        self.parts: DaemonParts = build_parts(cfg)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_DaemonCollector(self))
        if self.parts.janitor is not None:
            from connector.daemon.janitor_metrics import JanitorCollector

            self.registry.register(JanitorCollector(self.parts.janitor))

    def start(self) -> None:
        if self.parts.host_tier is not None:
            self.parts.host_tier.start()
        self.subscriber.start()
        if self.parts.janitor is not None:
            self.parts.janitor.start()

    def stop(self) -> None:
        if self.parts.janitor is not None:
            self.parts.janitor.stop()
        self.subscriber.stop()
        if self.parts.host_tier is not None:
            self.parts.host_tier.stop()

    def known_publishers(self) -> set[str]:
        """Publisher ids a look-up may name: every configured one at each of its DP ranks,
        and every one heard from."""
        with self.lock:
            heard = set(self.ingestor.publishers) | self.ingestor.index.publishers()
        return heard | {publisher_id(p.source_name, r) for p in self.cfg.publishers
                        for r in range(p.dp_size)}

    def media_seen(self) -> set[str]:
        """Media the index holds entries on (a /score body may weigh them besides the three)."""
        with self.lock:
            return {medium for medium, _kind in self.ingestor.index.entry_counts()}

    def lookup(self, req: LookupRequest) -> dict[str, Any]:
        if req.publisher is not None:
            known = self.known_publishers()
            if req.publisher not in known:  # a typo would answer zeros: say so instead
                shown = ", ".join(sorted(known)[:20]) or "none yet"
                raise ValueError(f"'publisher' {req.publisher!r} is not a publisher of this "
                                 f"daemon; known: {shown}")
        with self.lock:
            self.ingestor.index.expire(time.time())  # never claim past a TTL
            result = self.ingestor.index.lookup(
                req.block_hashes, group=req.group_idx, unit=req.unit, publisher=req.publisher)
        return {m: r.as_dict() for m, r in result.items()}

    def score(self, req: ScoreRequest) -> dict[str, Any]:
        """Engines ranked for ``req`` (POST /score). Only the walk holds the lock: the chain
        was hashed when the body was parsed, weights and ranking come after."""
        with self.lock:
            self.ingestor.index.expire(time.time())  # never claim past a TTL
            found = prefixes(self.ingestor.index, req.block_hashes, unit=req.unit,
                             groups=req.groups, publishers=tuple(self.ingestor.publishers))
        check_unit(found, req.unit)
        return {"unit": req.unit, "weights": req.weights,
                "engines": [s.as_dict() for s in rank(found, req.weights)]}

    def entries(self, req: LookupRequest) -> list[dict[str, Any]]:
        with self.lock:
            out = self.ingestor.index.describe(req.block_hashes, group=req.group_idx)
        for e in out:
            if isinstance(e["block_hash"], bytes):
                e["block_hash"] = e["block_hash"].hex()
        return out

    def entry_counts(self) -> dict[tuple[str, str], int]:
        """Entries by (medium, kind); maintained incrementally by the index."""
        with self.lock:
            return self.ingestor.index.entry_counts()

    def stats(self) -> dict[str, Any]:
        ing = self.ingestor
        idx = ing.index
        with self.lock:
            pubs = {name: {
                "batches": st.batches, "stored_events": st.stored_events,
                "removed_events": st.removed_events, "cleared_events": st.cleared_events,
                "invalid_events": st.invalid_events,
                "reannounced_events": st.reannounced_events,
                "last_lag_s": round(st.last_lag_s, 6),
                "max_lag_s": round(st.max_lag_s, 6),
            } for name, st in ing.publishers.items()}
            sources = [{
                "name": s.name, "rank": s.rank, "endpoint": s.endpoint, "binds": s.binds,
                "replay_endpoint": s.replay_endpoint, "next_seq": s.expected,
                "replaying": s.replaying, **{k: v for k, v in vars(s.counters).items()},
            } for s in self.subscriber.sources]
            block_sizes = {f"{p}/{g}": b for (p, g), b in ing.sizes.learned.items()}
            block_sizes.update({f"*/{g}": b for g, b in ing.sizes.configured.items()})
            index = {
                "entries": idx.n_entries, "max_entries": idx.max_entries,
                "hash_stores": idx.stores, "hash_removals": idx.removals,
                "unknown_removals": idx.unknown_removals,
                "dropped_capacity": idx.dropped_capacity, "clears": idx.clears,
                "expired": idx.expired,
                "pending": sum(len(d) for d in ing.classifier.pending.values()),
                "orphans": sum(len(d) for d in ing.classifier.orphans.values()),
                "invalid_events": ing.classifier.invalid_events,
                "block_size_conflicts": ing.classifier.conflicts,
                "block_sizes": block_sizes,
                "group_kinds": {f"{p}/{g}": k for (p, g), k in idx.group_kinds.items()},
            }
        counts = self.entry_counts()
        index["by_medium_kind"] = {f"{m}/{k}": c for (m, k), c in sorted(counts.items())}
        out = {"uptime_s": round(time.time() - self.started, 3), "pid": os.getpid(),
               "rss_bytes": _rss_bytes(), "decode_errors": ing.decode_errors,
               "index": index, "publishers": pubs, "sources": sources}
        if self.parts.janitor is not None:
            out["janitor"] = self.parts.janitor.stats()
        if self.parts.host_tier is not None:
            out["host_tier"] = self.parts.host_tier.stats()
        return out

    def metrics_text(self) -> bytes:
        return generate_latest(self.registry)


def residency_policy(cfg: DaemonConfig) -> ResidencyPolicy:
    """Sets vs refcounts per publisher, and the STORAGE TTL, from the configuration."""
    ttl = {Medium.STORAGE: cfg.storage_ttl_s} if cfg.storage_ttl_s is not None else None
    return ResidencyPolicy(by_source={p.source_name: p.set_media_all() for p in cfg.publishers},
                           ttl_s=ttl)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# Per-source counters (connector.daemon.subscriber.SourceCounters) -> metric name, help.
_SOURCE_METRICS = {
    "gaps": ("kvtier_daemon_gaps", "Sequence gaps detected"),
    "missing_batches": ("kvtier_daemon_gap_batches_unrepaired",
                        "Batches lost in gaps that replay could not repair"),
    "repaired_batches": ("kvtier_daemon_gap_batches_repaired",
                         "Batches recovered by replay"),
    "replays_requested": ("kvtier_daemon_replays", "Replay requests sent"),
    "replay_timeouts": ("kvtier_daemon_replay_timeouts", "Replays that timed out"),
    "idle_probes": ("kvtier_daemon_idle_probes", "Replay probes sent while idle"),
    "probe_timeouts": ("kvtier_daemon_probe_timeouts", "Idle probes unanswered"),
    "duplicates": ("kvtier_daemon_duplicate_batches", "Duplicate/old batches skipped"),
    "restarts": ("kvtier_daemon_publisher_restarts", "Publisher restarts seen"),
    "decode_errors": ("kvtier_daemon_decode_errors", "Payloads that did not decode"),
    "malformed_frames": ("kvtier_daemon_malformed_frames",
                         "Messages with wrong frame layout"),
}


class _DaemonCollector(Collector):
    """Reads the daemon's plain-int counters at scrape time (no cost on the hot path)."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    def collect(self) -> Iterator[Any]:
        d = self.d
        ing = d.ingestor
        idx = ing.index
        counts = d.entry_counts()
        with d.lock:
            ev = CounterMetricFamily("kvtier_daemon_events", "KV events applied",
                                     labels=["publisher", "type"])
            batches = CounterMetricFamily("kvtier_daemon_batches", "Event batches applied",
                                          labels=["publisher"])
            lag = GaugeMetricFamily("kvtier_daemon_lag_seconds",
                                    "Now minus the last applied batch's timestamp",
                                    labels=["publisher"])
            max_lag = GaugeMetricFamily("kvtier_daemon_max_lag_seconds",
                                        "Largest lag seen", labels=["publisher"])
            reann = CounterMetricFamily(
                "kvtier_daemon_reannounced_events",
                "GPU stores of only resident hashes from the chain start (the shape of "
                "vLLM's kv_cache_report_mode=full)", labels=["publisher"])
            for name, st in ing.publishers.items():
                ev.add_metric([name, "BlockStored"], st.stored_events)
                ev.add_metric([name, "BlockRemoved"], st.removed_events)
                ev.add_metric([name, "AllBlocksCleared"], st.cleared_events)
                ev.add_metric([name, "invalid"], st.invalid_events)
                batches.add_metric([name], st.batches)
                lag.add_metric([name], st.last_lag_s)
                max_lag.add_metric([name], st.max_lag_s)
                reann.add_metric([name], st.reannounced_events)
            hashes = CounterMetricFamily("kvtier_daemon_hashes", "Hash announcements applied",
                                         labels=["op"])
            hashes.add_metric(["stored"], idx.stores)
            hashes.add_metric(["removed"], idx.removals)
            hashes.add_metric(["unknown_removed"], idx.unknown_removals)
            hashes.add_metric(["dropped_capacity"], idx.dropped_capacity)
            hashes.add_metric(["expired"], idx.expired)
            total = GaugeMetricFamily("kvtier_daemon_index_entries",
                                      "Resident (residency key, hash) entries")
            total.add_metric([], idx.n_entries)
            fams = {k: CounterMetricFamily(n, h, labels=["source", "rank"])
                    for k, (n, h) in _SOURCE_METRICS.items()}
            for s in d.subscriber.sources:
                c = vars(s.counters)
                for k, fam in fams.items():
                    fam.add_metric([s.name, str(s.rank)], c[k])
        entries = GaugeMetricFamily("kvtier_daemon_entries", "Resident entries",
                                    labels=["medium", "kind"])
        for m in sorted({*Medium, *(m for m, _ in counts)}):
            for k in KIND_NAMES:
                entries.add_metric([m, k], counts.get((m, k), 0))
        rss = GaugeMetricFamily("kvtier_daemon_rss_bytes", "Resident set size")
        rss.add_metric([], _rss_bytes())
        yield from (ev, batches, lag, max_lag, reann, hashes, total, entries, rss,
                    *fams.values(), *_host_tier_metrics(d.parts.host_tier))


#: host tier stats that are states (they go up and down): exported as gauges. Every other
#: numeric stat counts something since the daemon started and is exported as a counter.
HOST_TIER_GAUGES = frozenset({
    "entries", "free_slots", "draining_slots", "held_entries", "leased_slots", "clients",
    "num_slots", "slot_bytes", "bytes_used", "redis_available", "redis_write_queue",
    "redis_write_queue_bytes", "presence_synced", "presence_window", "redis", "connections",
    "quarantined_clients",
})

#: HELP of every numeric host tier stat (``kvtier_host_tier_<name>``): the server's, its
#: directory's (offload_tiers/host_tier/directory.py) and its Redis service's (redis_service.py).
HOST_TIER_HELP: dict[str, str] = {
    # directory: counters
    "leased": "Slots leased to engines for a save",
    "lease_shortfall": "Slots asked for and not granted (every slot pinned or leased)",
    "commits": "Saves committed into the directory",
    "duplicates_dropped": "Commits of a key already held, dropped (their slot freed)",
    "commits_rejected": "Commits refused: slot not leased to the client, or its header not "
                        "that save's",
    "evictions": "Entries evicted to free a slot (least recently used first)",
    "touches": "Entries marked used by a restore (evicted last)",
    "evicted_while_pinned": "Evicted entries that were pinned, drained before their slot "
                            "was reused",
    "clients_attached": "Engine processes attached",
    "clients_released": "Engine processes released (closed, or found gone)",
    "leases_reclaimed": "Leased slots taken back from released clients",
    "abandoned_writes": "Leased slots a released client had begun writing and never "
                        "committed (discarded)",
    "pins_reclaimed": "Pins dropped for released clients",
    "replaced": "Entries of another save replaced by the save a restore asked for",
    # directory: state
    "entries": "Entries held (committed saves)",
    "free_slots": "Slots free",
    "draining_slots": "Slots evicted while pinned, waiting for their pins to go",
    "held_entries": "Entries kept from eviction until their bytes are read (e.g. by the "
                    "Redis write-behind)",
    "leased_slots": "Slots leased to clients and not yet committed",
    "clients": "Clients holding leases",
    "num_slots": "Slots in the shared segment",
    "slot_bytes": "Bytes per slot",
    "bytes_used": "Bytes of the entries held",
    # Redis service (with --redis-url)
    "redis_writes_queued": "Saves queued for writing behind to Redis",
    "redis_writes": "Saves written to Redis",
    "redis_write_failures": "Writes to Redis that failed (kept for backfill)",
    "redis_writes_skipped": "Writes skipped: the slot was reused before it was read back",
    "redis_probes": "Redis probes asked by engines",
    "redis_restores_asked": "Keys engines asked to restore from Redis",
    "redis_restored": "Keys restored from Redis into host tier slots",
    "redis_restore_misses": "Restores that found nothing usable (absent, invalid, another "
                            "save, or no free slot)",
    "redis_restores_already_held": "Restores answered from the directory, no Redis read",
    "redis_backfills": "Failed writes submitted again once Redis answered",
    "redis_backfilled": "Saves written to Redis by a backfill",
    "redis_backfill_failures": "Backfill writes that failed",
    "redis_backfill_skipped": "Backfill writes skipped: the slot was reused first",
    "redis_backfill_dropped": "Failed writes not kept for backfill (more than the tier has "
                              "slots)",
    "redis_available": "1 while Redis answers, else 0",
    "redis_write_queue": "Writes waiting for the Redis writer",
    "redis_write_queue_bytes": "Bytes waiting for the Redis writer",
    "redis_announced": "Keys announced on the presence stream",
    "presence_synced": "1 once the presence feed has walked the prefix's key names, else 0",
    "redis_announce_dropped": "Presence announcements dropped (queue full or feed off)",
    "presence_learned_dropped": "Presence digests learned and dropped before engines took them",
    "presence_learned": "Presence digests learned (stream and key walk)",
    "presence_window": "Presence digests kept for engines that attach later",
    # server
    "redis": "1 when the host tier writes behind to Redis, else 0",
    "connections": "Open client connections",
    "quarantined_clients": "Clients whose connection was lost while their process lives "
                           "(slots held until it exits)",
    "rows_reused": "Pin-table rows given back to a reconnecting client",
    "stale_requests": "Commits or abandons naming another daemon run, refused",
    "backlog_disconnects": "Clients disconnected for not draining their snapshot and changes",
    "protocol_errors": "Connections closed on a malformed or out-of-order message",
    "refused": "Clients refused at hello (another protocol version, too many rows for "
               "one process, every row taken)",
}


def _host_tier_metrics(host_tier: HostTierServer | None) -> Iterator[Any]:
    if host_tier is None:
        return
    for name, value in host_tier.stats().items():
        if not isinstance(value, int):
            continue
        help_text = HOST_TIER_HELP.get(name, f"host tier stat {name} (undocumented)")
        if name in HOST_TIER_GAUGES:
            fam: Any = GaugeMetricFamily(f"kvtier_host_tier_{name}", help_text)
        else:
            fam = CounterMetricFamily(f"kvtier_host_tier_{name}", help_text)
        fam.add_metric([], value)
        yield fam
