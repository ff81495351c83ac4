"""Settings of kvtier's Redis tier inside vLLM's native tiering (one ``secondary_tiers`` entry).

Every key of the entry other than ``type``, ``module_path`` and ``backpressure`` (which
vLLM's factory consumes) arrives here. Unknown keys and bad values fail at engine start with
a message that names the key and the fix. The Redis password never appears in a message.
This module never imports vLLM.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from offload_tiers.redis.credentials import resolve_redis_url, setting_at_fault
from offload_tiers.redis.settings import check_ca_file, check_key_prefix, check_redis_url
from offload_tiers.redis.url import redact_url

_FIXES: dict[str, str] = {
    "redis_url": "use redis://host:port/db, rediss://... for TLS, unix:///path.sock, or "
                 "redis+cluster://host:port for Redis Cluster",
    "redis_prefix": "use a short non-empty string without spaces, e.g. 'kvtier'",
    "redis_ttl_s": "give seconds as a positive integer, or null for no expiry",
    "redis_timeout_s": "give seconds as a number > 0, e.g. 0.25",
    "redis_shutdown_flush_s": "give seconds as a number from 0 to 60 (how long an exiting "
                              "engine keeps writing its queued stores to Redis)",
    "redis_ssl_ca_certs": "give the path of a readable PEM file of the CA that signed the "
                          "Redis server's certificate (used with rediss:// URLs)",
    "redis_url_env": "name an environment variable that holds the Redis URL (the engine's "
                     "processes inherit it), e.g. KVTIER_REDIS_URL, set to "
                     "redis://[user:password@]host:port/db; leave redis_url unset",
    "redis_username": "use the Redis ACL user name (with redis_password_file)",
    "redis_password_file": "give the path of a file only this user can read (chmod 600) "
                           "holding the Redis password",
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

    # One of redis_url / redis_url_env; credentials outside vLLM's printed config:
    # offload_tiers/redis/credentials.py.
    redis_url: str | None = None
    redis_url_env: str | None = None
    redis_username: str | None = None
    redis_password_file: str | None = None
    redis_prefix: str = "kvtier"
    redis_ttl_s: int | None = Field(default=7 * 24 * 3600, gt=0)
    redis_timeout_s: float = Field(default=0.25, gt=0)
    redis_shutdown_flush_s: float = Field(default=2.0, ge=0, le=60)  # at vLLM's shutdown
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
    _redis_warnings: tuple[str, ...] = PrivateAttr(default=())

    @field_validator("redis_url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        return check_redis_url(value) if value else None

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
        data["redis_url"] = redact_url(self.redis_url or "")
        return data

    @property
    def url(self) -> str:
        """The URL to connect with (resolved by :func:`load_native_settings`)."""
        assert self.redis_url, "settings not resolved by load_native_settings"
        return self.redis_url

    @property
    def redis_warnings(self) -> tuple[str, ...]:
        """Warnings about how the Redis credentials were given (log them once, at start)."""
        return self._redis_warnings


def load_native_settings(entry: dict[str, Any], tier_type: str = "KvtierRedisTier"
                         ) -> NativeTierSettings:
    """Validate one ``secondary_tiers`` entry (less the keys vLLM's factory consumes)."""
    where = f"secondary_tiers[type={tier_type}]"
    try:
        settings = NativeTierSettings(**entry)
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
            msg = err["msg"].removeprefix("Value error, ")  # pydantic's prefix says nothing
            if key == "redis_url":  # pydantic may echo the input: never show a password
                msg = msg.replace(str(entry.get("redis_url", "")),
                                  redact_url(str(entry.get("redis_url", ""))))
            fix = _FIXES.get(key, "see docs/native-tier.md")
            problems.append(f"{where}.{key}: {msg}. Fix: {fix}")
        raise NativeTierConfigError(
            "kvtier native Redis tier: bad secondary tier settings: " + "; ".join(problems)
        ) from None
    try:
        if not settings.redis_url and not settings.redis_url_env:
            raise ValueError("required: give redis_url or redis_url_env")
        url, warnings = resolve_redis_url(
            settings.redis_url, url_env=settings.redis_url_env,
            username=settings.redis_username, password_file=settings.redis_password_file)
    except ValueError as exc:
        key = setting_at_fault(exc, settings.redis_url_env, settings.redis_password_file)
        raise NativeTierConfigError(
            f"kvtier native Redis tier: bad secondary tier settings: {where}.{key}: {exc}. "
            f"Fix: {_FIXES[key]}") from None
    if settings.redis_password_env:  # the password comes from elsewhere: no inline warning
        warnings = [w for w in warnings if "carries a password" not in w]
    resolved = settings.model_copy(update={"redis_url": url})
    resolved._redis_warnings = tuple(warnings)
    return resolved
