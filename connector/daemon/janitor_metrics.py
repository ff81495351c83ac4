"""Prometheus view of the Redis janitor's counters (read at scrape time)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from offload_tiers.redis.janitor import REASONS, RedisJanitor

__all__ = ["JanitorCollector"]

_P = "kvtier_daemon_janitor_"


class JanitorCollector(Collector):
    """``kvtier_daemon_janitor_*``: passes, keys, bytes, deletions by reason, errors, up."""

    def __init__(self, janitor: RedisJanitor) -> None:
        self.j = janitor

    def collect(self) -> Iterator[Any]:
        s = self.j.stats()
        deleted = CounterMetricFamily(_P + "deleted", "Values deleted, by reason",
                                      labels=["reason"])
        would = CounterMetricFamily(_P + "would_delete",
                                    "Values a dry run would have deleted, by reason",
                                    labels=["reason"])
        for reason in REASONS:
            deleted.add_metric([reason], s["deleted"].get(reason, 0))
            would.add_metric([reason], s["would_delete"].get(reason, 0))
        passes = CounterMetricFamily(_P + "passes", "Janitor passes", labels=["result"])
        passes.add_metric(["ok"], s["passes"])
        passes.add_metric(["failed"], s["passes_failed"])
        kept = CounterMetricFamily(_P + "kept", "Keys judged or seen but not deleted",
                                   labels=["reason"])
        kept.add_metric(["changed_before_delete"], s["changed_before_delete"])
        kept.add_metric(["vanished"], s["vanished"])
        kept.add_metric(["nested_prefix"], s["nested_prefix_skipped"])
        up = GaugeMetricFamily(_P + "redis_up", "1 when the last janitor contact succeeded")
        up.add_metric([], 1 if s["available"] else 0)
        plain = [
            CounterMetricFamily(_P + name, doc, value=s[key]) for name, doc, key in (
                ("sweeps", "Complete walks of the prefix", "sweeps"),
                ("keys_scanned", "Keys under the prefix returned by SCAN", "keys_scanned"),
                ("bytes_seen", "Sum of the scanned values' lengths (STRLEN)", "bytes_seen"),
                ("scan_calls", "SCAN calls", "scan_calls"),
                ("errors", "Redis errors met by the janitor", "errors"),
                ("unavailable_events", "Times Redis became unreachable", "unavailable_events"),
            )
        ]
        last_keys = GaugeMetricFamily(_P + "last_pass_keys", "Keys the last pass scanned",
                                      value=s["last_pass_keys"])
        last_s = GaugeMetricFamily(_P + "last_pass_seconds", "Duration of the last pass",
                                   value=s["last_pass_seconds"])
        yield from (deleted, would, passes, kept, up, *plain, last_keys, last_s)
