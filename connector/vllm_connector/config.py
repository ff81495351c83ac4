"""Settings of ``TieredOffloadingConnector``: from ``kv_connector_extra_config`` and/or YAML.

``kv_connector_extra_config`` may name a YAML file with ``config_file``; keys given inline
override the file's. Unknown keys and bad values fail at engine start with a message that
names the key and the fix. This module never imports vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ConfigDict, Field, ValidationError

from offload_tiers.redis.settings import (
    REDIS_FIXES,
    WRITE_LINGER_S,
    RedisConnectionSettings,
    RedisSettingError,
    explain,
)
from offload_tiers.thread_priority import BACKGROUND_NICE, MAX_NICE

_FIXES: dict[str, str] = {
    "cpu_bytes": "give the CPU tier size in bytes as an integer >= 1048576, e.g. 1073741824",
    "redis_url": "use redis://host:port/db, rediss://... for TLS, unix:///path.sock, "
                 "redis+cluster://host:port for Redis Cluster, or null for the CPU tier only",
    "write_mode": "use 'back' (default: a background writer, no Redis round trip in a step) "
                  "or 'through' (a step's blocks reach Redis before the next step starts)",
    "redis_write_linger_ms": "give milliseconds as a number from 0 to 1000 (how long the "
                             "background writer gathers saves into one Redis round trip)",
    "redis_write_batch": "give a whole number from 1 to 1024 (the saves the background "
                         "writer sends in one pipelined batch at most)",
    "redis_write_pace_ms": "give milliseconds as a number from 0 to 1000 (the gap between "
                           "two of the writer's batches while more saves wait; 0: none)",
    "redis_shutdown_flush_s": "give seconds as a number from 0 to 60 (how long an exiting "
                              "engine keeps writing its queued saves to Redis)",
    "background_nice": "give a whole number from 0 to 19 (the niceness kvtier adds to its "
                       "Redis writer and presence feed threads; 0 leaves them as the engine's)",
    "weights_version": "use a string naming the weights (e.g. a checkpoint step or digest)",
    "store_partial": "use true or false",
    "tenant": "use a string (vLLM's per-request cache_salt is added to it)",
    "model_id": "use a string naming the model's identity (defaults to the model path)",
    "debug_corrupt_loads": "use true only in tests; it corrupts every loaded block",
    "checkpoint_identity": "use true (default: the checkpoint files' names, sizes, times and "
                           "header digests are in the namespace) or false (only when "
                           "model_id/weights_version name the weights exactly)",
    "max_probe_asks": "give a positive integer (default 10000): how many times one request "
                      "may be told 'ask again' while its Redis probe is out",
    "hybrid_hits": "use true (default) or false (store hybrid blocks but never restore them)",
    "presence": "use true (default: misses that no kvtier engine announced skip the Redis "
                "probe) or false (every miss asks Redis)",
    "presence_capacity": "give the number of Redis keys the presence summary remembers, an "
                         "integer >= 1024 (default 1048576: 3.0 MB)",
    "presence_scan_keys_per_s": "give a number > 0: key names read per second when the "
                                "summary walks Redis at start (default 200000)",
    "host_tier_socket": "give the Unix socket of `kvtier daemon --cpu-bytes N` (it prints "
                        "it at start), or null for this engine's own CPU tier only",
    "host_tier_redis": "use true only with host_tier_socket and no redis_url (the engine "
                       "then reaches Redis through `kvtier daemon --cpu-bytes N --redis-url "
                       "URL`), or false (default)",
    "host_tier_group": "give the group of `kvtier daemon --host-tier-group G` (a name or "
                       "gid) to trust that group's daemon and files, or null (default: only a "
                       "daemon of this user or root)",
    "async_saves": "use true (default: on the CPU a step's saves are copied after the step "
                   "returns, before the next one) or false (copied inside the step)",
    "redis_backfill": "use true (default: CPU-tier entries saved while Redis was down are "
                      "written to it once it answers again) or false",
    "config_file": "point to a readable YAML file with a mapping of these keys",
}


class ConnectorConfigError(ValueError):
    """A setting is wrong; the message names the key and how to fix it."""


class TieredConfig(RedisConnectionSettings):
    """Every setting of the connector, with its default (the Redis connection's:
    :class:`~offload_tiers.redis.settings.RedisConnectionSettings`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu_bytes: int = Field(default=1 << 30, ge=1 << 20)
    write_mode: Literal["through", "back"] = "back"
    # write_mode back: how long the writer waits for more saves before one round trip.
    redis_write_linger_ms: float = Field(default=WRITE_LINGER_S * 1e3, ge=0, le=1000)
    # write_mode back: the writer's batches hold at most this many saves, and while more
    # wait it leaves this long between two (0: none), so that a burst of saves (a long
    # prompt's) is spread over several steps: a lower step-time tail for more writer work
    # in all (offload_tiers/redis/write_behind.py).
    redis_write_batch: int = Field(default=32, ge=1, le=1024)
    redis_write_pace_ms: float = Field(default=0.0, ge=0, le=1000)
    # At exit (vLLM's shutdown, or the interpreter's): how long queued saves may take to
    # reach Redis; what is still queued then is counted and logged, never waited for longer.
    redis_shutdown_flush_s: float = Field(default=2.0, ge=0, le=60)
    # Niceness added to the threads nothing waits on (the Redis writer in write_mode back,
    # the presence feed), so that they yield the CPU to the engine's threads; 0: none
    # (offload_tiers/thread_priority.py).
    background_nice: int = Field(default=BACKGROUND_NICE, ge=0, le=MAX_NICE)
    store_partial: bool = True
    tenant: str = ""
    model_id: str | None = None
    # Names the weights: KV computed with other weights is never served.
    weights_version: str = ""
    # The checkpoint files' identity in the namespace (a checkpoint rewritten in place is new).
    checkpoint_identity: bool = True
    debug_corrupt_loads: bool = False
    # Serve hits on hybrid (Mamba + attention) models; false stores but never restores them.
    hybrid_hits: bool = True
    # "Ask again" answers one request may get while its Redis probe is out (engine steps).
    max_probe_asks: int = Field(default=10_000, ge=1)
    # A summary of the keys Redis may hold (connector/vllm_connector/presence.py): a miss
    # no kvtier engine announced is answered at once instead of waiting for a probe.
    presence: bool = True
    presence_capacity: int = Field(default=1 << 20, ge=1024)
    presence_scan_keys_per_s: float = Field(default=200_000.0, gt=0)
    # The host's shared CPU tier (kvtier daemon --cpu-bytes): its Unix socket. None: off.
    host_tier_socket: str | None = None
    # Reach Redis through that daemon (it writes saves behind and restores; this engine
    # opens no Redis connection): connector/vllm_connector/host_tier_redis.py
    host_tier_redis: bool = False
    # Also trust a daemon that runs in this group (name or gid), and its files shared with
    # it: the daemon's --host-tier-group. None: only a daemon of this uid or root.
    host_tier_group: str | None = None
    # On the CPU, copy a step's saves on the saver thread after the step returns (fenced
    # before the next step); false: inside the step, before its output goes back.
    async_saves: bool = True
    # Once Redis answers again, write the CPU-tier entries saved while it was down (or whose
    # write failed) from their slots, a writer batch at a time (write_mode back only).
    redis_backfill: bool = True


def _load_yaml(path_value: Any) -> dict[str, Any]:
    path = Path(str(path_value)).expanduser()
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConnectorConfigError(
            f"config_file: cannot read {path} ({exc.strerror}). Fix: {_FIXES['config_file']}"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConnectorConfigError(
            f"config_file: {path} is not valid YAML ({exc}). Fix: {_FIXES['config_file']}"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConnectorConfigError(
            f"config_file: {path} must hold a mapping, got {type(data).__name__}. "
            f"Fix: {_FIXES['config_file']}"
        )
    # A tier YAML may nest the connector's keys under "connector:".
    nested = data.get("connector")
    return dict(nested) if isinstance(nested, dict) else data


def load_config(extra_config: dict[str, Any] | None) -> TieredConfig:
    """Validate ``kv_connector_extra_config`` (plus its ``config_file``) into settings."""
    inline = dict(extra_config or {})
    merged: dict[str, Any] = {}
    config_file = inline.pop("config_file", None)
    if config_file:
        merged.update(_load_yaml(config_file))
    merged.update(inline)
    try:
        config = TieredConfig(**merged)
    except ValidationError as exc:
        problems = explain(exc, TieredConfig, _FIXES, "see docs/connector.md", given=merged)
        raise ConnectorConfigError(
            "TieredOffloadingConnector: bad kv_connector_extra_config: " + "; ".join(problems)
        ) from None
    try:
        url, warnings = config.resolve_url()
    except RedisSettingError as exc:
        raise ConnectorConfigError(
            f"TieredOffloadingConnector: bad kv_connector_extra_config: {exc.key}: {exc}. "
            f"Fix: {_FIXES.get(exc.key) or REDIS_FIXES[exc.key]}") from None
    if config.host_tier_redis and (url or not config.host_tier_socket):
        why = ("redis_url is set too: the engine would write to Redis twice" if url
               else "host_tier_socket is not set")
        raise ConnectorConfigError(
            f"TieredOffloadingConnector: bad kv_connector_extra_config: host_tier_redis: "
            f"{why}. Fix: {_FIXES['host_tier_redis']}")
    return config.with_resolved_url(url, warnings)


PIPELINE_UNSUPPORTED = (
    "TieredOffloadingConnector does not support pipeline_parallel_size={size} yet (each stage "
    "would hold a different set of layers). Fix: use tensor_parallel_size and/or "
    "data_parallel_size, with pipeline_parallel_size=1."
)
CONTEXT_PARALLEL_UNSUPPORTED = (
    "TieredOffloadingConnector does not support {name}={size}: two workers of one TP rank "
    "would hold different tokens of a block and store different bytes under one key. "
    "Fix: set {name}=1 (use tensor_parallel_size and/or data_parallel_size instead)."
)


def check_parallel_shape(parallel: Any) -> None:
    """Refuse parallel shapes the connector cannot serve correctly (vLLM's parallel config,
    read by attribute): pipeline parallel, prefill/decode context parallel > 1."""
    if int(getattr(parallel, "pipeline_parallel_size", 1) or 1) > 1:
        raise ConnectorConfigError(PIPELINE_UNSUPPORTED.format(
            size=parallel.pipeline_parallel_size))
    for name in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        size = int(getattr(parallel, name, 1) or 1)
        if size > 1:
            raise ConnectorConfigError(CONTEXT_PARALLEL_UNSUPPORTED.format(name=name, size=size))
