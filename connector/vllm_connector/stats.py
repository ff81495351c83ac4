"""The connector's counters: cumulative totals, per-interval deltas, and Prometheus export.

Counters are plain integers bumped by the scheduler and worker halves (one process). vLLM
collects a delta every step through ``get_kv_connector_stats``; ``snapshot()`` gives the
cumulative totals at any time (what the demo and the benchmarks read). Redis degradation is
visible as ``redis_available`` (0/1) plus the error and skip counters.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

COUNTER_NAMES: tuple[str, ...] = (
    "lookups",  # requests the scheduler asked about
    "lookup_tokens",  # tokens beyond the local GPU hit that were looked up
    "hit_tokens_cpu",  # tokens served from the CPU tier
    "hit_tokens_redis",  # tokens served from Redis
    "hit_requests",  # requests with an external hit
    "rounded_down_tokens",  # tokens present but not served (group alignment / hybrid rule)
    "hybrid_hits_withheld",  # tokens a hybrid model could restore, withheld (hybrid_hits off)
    "blocks_loaded_cpu",
    "blocks_loaded_redis",
    "bytes_loaded",  # bytes written into vLLM's KV cache by loads
    "blocks_saved",
    "partial_blocks_saved",
    "promotions",  # PARTIAL entries superseded by their FULL block
    "bytes_saved_cpu",  # bytes gathered into the CPU tier
    "blocks_written_redis",
    "bytes_written_redis",
    "store_drops",  # saves that found no CPU slot, or a Redis write that failed/was dropped
    "redis_write_failures",
    "load_errors",  # blocks reported to vLLM as failed loads (then recomputed)
    "redis_misses_at_fetch",  # Redis said present, but the value was gone or invalid
    "redis_lookup_skips",  # lookups that skipped Redis because it was unavailable
    "redis_unavailable_steps",  # steps that saw Redis unavailable
    "events_emitted",
    "refused_loads",  # hits vLLM accepted only in part: not loaded (vLLM computes them)
    "saves_skipped_after_failed_load",  # blocks of a step whose load failed: never stored
    "redis_unavailable_saves",  # saves planned for the CPU tier only: Redis was down
    "cpu_evictions",  # CPU-tier entries evicted to make room
    "redis_unavailable_events",  # a worker's Redis went from answering to not answering
    "redis_recoveries",  # ... and back
    "redis_corrupt_values",  # Redis values that failed validation (header, checksum, length)
    "failed_restores",  # restores (requests) whose Redis values did not validate: recomputed
    "failed_restore_tokens",
    "overflow_saves",  # saves that found every CPU slot pinned: written to Redis only
    "partial_tails_saved",  # Mamba partial tails of finishing requests (kept, not dropped)
    "probe_waits",  # lookups answered "ask again" while the request's Redis probe was out
    "probe_gave_up",  # requests answered without Redis after max_probe_asks waits
    "redis_stale_saves",  # Redis shards of another save than the probe found (TP): not loaded
    "redis_corrupt_deleted",  # corrupt Redis values deleted (only if unchanged since read)
    "presence_known_absent",  # lookups answered at once: no missing key was announced
    "presence_keys_skipped",  # missing keys not probed (not announced, or past a gap)
    "presence_not_ready",  # lookups probed in full: the presence summary was not synced
    "presence_learned",  # key names learned from Redis (walk + other engines' announcements)
    "presence_learned_dropped",  # ... dropped before a step took them (the oldest past the cap)
    "presence_announce_dropped",  # stores never announced: the oldest past the queue's cap,
    # or the feed turned itself off
    "hit_tokens_host",  # tokens served from the host tier (kvtier daemon --cpu-bytes)
    "blocks_loaded_host",
    "blocks_written_host",  # blocks copied into the host tier
    "host_store_drops",  # saves the host tier did not take (no leased slot at hand)
    "host_misses_at_fetch",  # the mirror said present, the slot held something else
    "host_held_saves_skipped",  # computed or restored blocks the host tier already holds
    "host_mixed_saves",  # host look-ups whose ranks' shards were of different saves (a miss)
    "load_us",  # microseconds the worker spent copying loads into vLLM's KV cache
    "bytes_fetched_redis",  # validated bytes read from Redis into CPU-tier slots
    "fetch_us_redis",  # microseconds the I/O threads spent reading them (wall, per batch)
    "fetches_without_forward",  # Redis fetch batches planned in a step with no tokens
    "bytes_fetched_host",  # host-tier bytes checked in place (then loaded from there)
    "fetch_us_host",
    "redis_saves_via_daemon",  # saves whose Redis write the daemon does (host_tier_redis)
    "redis_backfills",  # CPU-tier entries saved while Redis was down, later sent to Redis
    "blocks_backfilled_redis",  # ... written (per rank, as blocks_written_redis)
    "bytes_backfilled_redis",
    "redis_backfill_failures",  # ... not written (Redis failed again, or the slot moved on)
)

#: Gauges, exported as ``vllm:kvtier_<name>`` (the latest value wins across halves/ranks).
GAUGE_NAMES: tuple[str, ...] = (
    "redis_available", "redis_configured", "cpu_tier_slots", "cpu_tier_entries",
    "cpu_tier_pinned", "cpu_tier_reserved", "presence_synced", "presence_memory_bytes",
    "host_tier_available", "host_tier_entries",
)


class ConnectorCounters:
    """Thread-safe named counters with cumulative snapshots and deltas.

    vLLM asks for a delta every engine step, in the scheduler's process and in every
    worker's: what changed is tracked as it changes, so a quiet step costs one check.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
        self._gauges: dict[str, int | float] = {"redis_available": 0, "redis_configured": 0}
        self._last: dict[str, int] = dict(self._values)
        self._moved: set[str] = set()  # counters added to since the last delta
        self._gauges_moved = True  # a gauge changed value since the last delta

    def add(self, name: str, amount: int = 1) -> None:
        if amount:
            with self._lock:
                self._values[name] += amount
                self._moved.add(name)

    def set_gauge(self, name: str, value: int | float) -> None:
        with self._lock:
            if self._gauges.get(name) != value:
                self._gauges[name] = value
                self._gauges_moved = True

    def snapshot(self) -> dict[str, int | float]:
        """Cumulative totals plus gauges."""
        with self._lock:
            out: dict[str, int | float] = dict(self._values)
            out.update(self._gauges)
            return out

    def take_delta(self) -> dict[str, int | float]:
        """Counts since the last call, plus the gauges when anything moved; else empty."""
        with self._lock:
            if not self._moved and not self._gauges_moved:
                return {}
            delta: dict[str, int | float] = {}
            for name in self._moved:
                delta[name] = self._values[name] - self._last[name]
                self._last[name] = self._values[name]
            self._moved.clear()
            delta.update(self._gauges)
            self._gauges_moved = False
            return delta


def aggregate(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Sum counters, keep the latest gauge values."""
    out = dict(a)
    for key, value in b.items():
        if key in COUNTER_NAMES:
            out[key] = out.get(key, 0) + value
        else:
            out[key] = value
    return out


def hit_tokens(data: dict[str, Any]) -> int:
    return int(data.get("hit_tokens_cpu", 0)) + int(data.get("hit_tokens_redis", 0))


def prometheus_metrics(registry: Any = None, names: Iterable[str] = COUNTER_NAMES) -> dict:
    """Create ``kvtier_connector_*`` Prometheus counters (and the availability gauge)."""
    from prometheus_client import REGISTRY, Counter, Gauge

    reg = registry if registry is not None else REGISTRY
    metrics: dict[str, Any] = {}
    for name in names:
        metrics[name] = Counter(f"kvtier_connector_{name}", f"kvtier connector: {name}",
                                registry=reg)
    metrics["redis_available"] = Gauge("kvtier_connector_redis_available",
                                       "1 when the Redis tier answers, else 0", registry=reg)
    return metrics


def observe(metrics: dict[str, Any], delta: dict[str, Any]) -> None:
    """Apply one delta (from ``take_delta``) to metrics from ``prometheus_metrics``."""
    for key, value in delta.items():
        metric = metrics.get(key)
        if metric is None:
            continue
        if key == "redis_available":
            metric.set(value)
        elif value > 0:
            metric.inc(value)
