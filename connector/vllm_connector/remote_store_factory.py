"""Which remote store a worker gets (:class:`~connector.vllm_connector.remote_store.RemoteStore`),
from the connector's settings: the one place that knows the kinds.

* ``host_tier_redis`` with a host tier: the host's Redis through ``kvtier daemon``
  (:class:`~connector.vllm_connector.host_tier_redis.HostTierRedisStore`; no connection of
  its own);
* else ``redis_url``: the engine's own connection
  (:class:`~connector.vllm_connector.remote_store.OwnRedis` over kvtier's Redis tier);
* else none: the worker serves from its CPU tier (and the host tier) alone.

No vLLM here; redis-py is imported only when the engine's own Redis is configured.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from connector.vllm_connector.config import TieredConfig
from connector.vllm_connector.host_tier_redis import HOST_TIER_REDIS_TIMEOUT_S, HostTierRedisStore
from connector.vllm_connector.remote_store import OwnRedis, RemoteStore
from offload_tiers.host_tier.client import HostTierClient
from offload_tiers.redis.settings import WRITE_SETTLE_S

if TYPE_CHECKING:  # redis-py is imported only by an engine that uses Redis
    from offload_tiers.redis.tier import RedisTier

log = logging.getLogger("connector.vllm_connector.worker")  # the worker half's log


def open_remote_store(config: TieredConfig, host: HostTierClient | None) -> RemoteStore | None:
    """The store a worker's saves, probes and fetches use past its CPU tier (see above)."""
    if config.host_tier_redis and host is not None:
        if host.available and not host.redis:
            log.warning("kvtier: host_tier_redis is set but the daemon at %s holds no Redis "
                        "(start it with --redis-url); serving without Redis",
                        config.host_tier_socket)
        return HostTierRedisStore(host, HOST_TIER_REDIS_TIMEOUT_S)
    if config.redis_url:
        return OwnRedis(make_redis_tier(config), config.write_mode)
    return None


def make_redis_tier(config: TieredConfig) -> RedisTier:
    """The Redis tier a worker stores through, from the connector's settings (no vLLM here).

    Never raises for an unreachable or refusing server (TLS, ACL, password): the tier starts
    unavailable, says why in ``last_error`` (no password in it) and the worker serves from the
    CPU tier until Redis answers.
    """
    from offload_tiers.redis.tier import RedisTier

    redis = RedisTier.from_settings(config, write_linger_s=config.redis_write_linger_ms / 1e3,
                                    write_settle_s=WRITE_SETTLE_S,
                                    write_batch_items=config.redis_write_batch,
                                    write_pace_s=config.redis_write_pace_ms / 1e3)
    if not redis.available:
        log.warning("kvtier: Redis at %s is not answering (%s); serving from the CPU tier "
                    "until it does", redis.target.redacted, redis.last_error)
    return redis
