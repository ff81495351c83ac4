"""Redis URLs: which kind of deployment a URL names, and its form safe to log (no secrets).

The one place that knows the accepted URLs: the tier, the janitor and every settings
validator (connector, native tier, daemon; :mod:`offload_tiers.redis.settings`) go through
:func:`parse_redis_url`. Rules it keeps:

* the whole URL is checked, not only its scheme: a TCP URL names a host, a port from 1 to
  65535 and a db (``/N``, N >= 0; only 0 on a Cluster); ``unix://`` names an absolute path
  (three slashes); query options are the ones in :data:`QUERY_OPTIONS`. redis-py accepts
  far more and fails only when it connects ("Redis not answering" forever), or silently
  ignores a bad db;
* no message names the password: a URL is shown redacted, and not at all when a password
  holding ``/ ? # @`` unencoded makes its parts ambiguous.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit, urlunsplit

_SCHEMES = {
    "redis": ("redis", False),
    "rediss": ("rediss", False),
    "unix": ("unix", False),
    "redis+cluster": ("redis", True),
    "rediss+cluster": ("rediss", True),
}


#: The query options a URL may carry, and what each must be. Others are refused: redis-py
#: would pass them to its connection as keyword arguments (an unknown one fails each connect)
#: or let them override kvtier's own settings (``socket_timeout`` over ``redis_timeout_s``).
QUERY_OPTIONS = {
    "db": "an integer >= 0 (the same as /N)",
    "password": "the password (prefer redis_url_env or redis_password_file)",
    "client_name": "a name shown by CLIENT LIST",
    "ssl_cert_reqs": "none, optional or required (rediss:// only)",
    "ssl_check_hostname": "true or false (rediss:// only)",
}
_TLS_ONLY = ("ssl_cert_reqs", "ssl_check_hostname")
_FORM = ("Write it as redis://[user:password@]host[:port][/db] (rediss:// for TLS), "
         "unix:///path/to/redis.sock[?db=N] or redis+cluster://host[:port]")


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
    if netloc == parts.netloc and query == parts.query:
        return url  # nothing to hide (urlunsplit would also drop unix:///'s empty host)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _shown(url: str) -> str:
    """``url`` as a message may show it: redacted, or not at all when a character of the
    password that needs percent-encoding made its parts ambiguous."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<the URL, not shown>"
    if "@" in url and "@" not in parts.netloc or parts.fragment:
        return "<the URL, not shown: it may hold a password>"
    return redact_url(url)


def _port(netloc: str) -> str:
    """The port as written in ``netloc`` ('' when none)."""
    host = netloc.rsplit("@", 1)[-1]
    tail = host.rsplit("]", 1)[-1] if host.startswith("[") else host
    return tail.rpartition(":")[2] if ":" in tail else ""


def _check_query(query: str, base: str) -> int | None:
    """The ``db`` option (None when absent); ValueError for an option kvtier does not know."""
    db = None
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in QUERY_OPTIONS:
            raise ValueError(f"unknown query option {name!r} (known: "
                             + ", ".join(QUERY_OPTIONS) + ")")
        if name in _TLS_ONLY and base != "rediss":
            raise ValueError(f"query option {name} applies to rediss:// (TLS) URLs only")
        if name == "db":
            if not value.isdigit():
                raise ValueError(f"query option db must be an integer >= 0, got {value!r}")
            db = int(value)
        if name == "ssl_cert_reqs" and value.lower() not in {"none", "optional", "required"}:
            raise ValueError(f"query option ssl_cert_reqs must be none, optional or required, "
                             f"got {value!r}")
        if name == "ssl_check_hostname" and value.lower() not in {"true", "false"}:
            raise ValueError(f"query option ssl_check_hostname must be true or false, "
                             f"got {value!r}")
    return db


def _check_form(url: str, base: str, cluster: bool) -> None:
    """ValueError (naming no secret) unless ``url`` is a whole URL redis-py reads as meant."""
    parts = urlsplit(url)
    if "@" in url and "@" not in parts.netloc or parts.fragment:
        raise ValueError("the user:password part cannot be told apart from the host: "
                         "percent-encode '/', '?', '#' and '@' in a password (e.g. %2F), or "
                         "give it in redis_password_file")
    db = _check_query(parts.query, base)
    if base == "unix":
        if parts.hostname:
            raise ValueError(f"unix:// takes an absolute socket path, got host "
                             f"{parts.hostname!r} (three slashes: unix:///path/to/redis.sock)")
        if parts.path in ("", "/"):
            raise ValueError("unix:// needs the socket's path")
        return
    if not parts.hostname:
        raise ValueError("no host")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"port must be an integer from 1 to 65535, got {_port(parts.netloc)!r}")
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise ValueError(f"the path must be the db number (/0, /1, ...), got {parts.path!r}")
    if path and db is not None and int(path) != db:
        raise ValueError(f"db given twice: /{path} and ?db={db}")
    if cluster and (int(path or 0) != 0 or (db or 0) != 0):
        raise ValueError("Redis Cluster has only db 0 (end the URL with /0 or no path)")


def parse_redis_url(url: str, cluster: bool | None = None) -> RedisTarget:
    """Classify ``url``; ``cluster`` overrides the ``+cluster`` scheme suffix when given.

    ValueError for a URL kvtier would not reach as written (see the module's rules); the
    message names the part at fault and the URL redacted, never the password.
    """
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in _SCHEMES:
        raise ValueError(
            f"unsupported Redis URL scheme {scheme!r} in {_shown(url)}; expected one of "
            + ", ".join(f"{s}://" for s in _SCHEMES)
        )
    base, is_cluster = _SCHEMES[scheme]
    if cluster is not None:
        is_cluster = cluster
    if is_cluster and base == "unix":
        raise ValueError("Redis Cluster is not reachable over unix:// sockets")
    try:
        _check_form(url, base, is_cluster)
    except ValueError as exc:
        raise ValueError(f"Redis URL {_shown(url)}: {exc}. {_FORM}") from None
    plain = base + url[len(scheme):]
    return RedisTarget(url=plain, cluster=is_cluster, tls=base == "rediss",
                       redacted=redact_url(url))

