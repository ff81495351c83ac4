"""Turn a phase's raw counters into a table row: where every prompt token came from.

Sources, all read from outside the connector:
- vLLM's own counters: ``prompt_tokens``, ``prompt_tokens_by_source`` (local compute /
  local cache hit / external KV transfer) and ``prompt_tokens_cached_by_source`` (device,
  host, disk, ...), counted by the scheduler at admission;
- kvtier's counters ``vllm:kvtier_hit_tokens_{cpu,host,redis}`` (its prom metrics) for the
  split between its tiers. A connector without them (vLLM's native one) is split by vLLM's
  ``cached_by_source`` label instead (``host`` = CPU tier).
Does not import vLLM.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

_BY = "vllm:prompt_tokens_by_source[source={}]"
_CACHED_BY = "vllm:prompt_tokens_cached_by_source[source={}]"
KVTIER_CPU = "vllm:kvtier_hit_tokens_cpu"
KVTIER_REDIS = "vllm:kvtier_hit_tokens_redis"
KVTIER_HOST = "vllm:kvtier_hit_tokens_host"


@dataclass
class Row:
    """One line of the demo / benchmark table."""

    label: str
    requests: int
    prompt_tokens: int
    gpu_tokens: int
    cpu_tokens: int
    redis_tokens: int
    other_external_tokens: int
    recomputed_tokens: int
    ttft_p50_ms: float
    ttft_mean_ms: float
    wall_s: float
    identical: bool | None
    tier_split_from: str
    host_tokens: int = 0  # from the host tier (kvtier daemon --cpu-bytes)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _get(counters: dict[str, float], key: str) -> int:
    return int(round(counters.get(key, 0.0)))


def outputs_of(phase: dict[str, Any]) -> list[list[int]]:
    return [list(r["output"]) for r in phase["requests"]]


def summarize(label: str, phase: dict[str, Any],
              reference: dict[str, Any] | None = None) -> Row:
    """A row for ``phase``; ``identical`` compares its outputs with ``reference``'s."""
    c = phase["counters"]
    external = _get(c, _BY.format("external_kv_transfer"))
    host = _get(c, KVTIER_HOST)
    if any(k in c for k in (KVTIER_CPU, KVTIER_REDIS, KVTIER_HOST)):
        cpu, redis = _get(c, KVTIER_CPU), _get(c, KVTIER_REDIS)
        split = "kvtier counters"
    else:
        cpu, redis = _get(c, _CACHED_BY.format("host")), 0
        split = "vLLM cached_by_source"
    other = max(0, external - cpu - host - redis)
    ttfts = [1000.0 * r["ttft_s"] for r in phase["requests"]]
    identical = None
    if reference is not None:
        identical = outputs_of(phase) == outputs_of(reference)
    return Row(
        label=label,
        requests=len(phase["requests"]),
        prompt_tokens=_get(c, "vllm:prompt_tokens"),
        gpu_tokens=_get(c, _BY.format("local_cache_hit")),
        cpu_tokens=cpu,
        redis_tokens=redis,
        other_external_tokens=other,
        recomputed_tokens=_get(c, _BY.format("local_compute")),
        ttft_p50_ms=statistics.median(ttfts) if ttfts else 0.0,
        ttft_mean_ms=statistics.fmean(ttfts) if ttfts else 0.0,
        wall_s=float(phase.get("wall_s", 0.0)),
        identical=identical,
        tier_split_from=split,
        host_tokens=host,
    )


_COLUMNS = (
    ("phase", "label", "<"),
    ("reqs", "requests", ">"),
    ("prompt tok", "prompt_tokens", ">"),
    ("GPU cache", "gpu_tokens", ">"),
    ("CPU tier", "cpu_tokens", ">"),
    ("host tier", "host_tokens", ">"),
    ("Redis tier", "redis_tokens", ">"),
    ("recomputed", "recomputed_tokens", ">"),
    ("TTFT p50 ms", "ttft_p50_ms", ">"),
    ("identical", "identical", ">"),
)


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def render_table(rows: list[Row], extra_columns: tuple[tuple[str, str, str], ...] = (), *,
                 host_column: bool = False) -> str:
    """A plain-text table (fixed-width columns) of ``rows``; the host-tier column only
    with ``host_column``."""
    columns = tuple(c for c in _COLUMNS if host_column or c[1] != "host_tokens") + extra_columns
    cells = [[_cell(getattr(r, attr)) for _, attr, _ in columns] for r in rows]
    widths = [max([len(h)] + [len(row[i]) for row in cells])
              for i, (h, _, _) in enumerate(columns)]

    def line(values: list[str]) -> str:
        parts = []
        for (_, _, align), width, value in zip(columns, widths, values, strict=True):
            parts.append(value.ljust(width) if align == "<" else value.rjust(width))
        return "  ".join(parts)

    header = line([h for h, _, _ in columns])
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([header, rule] + [line(row) for row in cells])
