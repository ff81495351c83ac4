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
* The store past the CPU tier is a :class:`~connector.vllm_connector.remote_store.RemoteStore`
  handed in (which kind: :mod:`connector.vllm_connector.remote_store_factory`).
"""

from __future__ import annotations

from connector.vllm_connector.worker_io import WorkerIO
from connector.vllm_connector.worker_loads import WorkerLoads
from connector.vllm_connector.worker_saves import WorkerSaves


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
