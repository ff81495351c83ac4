"""Settings of kvtier's Redis tier inside vLLM's native tiering (one ``secondary_tiers`` entry).

Every key of the entry other than ``type``, ``module_path`` and ``backpressure`` (which
vLLM's factory consumes) arrives here. Unknown keys and bad values fail at engine start with
a message that names the key and the fix. The Redis password never appears in a message.
This module never imports vLLM.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError

from offload_tiers.redis.settings import (
    REDIS_FIXES,
    RedisConnectionSettings,
    RedisSettingError,
    explain,
)

_FIXES: dict[str, str] = {
    "redis_shutdown_flush_s": "give seconds as a number from 0 to 60 (how long an exiting "
                              "engine keeps writing its queued stores to Redis)",
    "model_id": "use a string naming the model's identity (defaults to the model path)",
    "weights_version": "use a string naming the weights (e.g. a checkpoint step or digest)",
    "io_threads": "give an integer from 1 to 32 (threads that load chunks from Redis)",
    "known_keys": "give an integer >= 0 (chunks remembered as present; 0 = always ask Redis)",
    "kv_events": "use true (announce STORAGE entries when vLLM's KV events are on) or false",
    "write_queue_max": "give an integer >= 1 (chunks queued for the Redis writer)",
    "locality": "use 'LOCAL', 'REMOTE' or null",
}


class NativeTierConfigError(ValueError):
    """A setting is wrong; the message names the key and how to fix it."""


class NativeTierSettings(RedisConnectionSettings):
    """Every setting of the native-tiering Redis tier, with its default (the Redis
    connection's: :class:`~offload_tiers.redis.settings.RedisConnectionSettings`; one of
    ``redis_url`` / ``redis_url_env`` is required)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    redis_shutdown_flush_s: float = Field(default=2.0, ge=0, le=60)  # at vLLM's shutdown
    model_id: str | None = None
    weights_version: str = ""
    io_threads: int = Field(default=2, ge=1, le=32)
    known_keys: int = Field(default=65536, ge=0)
    kv_events: bool = True
    write_queue_max: int = Field(default=1024, ge=1)
    locality: Literal["LOCAL", "REMOTE"] | None = None

    @property
    def url(self) -> str:
        """The URL to connect with (resolved by :func:`load_native_settings`)."""
        assert self.redis_url, "settings not resolved by load_native_settings"
        return self.redis_url


def load_native_settings(entry: dict[str, Any], tier_type: str = "KvtierRedisTier"
                         ) -> NativeTierSettings:
    """Validate one ``secondary_tiers`` entry (less the keys vLLM's factory consumes)."""
    where = f"secondary_tiers[type={tier_type}]"
    try:
        settings = NativeTierSettings(**entry)
    except ValidationError as exc:
        problems = explain(exc, NativeTierSettings, _FIXES, "see docs/native-tier.md",
                           where=f"{where}.", given=entry)
        raise NativeTierConfigError(
            "kvtier native Redis tier: bad secondary tier settings: " + "; ".join(problems)
        ) from None
    try:
        if not settings.redis_url and not settings.redis_url_env:
            raise RedisSettingError("redis_url", "required: give redis_url or redis_url_env")
        url, warnings = settings.resolve_url()
    except RedisSettingError as exc:
        raise NativeTierConfigError(
            f"kvtier native Redis tier: bad secondary tier settings: {where}.{exc.key}: {exc}. "
            f"Fix: {_FIXES.get(exc.key) or REDIS_FIXES[exc.key]}") from None
    return settings.with_resolved_url(url, warnings)
