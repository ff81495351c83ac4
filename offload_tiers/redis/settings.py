"""The settings that configure a Redis tier, shared by every settings model (the connector's,
the native tier's, the daemon's): :class:`RedisConnectionSettings` (fields, checks,
credentials), :data:`REDIS_FIXES` and :func:`explain` (one message per problem). Each check
returns the value to keep or raises ValueError with a message that names no secret."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from offload_tiers.redis.url import parse_redis_url, redact_url

if TYPE_CHECKING:
    from offload_tiers.redis.client import ClientFactory

#: How long the write-behind thread waits for more stores once one arrives (see
#: :mod:`offload_tiers.redis.write_behind`): the steps that hand saves over in the meantime
#: share one round trip, and the writer takes the GIL once for all of them.
WRITE_LINGER_S = 0.2
#: The linger of writers whose queued stores hold slots that others wait for: vLLM's CPU
#: blocks (the native tier's store jobs) and the host tier's shared slots (the daemon). The
#: 200 ms above was measured for the connector's own CPU-tier slots only.
SHORT_WRITE_LINGER_S = 0.005
#: How long after a hand-over of stores the write-behind thread of a vLLM worker waits
#: before it writes (see :mod:`offload_tiers.redis.write_behind`): past the tail of the
#: step that handed them over.
WRITE_SETTLE_S = 0.005


def check_redis_url(url: str) -> str:
    """``url`` itself when :func:`~offload_tiers.redis.url.parse_redis_url` accepts it;
    otherwise its ValueError, which names the URL redacted."""
    parse_redis_url(url)
    return url


def check_ca_file(value: str | None) -> str | None:
    """The CA bundle's path, ``~`` expanded (None for none given); it must be a file."""
    if value is None or value == "":
        return None
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"no readable file at {path}")
    return str(path)


def check_key_prefix(value: str) -> str:
    """A key prefix: non-empty, without whitespace."""
    if not value or any(c.isspace() for c in value):
        raise ValueError("must be non-empty without whitespace")
    return value


#: How to fix each connection setting: every settings model that reaches Redis uses these
#: (a model may say more where it differs, e.g. whether Redis is optional).
REDIS_FIXES: dict[str, str] = {
    "redis_url": "use redis://host:port/db, rediss://... for TLS, unix:///path.sock, or "
                 "redis+cluster://host:port for Redis Cluster",
    "redis_url_env": "name an environment variable that holds the Redis URL (the engine's "
                     "processes inherit it), e.g. KVTIER_REDIS_URL, set to "
                     "redis://[user:password@]host:port/db; leave redis_url unset",
    "redis_username": "use the Redis ACL user name (with redis_password_file or "
                      "redis_password_env)",
    "redis_password_file": "give the path of a file only this user can read (chmod 600) "
                           "holding the Redis password",
    "redis_password_env": "name an environment variable that holds the Redis password "
                          "(keeps it out of any printed config)",
    "redis_prefix": "use a short non-empty string without spaces, e.g. 'kvtier'",
    "redis_ttl_s": "give seconds as a positive integer, or null for no expiry",
    "redis_timeout_s": "give seconds as a number > 0, e.g. 0.25",
    "redis_ssl_ca_certs": "give the path of a readable PEM file of the CA that signed the "
                          "Redis server's certificate (used with rediss:// URLs)",
}


class RedisSettingError(ValueError):
    """A connection setting is wrong: ``key`` names it; the message names no secret."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


class RedisConnectionSettings(BaseModel):
    """How to reach one Redis (or Cluster) and what to call its keys: the fields, checks and
    credential handling every settings model that reaches Redis shares (the connector's,
    the native tier's, the daemon's). :meth:`resolved` gives the URL to connect with."""

    model_config = ConfigDict(extra="forbid")

    redis_url: str | None = None
    # Credentials outside any printed config (offload_tiers/redis/credentials.py): the URL
    # in an environment variable, or the password in a file or an environment variable.
    redis_url_env: str | None = None
    redis_username: str | None = None
    redis_password_file: str | None = None
    redis_password_env: str | None = None
    redis_prefix: str = "kvtier"
    redis_ttl_s: int | None = Field(default=7 * 24 * 3600, gt=0)
    redis_timeout_s: float = Field(default=0.25, gt=0)
    # CA bundle that verifies a rediss:// server (default: the system's trust store).
    redis_ssl_ca_certs: str | None = None
    _redis_warnings: tuple[str, ...] = PrivateAttr(default=())

    @field_validator("redis_url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        return check_redis_url(value) if value else None

    @field_validator("redis_ssl_ca_certs")
    @classmethod
    def _check_ca(cls, value: str | None) -> str | None:
        return check_ca_file(value)

    @field_validator("redis_prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        return check_key_prefix(value)

    @field_validator("redis_url_env", "redis_password_env", "redis_password_file",
                     "redis_username")
    @classmethod
    def _empty_is_unset(cls, value: str | None) -> str | None:
        return value or None

    def resolve_url(self, exposure: str | None = None) -> tuple[str | None, list[str]]:
        """The URL to connect with, credentials filled in (None: no Redis), and warnings
        to log once. Raises :class:`RedisSettingError` naming the setting at fault."""
        from offload_tiers.redis.credentials import VLLM_EXPOSURE, resolve_redis_url

        try:
            return resolve_redis_url(
                self.redis_url, url_env=self.redis_url_env, username=self.redis_username,
                password_file=self.redis_password_file, password_env=self.redis_password_env,
                exposure=exposure or VLLM_EXPOSURE)
        except RedisSettingError:
            raise
        except ValueError as exc:
            raise RedisSettingError(self._setting_at_fault(exc), str(exc)) from None

    def _setting_at_fault(self, exc: ValueError) -> str:
        text = str(exc)
        if self.redis_password_file and "password file" in text:
            return "redis_password_file"
        if self.redis_password_env and "redis_password_env" in text:
            return "redis_password_env"
        return "redis_url_env" if self.redis_url_env else "redis_url"

    def with_resolved_url(self, url: str | None, warnings: list[str]) -> Self:
        """A copy whose ``redis_url`` is the resolved one, with the warnings kept."""
        resolved = self.model_copy(update={"redis_url": url})
        resolved._redis_warnings = tuple(warnings)
        return resolved

    @property
    def redis_warnings(self) -> tuple[str, ...]:
        """Warnings about how the Redis credentials were given (log them once, at start)."""
        return self._redis_warnings

    def client_factory(self, min_timeout_s: float = 0.0) -> ClientFactory:
        """Clients of this Redis (resolved settings only), waiting at most
        ``redis_timeout_s`` (or ``min_timeout_s`` where longer, for a feed thread)."""
        from offload_tiers.redis.client import ClientFactory

        if not self.redis_url:
            raise ValueError("no redis_url: the settings are not resolved, or name no Redis")
        return ClientFactory(parse_redis_url(self.redis_url),
                             timeout_s=max(self.redis_timeout_s, min_timeout_s),
                             ssl_ca_certs=self.redis_ssl_ca_certs)

    def describe(self) -> dict[str, Any]:
        """Settings safe to log (the Redis password is redacted)."""
        data = self.model_dump()
        if self.redis_url:
            data["redis_url"] = redact_url(self.redis_url)
        return data


def explain(exc: ValidationError, model: type[BaseModel], fixes: Mapping[str, str],
            default_fix: str, where: str = "", given: Mapping[str, Any] | None = None
            ) -> list[str]:
    """One "key: what is wrong. Fix: how" line per problem pydantic found in ``model``'s
    settings (``where`` prefixes each key). An unknown key lists the known ones; a bad
    ``redis_url`` is shown redacted whatever pydantic echoes."""
    problems = []
    given = given or {}
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "?"
        if err["type"] == "extra_forbidden":
            known = ", ".join(sorted(model.model_fields))
            problems.append(f"{where}{key}: unknown setting. Fix: remove it; known keys: "
                            f"{known}")
            continue
        fix = fixes.get(key, REDIS_FIXES.get(key, default_fix))
        if err["type"] == "missing":
            problems.append(f"{where}{key}: required. Fix: {fix}")
            continue
        msg = err["msg"].removeprefix("Value error, ")  # pydantic's prefix says nothing
        if key == "redis_url" and given.get("redis_url"):
            msg = msg.replace(str(given["redis_url"]), redact_url(str(given["redis_url"])))
        problems.append(f"{where}{key}: {msg}. Fix: {fix}")
    return problems
