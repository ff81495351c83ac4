"""Checks for the settings that configure a Redis tier, shared by every settings model
(the connector's, the native tier's, the daemon's): each returns the value to keep or raises
ValueError with a message that names no secret."""

from __future__ import annotations

from pathlib import Path

from offload_tiers.redis.url import parse_redis_url

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
