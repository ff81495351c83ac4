"""The adapter's settings: LMCache's plugin adapter hands its ``adapter_params`` dict over as it
is (plain kvtier: no LMCache import).

Credentials never travel in that dict: LMCache logs and reports its adapter configuration, so a
URL that carries a password, or a ``password`` key, is refused. The URL comes from
``redis_url`` (no password in it), or whole from the environment variable ``redis_url_env``
names; a password from ``redis_password_file`` or the variable ``redis_password_env`` names
(with ``redis_username`` for an ACL user).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from offload_tiers.redis.credentials import has_inline_password, resolve_redis_url
from offload_tiers.redis.settings import check_ca_file, check_key_prefix
from offload_tiers.redis.url import redact_url

LMCACHE_EXPOSURE = ("LMCache logs its L2 adapter configuration and reports it over its HTTP "
                    "API, so the password would be in its log")


@dataclass(frozen=True)
class L2Settings:
    """What an LMCache user writes into ``adapter_params`` (every field optional but the URL)."""

    redis_url: str | None = None
    """``redis://host:port/db``, ``rediss://…`` (TLS), ``unix://…``, ``redis+cluster://…``;
    never with a password in it."""
    redis_url_env: str | None = None
    """The name of an environment variable that holds the whole URL (password included)."""
    redis_username: str | None = None
    redis_password_file: str | None = None
    """A file only this user can read whose content is the password."""
    redis_password_env: str | None = None
    """Or: an environment variable that holds the password."""
    key_prefix: str = "kvtier-lmcache"
    """Every key's prefix; one per deployment."""
    namespace: str = ""
    """Extra identity folded into every value's namespace digest (e.g. a weights version):
    values written under another one are misses."""
    ttl_s: float | None = None
    redis_timeout_s: float = 2.0
    connect_timeout_s: float | None = None
    cluster: bool | None = None
    ssl_ca_certs: str | None = None
    max_capacity_gb: float = 0.0
    """Capacity for LMCache's usage-driven eviction (0: no aggregate eviction signal)."""
    load_threads: int = 4
    """kvtier threads that serve load tasks, a task's keys split between them (each thread a
    connection of its own). On a shared 2-core box 4 kept up with LMCache's resp adapter (8 C++
    workers) where 1 and 2 fell behind when other work took the cores."""
    store_threads: int = 4
    """Connections a store task's keys are split over (the store thread and helpers)."""
    delete_corrupt: bool = True

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> L2Settings:
        """Validated settings from LMCache's ``adapter_params``; ValueError naming the key at
        fault (never a secret)."""
        if not isinstance(params, dict):
            raise ValueError("adapter_params must be a JSON object")
        known = {f.name for f in fields(cls)}
        for key in ("password", "redis_password", "username"):
            if key in params:
                raise ValueError(f"adapter_params.{key}: credentials never go into LMCache's "
                                 "config; use redis_password_file (and redis_username) or "
                                 "redis_url_env")
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"adapter_params: unknown key(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}")
        kw: dict[str, Any] = {}
        for name in ("redis_url", "redis_url_env", "redis_username", "redis_password_file",
                     "redis_password_env", "key_prefix", "namespace", "ssl_ca_certs"):
            if name in params and params[name] is not None:
                if not isinstance(params[name], str):
                    raise ValueError(f"adapter_params.{name} must be a string")
                kw[name] = params[name]
        for name in ("ttl_s", "redis_timeout_s", "connect_timeout_s", "max_capacity_gb"):
            value = params.get(name)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                    raise ValueError(f"adapter_params.{name} must be a non-negative number")
                kw[name] = float(value)
        for name in ("load_threads", "store_threads"):
            value = params.get(name)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"adapter_params.{name} must be a positive integer")
                kw[name] = value
        for name in ("cluster", "delete_corrupt"):
            value = params.get(name)
            if value is not None:
                if not isinstance(value, bool):
                    raise ValueError(f"adapter_params.{name} must be true or false")
                kw[name] = value
        settings = cls(**kw)
        settings.check()
        return settings

    def check(self) -> None:
        """Raise ValueError for settings that cannot work (names no secret)."""
        if self.redis_url and has_inline_password(self.redis_url):
            raise ValueError(f"adapter_params.redis_url {redact_url(self.redis_url)} carries a "
                             f"password: {LMCACHE_EXPOSURE}. Put the URL in an environment "
                             "variable named by redis_url_env, or the password in a file named "
                             "by redis_password_file")
        if not self.redis_url and not self.redis_url_env:
            raise ValueError("adapter_params: give redis_url or redis_url_env")
        try:
            check_key_prefix(self.key_prefix)
        except ValueError as exc:
            raise ValueError(f"adapter_params.key_prefix: {exc}") from None
        if self.ttl_s == 0:
            raise ValueError("adapter_params.ttl_s must be positive (leave it out for none)")
        if self.redis_timeout_s <= 0:
            raise ValueError("adapter_params.redis_timeout_s must be positive")
        if self.ssl_ca_certs is not None:
            try:
                check_ca_file(self.ssl_ca_certs)
            except ValueError as exc:
                raise ValueError(f"adapter_params.ssl_ca_certs: {exc}") from None

    def resolve_url(self) -> tuple[str, list[str]]:
        """The URL to connect with (password included, kept in memory only) and warnings."""
        url, warnings = resolve_redis_url(self.redis_url, url_env=self.redis_url_env,
                                          username=self.redis_username,
                                          password_file=self.redis_password_file,
                                          password_env=self.redis_password_env,
                                          exposure=LMCACHE_EXPOSURE)
        if url is None:  # check() makes this unreachable
            raise ValueError("adapter_params: give redis_url or redis_url_env")
        return url, warnings

    @property
    def max_capacity_bytes(self) -> int:
        return int(self.max_capacity_gb * (1 << 30))
