"""The worker half (one per TP rank): owns the bytes, copies blocks, talks to Redis.

Rules this module keeps:

* The scheduler decides which slot holds which key; this rank's slab holds its shard of
  every slot. ``slot_keys[slot]`` is the key a slot really contains here: a load from a slot
  that holds something else (a failed copy, a fetch that did not validate) is a failed
  load, never a wrong block.
* The forward step never waits on Redis: probes and fetches run on kvtier's I/O threads,
  writes on the Redis tier's write-behind thread (``write_mode: back``, the default), and
  results are picked up at the next step. ``write_mode: through`` writes in the step.
* A request whose load failed in this step saves nothing in it: its blocks were computed
  over bad context.
* Every job in the plan is reported back exactly once (:class:`WorkerReport`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from connector.vllm_connector.config import TieredConfig
from connector.vllm_connector.daemon_redis import DAEMON_REDIS_TIMEOUT_S, DaemonRedis
from connector.vllm_connector.remote_store import OwnRedis, RemoteStore
from connector.vllm_connector.worker_io import WorkerIO
from connector.vllm_connector.worker_loads import WorkerLoads
from connector.vllm_connector.worker_saves import WorkerSaves
from offload_tiers.host_tier.client import HostTierClient
from offload_tiers.redis.settings import WRITE_SETTLE_S

if TYPE_CHECKING:  # redis-py is imported only by an engine that uses Redis
    from offload_tiers.redis.tier import RedisTier

log = logging.getLogger("connector.vllm_connector.worker")  # the worker half's log


def make_redis_tier(config: TieredConfig) -> RedisTier:
    """The Redis tier a worker stores through, from the connector's settings (no vLLM here).

    Never raises for an unreachable or refusing server (TLS, ACL, password): the tier starts
    unavailable, says why in ``last_error`` (no password in it) and the worker serves from the
    CPU tier until Redis answers.
    """
    from offload_tiers.redis.tier import RedisTier

    redis = RedisTier.from_settings(config, write_linger_s=config.redis_write_linger_ms / 1e3,
                                    write_settle_s=WRITE_SETTLE_S)
    if not redis.available:
        log.warning("kvtier: Redis at %s is not answering (%s); serving from the CPU tier "
                    "until it does", redis.target.redacted, redis.last_error)
    return redis


def worker_redis(config: TieredConfig, host: HostTierClient | None) -> RemoteStore | None:
    """The Redis a worker uses: its own (``redis_url``), the daemon's (``host_tier_redis``),
    or None."""
    if config.host_tier_redis and host is not None:
        return DaemonRedis(host, DAEMON_REDIS_TIMEOUT_S)
    if config.redis_url:
        return OwnRedis(make_redis_tier(config), config.write_mode)
    return None


class TieredWorker(WorkerLoads, WorkerSaves, WorkerIO):
    """One rank's slab, transfers and Redis I/O: its loads, saves and I/O over one state."""

    def close(self) -> None:
        """Finish queued writes (bounded), stop the I/O threads, drop the slab. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.fence()
        if self._saver is not None:
            self._saver.shutdown(wait=True)
        # host-tier writes begun are committed (sent) within the flush's bound; any still
        # queued after it are cancelled, and the daemon releases their slots at this
        # process's exit: never served half-written
        self.flush_host(self.config.redis_shutdown_flush_s)
        self._io.shutdown(wait=True, cancel_futures=True)
        if self.redis is not None:
            self.redis.close(timeout=self.config.redis_shutdown_flush_s)
        self._segment_pins.close()
        self.host.close()
        self.transfer = None
        self.slab = self._slab_owner = None
