"""Where the connector meets vLLM's API as it differs between releases (0.32, 0.33, 0.34).

Every difference the connector depends on is named here once; the rest of the connector
codes against one shape. Each entry says which release changed what (read from the wheels'
source) and has a test in ``tests/connector/test_vllm_api.py``.

* ``KVCacheAccess`` (0.34, ``vllm.config.kv_transfer``): the flags a connector's
  ``kv_cache_access()`` returns. Before 0.34 nothing asks; :data:`IN_PROCESS` is the flag
  (its value, 0, on older releases).
* ``unregister_kv_caches`` / ``restore_kv_caches`` / ``supports_sleep_mode`` (0.33,
  ``KVConnectorBase_V1``): called around sleep mode; :data:`HAS_SLEEP_HOOKS`.
* ``may_load_async``, ``kv_cache_access``, ``supports_lookahead_block_hashes`` (0.34):
  :data:`HAS_ASYNC_ADMISSION`.
* ``KVCacheManager.get_num_cached_tokens`` (0.34): vLLM's own prefix-cache hit for a request
  that is not scheduled yet, without taking references; :func:`local_hit_tokens`.
* Unchanged where kvtier reads them, checked on 0.34: ``KVCacheBlock.block_hash_num_tokens``
  is a plain field (read by attribute, as before); ``KVCacheBlock.pool`` (a weak reference
  in 0.34) and ``CacheConfig.DEFAULT_BLOCK_SIZE`` (16 -> 64) are never read: the block size
  comes from each group's spec.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

try:  # vLLM >= 0.34
    from vllm.config.kv_transfer import KVCacheAccess
except ImportError:  # 0.32, 0.33: no connector is asked how it reaches the KV cache
    KVCacheAccess = None

#: ``KVCacheAccess.IN_PROCESS`` where it exists, else its value: the workers reach the device
#: KV cache only in their own process, with torch / NumPy copies (no RDMA registration, no
#: export to another process), so any allocation works, the extensible KV cache included.
IN_PROCESS: Any = KVCacheAccess.IN_PROCESS if KVCacheAccess is not None else 0

#: vLLM calls ``unregister_kv_caches`` before a sleep and ``restore_kv_caches`` after wake-up.
HAS_SLEEP_HOOKS: bool = hasattr(KVConnectorBase_V1, "restore_kv_caches")

#: vLLM asks ``may_load_async`` when a request enters its waiting queues (with
#: ``--max-num-inflight-kv-loads``), and ``kv_cache_access`` when it allocates the KV cache.
HAS_ASYNC_ADMISSION: bool = hasattr(KVConnectorBase_V1, "may_load_async")


def local_hit_tokens(kv_cache_manager: Any, request: Any) -> int:
    """Tokens of ``request`` vLLM's own prefix cache holds (block-aligned, as its lookup
    before the connector's), or 0 where this release has no side-effect-free probe (before
    0.34, where nothing calls ``may_load_async`` either) or no manager is bound."""
    probe = getattr(kv_cache_manager, "get_num_cached_tokens", None)
    return int(probe(request)) if probe is not None else 0
