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

#: Counters, exported by vLLM as ``vllm:kvtier_<name>`` (summed over ranks), with their HELP.
COUNTERS: dict[str, str] = {
    "lookups": "Requests the scheduler asked kvtier about",
    "lookup_tokens": "Tokens beyond vLLM's own prefix-cache hit that kvtier looked up",
    "hit_tokens_cpu": "Tokens served from the engine's CPU tier",
    "hit_tokens_redis": "Tokens served from Redis",
    "hit_requests": "Requests with a hit beyond vLLM's own prefix cache",
    "rounded_down_tokens": "Tokens present but not served (group alignment or the hybrid "
                           "rule)",
    "hybrid_hits_withheld": "Tokens a hybrid model could restore, withheld (hybrid_hits off)",
    "blocks_loaded_cpu": "Blocks loaded into vLLM's KV cache from the CPU tier",
    "blocks_loaded_redis": "Blocks loaded into vLLM's KV cache from Redis",
    "bytes_loaded": "Bytes written into vLLM's KV cache by loads",
    "blocks_saved": "Blocks saved into the CPU tier",
    "partial_blocks_saved": "Partial blocks (a hash over part of the block) saved",
    "promotions": "Partial entries superseded by their full block",
    "bytes_saved_cpu": "Bytes gathered into the CPU tier",
    "blocks_written_redis": "Blocks written to Redis (per rank)",
    "bytes_written_redis": "Bytes written to Redis",
    "store_drops": "Saves that found no CPU slot, or Redis writes that failed or were dropped",
    "redis_write_failures": "Redis writes that failed",
    "load_errors": "Blocks reported to vLLM as failed loads (vLLM recomputes them)",
    "redis_misses_at_fetch": "Redis said present, but the value was gone or invalid at fetch",
    "redis_lookup_skips": "Look-ups that skipped Redis because it was unavailable",
    "redis_unavailable_steps": "Steps that saw Redis unavailable",
    "events_emitted": "KV events kvtier emitted for vLLM's event stream",
    "refused_loads": "Hits vLLM accepted only in part: not loaded (vLLM computes them)",
    "saves_skipped_after_failed_load": "Blocks of a step whose load failed: never stored",
    "redis_unavailable_saves": "Saves planned for the CPU tier only: Redis was down",
    "cpu_evictions": "CPU-tier entries evicted to make room",
    "redis_unavailable_events": "Times a worker's Redis went from answering to not answering",
    "redis_recoveries": "Times a worker's Redis answered again after not answering",
    "redis_corrupt_values": "Redis values that failed validation (header, checksum, length)",
    "failed_restores": "Restores (requests) whose Redis values did not validate: recomputed",
    "failed_restore_tokens": "Tokens of failed restores (recomputed)",
    "overflow_saves": "Saves that found every CPU slot pinned: written to Redis only",
    "partial_tails_saved": "Mamba partial tails of finishing requests saved (kept, not "
                           "dropped)",
    "probe_waits": "Look-ups answered 'ask again' while the request's Redis probe was out",
    "probe_gave_up": "Requests answered without Redis after max_probe_asks waits",
    "redis_stale_saves": "Redis shards of another save than the probe found (TP): not loaded",
    "redis_corrupt_deleted": "Corrupt Redis values deleted (only if unchanged since read)",
    "presence_known_absent": "Look-ups answered at once: no missing key was announced",
    "presence_keys_skipped": "Missing keys not probed (not announced, or past a gap)",
    "presence_not_ready": "Look-ups probed in full: the presence summary was not synced",
    "presence_learned": "Key names learned from Redis (walk and other engines' "
                        "announcements)",
    "presence_learned_dropped": "Learned key names dropped before a step took them (the "
                                "oldest past the cap)",
    "presence_announce_dropped": "Stores never announced (the oldest past the queue's cap, "
                                 "or the feed turned itself off)",
    "hit_tokens_host": "Tokens served from the host tier (kvtier daemon --cpu-bytes)",
    "blocks_loaded_host": "Blocks loaded into vLLM's KV cache from the host tier",
    "blocks_written_host": "Blocks copied into the host tier",
    "host_store_drops": "Saves the host tier did not take (no leased slot at hand)",
    "host_misses_at_fetch": "The host mirror said present, the slot held something else",
    "host_held_saves_skipped": "Computed or restored blocks the host tier already holds: "
                               "not saved again",
    "host_mixed_saves": "Host look-ups whose ranks' shards were of different saves (a miss)",
    "load_us": "Microseconds the workers spent copying loads into vLLM's KV cache",
    "save_fence_waits": "Steps that waited for the previous step's save copies before "
                        "writing KV blocks",
    "save_fence_wait_us": "Microseconds steps waited for the previous step's save copies",
    "bytes_fetched_redis": "Validated bytes read from Redis into CPU-tier slots",
    "fetch_us_redis": "Microseconds the I/O threads spent reading from Redis (wall, per "
                      "batch)",
    "fetches_without_forward": "Redis fetch batches planned in a step with no tokens",
    "bytes_fetched_host": "Host-tier bytes checked in place (then loaded from there)",
    "fetch_us_host": "Microseconds spent checking host-tier bytes in place",
    "redis_saves_via_daemon": "Saves whose Redis write the daemon does (host_tier_redis)",
    "redis_backfills": "CPU-tier entries saved while Redis was down, later sent to Redis",
    "blocks_backfilled_redis": "Blocks written to Redis by backfills (per rank)",
    "bytes_backfilled_redis": "Bytes written to Redis by backfills",
    "redis_backfill_failures": "Backfill writes not made (Redis failed again, or the slot "
                               "moved on)",
}
COUNTER_NAMES: tuple[str, ...] = tuple(COUNTERS)

#: Gauges, exported as ``vllm:kvtier_<name>`` (the latest value wins across halves/ranks).
GAUGES: dict[str, str] = {
    "redis_available": "1 while the Redis tier answers, else 0",
    "redis_configured": "1 when a Redis tier is configured, else 0",
    "cpu_tier_slots": "Slots in the engine's CPU tier",
    "cpu_tier_entries": "Entries held in the engine's CPU tier",
    "cpu_tier_pinned": "CPU-tier slots pinned by a load or a write in flight (removed "
                       "entries waiting for their last release included)",
    "cpu_tier_reserved": "CPU-tier slots being written (reserved, not yet committed)",
    "presence_synced": "1 once the presence summary has walked Redis's key names, else 0",
    "presence_memory_bytes": "Bytes the presence summary holds",
    "host_tier_available": "1 while the host tier's daemon answers, else 0",
    "host_tier_entries": "Entries this engine's host-tier mirror holds",
}
GAUGE_NAMES: tuple[str, ...] = tuple(GAUGES)


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
        metrics[name] = Counter(f"kvtier_connector_{name}", COUNTERS[name], registry=reg)
    metrics["redis_available"] = Gauge("kvtier_connector_redis_available",
                                       GAUGES["redis_available"], registry=reg)
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
