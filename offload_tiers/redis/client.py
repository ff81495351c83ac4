"""Redis clients for the tier and the janitor: construction, endpoint health, secret scrubbing.

* :class:`ClientFactory` makes redis-py's client for a :class:`~offload_tiers.redis.url.
  RedisTarget` (one server, or a Cluster), TLS and AUTH/ACL coming from the URL and the
  ``ssl_*`` / ``password`` options. redis-py's own retries are off (``Retry(NoBackoff(), 0)``,
  no Cluster error retries), so a failure costs at most one ``timeout_s`` and the caller's
  :class:`Health` decides when to try again. It also scrubs the password (as written and
  percent-decoded) from every text it describes.
* :class:`Health` is one endpoint's up/down state: a failure marks it down until a jittered
  backoff expires (the backoff doubles per failure up to a cap); a success marks it up and
  resets the backoff. Callers hold their own lock around it.
"""

from __future__ import annotations

import logging
import random
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError
from redis.retry import Retry

from offload_tiers.redis.url import RedisTarget

__all__ = ["ClientFactory", "Health", "close_quietly"]

log = logging.getLogger(__name__)


class ClientFactory:
    """How to reach one Redis deployment: redis-py's options, and what must never be logged."""

    def __init__(self, target: RedisTarget, *, timeout_s: float,
                 connect_timeout_s: float | None = None, ssl_ca_certs: str | None = None,
                 **redis_kwargs: Any) -> None:
        kwargs = dict(redis_kwargs)
        if ssl_ca_certs is not None:
            kwargs["ssl_ca_certs"] = ssl_ca_certs
        kwargs.update(socket_timeout=timeout_s,
                      socket_connect_timeout=connect_timeout_s or timeout_s,
                      retry=Retry(NoBackoff(), 0))
        if not target.cluster:
            kwargs.setdefault("health_check_interval", 0)
        self.target = target
        self.kwargs = kwargs
        self._secrets = sorted({s for s in (*_url_passwords(target.url), kwargs.get("password"))
                                if s}, key=len, reverse=True)

    def make(self) -> Any:
        """A new ``redis.Redis``, or ``RedisCluster`` for a Cluster target (it connects)."""
        if self.target.cluster:
            from redis.cluster import RedisCluster  # noqa: PLC0415 - only for Cluster URLs

            return RedisCluster.from_url(self.target.url, cluster_error_retry_attempts=0,
                                         **self.kwargs)
        return redis.Redis.from_url(self.target.url, **self.kwargs)

    def scrub(self, text: str) -> str:
        """``text`` with every form of the password replaced by ``***``."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def describe(self, exc: BaseException) -> str:
        """A failure, said without the password."""
        if isinstance(exc, AuthenticationError):
            return self.scrub(f"authentication failed ({exc})")
        return self.scrub(f"{type(exc).__name__}: {exc}")


class Health:
    """One endpoint: up, or down until ``next_try`` (exponential backoff with jitter)."""

    __slots__ = ("label", "initial_s", "max_s", "available", "backoff_s", "next_try",
                 "failures")

    def __init__(self, label: str, initial_s: float, max_s: float) -> None:
        self.label = label
        self.initial_s = initial_s
        self.max_s = max_s
        self.available = True
        self.backoff_s = initial_s
        self.next_try = 0.0
        self.failures = 0

    def failed(self, now: float) -> bool:
        """Mark it down: the next try is due after the backoff (× 0.5–1.5), which then
        doubles up to ``max_s``. True when it was up (an outage starts)."""
        was_up = self.available
        self.available = False
        self.failures += 1
        self.next_try = now + self.backoff_s * (0.5 + random.random())
        self.backoff_s = min(max(self.backoff_s, self.initial_s) * 2, self.max_s)
        return was_up

    def recovered(self) -> bool:
        """Mark it up and reset the backoff. True when it was down (an outage ends)."""
        was_down = not self.available
        self.available = True
        self.backoff_s = self.initial_s
        return was_down

    def waiting(self, now: float) -> bool:
        """Down, and its backoff has not expired yet."""
        return not self.available and now < self.next_try

    def due(self, now: float) -> bool:
        """Down, and its backoff has expired: time to try again."""
        return not self.available and now >= self.next_try


def close_quietly(client: Any) -> None:
    """Close a client (None: nothing to do); a failure to close is only logged (debug)."""
    if client is None:
        return
    try:
        client.close()
    except Exception:
        log.debug("closing a Redis client failed", exc_info=True)


def _url_passwords(url: str) -> tuple[str, ...]:
    """The URL's password, as written and percent-decoded (both are scrubbed from texts)."""
    try:
        password = urlsplit(url).password
    except ValueError:
        return ()
    return (password, unquote(password)) if password else ()
