"""What ``kvtier daemon`` holds besides its event index, built from its configuration.

* the Redis janitor (``redis_url``): keeps the Redis tier tidy (:mod:`offload_tiers.redis.janitor`);
* the host tier's server (``cpu_bytes``): the host's shared CPU tier on a Unix socket
  (:mod:`offload_tiers.host_tier.server`); with ``redis_url`` too, a Redis tier of its own for
  its Redis service (write-behind, restores and probes for ``host_tier_redis`` engines);
* the presence feed (``cpu_bytes`` and ``redis_url``): announces what the host tier writes
  behind and learns what Redis holds, for engines that reach Redis only through the daemon.

A part not configured is None. redis-py and the host tier are imported only when configured.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from connector.daemon.config import DaemonConfig

if TYPE_CHECKING:  # imported only when the daemon runs them (Redis, the host tier)
    from offload_tiers.host_tier.server import HostTierServer
    from offload_tiers.redis.janitor import RedisJanitor
    from offload_tiers.redis.presence_feed import PresenceFeed
    from offload_tiers.redis.tier import RedisTier

log = logging.getLogger("kvtier.daemon")


@dataclass(frozen=True, slots=True)
class DaemonParts:
    """The daemon's parts beside its index (each None when not configured). The host tier's
    server owns the presence feed it is given: its stop closes it."""

    janitor: RedisJanitor | None = None
    host_tier: HostTierServer | None = None
    presence_feed: PresenceFeed | None = None


def build_parts(cfg: DaemonConfig) -> DaemonParts:
    """The parts ``cfg`` configures, none started (``Daemon.start`` starts them); a
    ``ValueError`` for a host-tier group that is not a group here."""
    janitor = _make_janitor(cfg)
    if cfg.cpu_bytes is None:
        return DaemonParts(janitor)
    from offload_tiers.host_tier.server import HostTierServer

    group = _group_id(cfg.host_tier_group)
    redis = feed = None
    if cfg.redis_url is not None:  # write-behind and restores for host_tier_redis engines
        redis = _host_tier_redis(cfg)
        feed = _presence_feed(cfg)
    server = HostTierServer(name=cfg.host_tier_name, cpu_bytes=cfg.cpu_bytes,
                            slot_bytes=cfg.slot_bytes, socket_path=cfg.host_tier_socket_path,
                            max_clients=cfg.host_tier_max_clients,
                            mode=0o600 if group is None else 0o660, group=group, redis=redis,
                            presence_feed=feed)
    return DaemonParts(janitor, server, feed)


def _make_janitor(cfg: DaemonConfig) -> RedisJanitor | None:
    """The Redis janitor when ``redis_url`` is configured (redis is imported only then)."""
    if cfg.redis_url is None:
        return None
    from offload_tiers.redis.janitor import RedisJanitor

    for warning in cfg.redis_warnings:
        log.warning("kvtier daemon: %s", warning)

    return RedisJanitor(
        cfg.redis_url, cfg.redis_prefix, interval_s=cfg.janitor_interval_s,
        scan_count=cfg.janitor_scan_count, max_keys_per_s=cfg.janitor_max_keys_per_s,
        max_keys_per_pass=cfg.janitor_max_keys_per_pass,
        allowed_fingerprints=cfg.janitor_allowed_fingerprints, dry_run=cfg.janitor_dry_run,
        redis_timeout_s=cfg.redis_timeout_s, ssl_ca_certs=cfg.redis_ssl_ca_certs)


def _group_id(name: str | None) -> int | None:
    """The gid of the group allowed to attach to the host tier (None: only this user)."""
    if name is None:
        return None
    import grp

    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ValueError(f"host_tier_group {name!r} is not a group on this host") from None


def _host_tier_redis(cfg: DaemonConfig) -> RedisTier:
    """The host tier's own Redis tier (its Redis service writes through it)."""
    from offload_tiers.redis.settings import SHORT_WRITE_LINGER_S
    from offload_tiers.redis.tier import RedisTier

    # the host tier's shared slots stay held until written: a short linger
    redis = RedisTier.from_settings(cfg, write_linger_s=SHORT_WRITE_LINGER_S)
    if not redis.available:
        log.warning("kvtier daemon: Redis at %s is not answering (%s); the host tier "
                    "writes behind and restores once it does", redis.target.redacted,
                    redis.last_error)
    return redis


def _presence_feed(cfg: DaemonConfig) -> PresenceFeed:
    """The host tier's presence feed: announces what it writes behind on the prefix's
    presence stream (as engines announce their own writes) and learns what Redis holds
    (a walk of the key names, then every engine's announcements) for the engines that
    reach Redis only through the daemon; its own thread and connection."""
    from offload_tiers.redis.presence_feed import PresenceFeed

    # its blocking reads wait up to a tenth of a second: a generous timeout (a timeout costs
    # a walk of the key names; nothing waits on this thread)
    return PresenceFeed(cfg.client_factory(min_timeout_s=5.0), cfg.redis_prefix).start()
