"""Redis URLs: which kind of deployment a URL names, and its form safe to log (no secrets).

The one place that knows the accepted schemes: the tier, the janitor and every settings
validator (connector, native tier, daemon; :mod:`offload_tiers.redis.settings`) go through
:func:`parse_redis_url`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

_SCHEMES = {
    "redis": ("redis", False),
    "rediss": ("rediss", False),
    "unix": ("unix", False),
    "redis+cluster": ("redis", True),
    "rediss+cluster": ("rediss", True),
}


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """A parsed URL: the URL redis-py understands, whether it is a Cluster, a loggable form."""

    url: str
    cluster: bool
    tls: bool
    redacted: str


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (user names are kept)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable redis url>"
    netloc = parts.netloc
    if "@" in netloc:
        creds, host = netloc.rsplit("@", 1)
        user = creds.split(":", 1)[0] if ":" in creds else ""
        netloc = f"{user}:***@{host}" if ":" in creds else f"***@{host}"
    query = re.sub(r"(?i)(password=)[^&]*", r"\1***", parts.query)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def parse_redis_url(url: str, cluster: bool | None = None) -> RedisTarget:
    """Classify ``url``; ``cluster`` overrides the ``+cluster`` scheme suffix when given."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in _SCHEMES:
        raise ValueError(
            f"unsupported Redis URL scheme {scheme!r} in {redact_url(url)}; expected one of "
            + ", ".join(f"{s}://" for s in _SCHEMES)
        )
    base, is_cluster = _SCHEMES[scheme]
    if cluster is not None:
        is_cluster = cluster
    if is_cluster and base == "unix":
        raise ValueError("Redis Cluster is not reachable over unix:// sockets")
    plain = base + url[len(scheme):]
    return RedisTarget(url=plain, cluster=is_cluster, tls=base == "rediss",
                       redacted=redact_url(url))

