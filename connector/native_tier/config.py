"""Settings of kvtier's Redis tier inside vLLM's native tiering (one ``secondary_tiers`` entry).

Every key of the entry other than ``type``, ``module_path`` and ``backpressure`` (which
vLLM's factory consumes) arrives here. Unknown keys and bad values fail at engine start with
a message that names the key and the fix. The Redis password never appears in a message.
This module never imports vLLM.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from offload_tiers.redis.settings import check_ca_file, check_key_prefix, check_redis_url
from offload_tiers.redis.url import redact_url

_FIXES: dict[str, str] = {
    "redis_url": "use redis://host:port/db, rediss://... for TLS, unix:///path.sock, or "
                 "redis+cluster://host:port for Redis Cluster",
    "redis_prefix": "use a short non-empty string without spaces, e.g. 'kvtier'",
    "redis_ttl_s": "give seconds as a positive integer, or null for no expiry",
    "redis_timeout_s": "give seconds as a number > 0, e.g. 0.25",
    "redis_ssl_ca_certs": "give the path of a readable PEM file of the CA that signed the "
                          "Redis server's certificate (used with rediss:// URLs)",
    "redis_password_env": "name an environment variable that holds the Redis password "
                          "(keeps it out of the kv-transfer-config, which vLLM logs)",
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


class NativeTierSettings(BaseModel):
    """Every setting of the native-tiering Redis tier, with its default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    redis_url: str
    redis_prefix: str = "kvtier"
    redis_ttl_s: int | None = Field(default=7 * 24 * 3600, gt=0)
    redis_timeout_s: float = Field(default=0.25, gt=0)
    redis_ssl_ca_certs: str | None = None
    # The password from this environment variable instead of the URL (vLLM logs its
    # non-default engine arguments, kv_transfer_config included, at start).
    redis_password_env: str | None = None
    model_id: str | None = None
    weights_version: str = ""
    io_threads: int = Field(default=2, ge=1, le=32)
    known_keys: int = Field(default=65536, ge=0)
    kv_events: bool = True
    write_queue_max: int = Field(default=1024, ge=1)
    locality: Literal["LOCAL", "REMOTE"] | None = None

    @field_validator("redis_url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        return check_redis_url(value)

    @field_validator("redis_ssl_ca_certs")
    @classmethod
    def _check_ca(cls, value: str | None) -> str | None:
        return check_ca_file(value)

    @field_validator("redis_password_env")
    @classmethod
    def _check_password_env(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        if value not in os.environ:
            raise ValueError(f"environment variable {value} is not set")
        return value

    def redis_password(self) -> str | None:
        """The password named by ``redis_password_env`` (None: the URL's, if any)."""
        return os.environ[self.redis_password_env] if self.redis_password_env else None

    @field_validator("redis_prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        return check_key_prefix(value)

    def describe(self) -> dict[str, Any]:
        """Settings safe to log (the Redis password is redacted)."""
        data = self.model_dump()
        data["redis_url"] = redact_url(self.redis_url)
        return data


def load_native_settings(entry: dict[str, Any], tier_type: str = "KvtierRedisTier"
                         ) -> NativeTierSettings:
    """Validate one ``secondary_tiers`` entry (less the keys vLLM's factory consumes)."""
    where = f"secondary_tiers[type={tier_type}]"
    try:
        return NativeTierSettings(**entry)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"]) or "?"
            if err["type"] == "extra_forbidden":
                known = ", ".join(sorted(NativeTierSettings.model_fields))
                problems.append(f"{where}.{key}: unknown setting. Fix: remove it; "
                                f"known keys: {known}")
                continue
            if err["type"] == "missing":
                problems.append(f"{where}.{key}: required. Fix: {_FIXES.get(key, '')}")
                continue
            msg = err["msg"]
            if key == "redis_url":  # pydantic may echo the input: never show a password
                msg = msg.replace(str(entry.get("redis_url", "")),
                                  redact_url(str(entry.get("redis_url", ""))))
            fix = _FIXES.get(key, "see docs/native-tier.md")
            problems.append(f"{where}.{key}: {msg}. Fix: {fix}")
        raise NativeTierConfigError(
            "kvtier native Redis tier: bad secondary tier settings: " + "; ".join(problems)
        ) from None
