"""The adapter on a real 3-master Redis Cluster (tests/support/redis_cluster.py): keys spread
over the nodes, each node's share served, listing walks every primary."""

from __future__ import annotations

import uuid
from typing import Any

from tests.lmcache.helpers import key, load, lookup, make_adapter, memory_obj, same_bytes, store
from tests.support.redis_cluster import RedisClusterProcs

CHUNK = 32 << 10


def test_cluster_round_trip_and_listing(redis_cluster: RedisClusterProcs) -> None:
    prefix = f"kvtier-test-{uuid.uuid4().hex[:12]}"
    adapter: Any = make_adapter({"redis_url": redis_cluster.url, "key_prefix": prefix})
    try:
        keys = [key(i, salt="tenant" if i % 3 else "") for i in range(24)]
        objs = [memory_obj(CHUNK, seed=i) for i in range(24)]
        assert store(adapter, keys, objs).is_successful()
        per_node = redis_cluster.total_keys(f"{prefix}:*")
        assert sum(1 for n in per_node.values() if n) == 3  # every master holds some
        assert lookup(adapter, [*keys, key(999)]) == [True] * 24 + [False]
        outs = [memory_obj(CHUNK) for _ in keys]
        assert load(adapter, keys, outs) == [True] * 24
        assert all(same_bytes(a, b) for a, b in zip(objs, outs, strict=True))
        adapter.submit_unlock(keys)

        seen, cursor = [], None
        while True:
            page = adapter.list_l2_keys(page_size=7, cursor=cursor)
            seen += page.entries
            cursor = page.next_page_token
            if cursor is None:
                break
        assert sorted(e.key.chunk_hash_hex for e in seen) == sorted(k.chunk_hash.hex()
                                                                     for k in keys)
        adapter.delete(keys[:10])
        assert lookup(adapter, keys[:12]) == [False] * 10 + [True] * 2
        adapter.submit_unlock(keys[10:12])
        assert adapter.get_usage().total_bytes_used == 14 * CHUNK
        assert adapter.report_status()["cluster"] is True
    finally:
        adapter.close()
