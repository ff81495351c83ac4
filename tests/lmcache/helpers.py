"""LMCache's own objects for the adapter tests: keys, memory objects, the plugin loader, and
waiting on the adapter's event fds (never on time)."""

from __future__ import annotations

import select
from typing import Any

import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.platform import consume_fd

MODULE = "connector.lmcache_l2.adapter"
CLASS = "KvtierL2Adapter"
#: Long enough for any bounded Redis failure here (timeouts are 0.5-2 s), short enough that a
#: missing signal fails the test instead of hanging it.
FD_TIMEOUT_S = 20.0


def plugin_spec(params: dict[str, Any]) -> dict[str, Any]:
    """The ``--l2-adapter`` JSON an LMCache user writes."""
    return {"type": "plugin", "module_path": MODULE, "class_name": CLASS,
            "adapter_params": params}


def make_adapter(params: dict[str, Any]) -> Any:
    """The adapter as LMCache builds it: its plugin config, its factory."""
    spec = plugin_spec(params)
    spec.pop("type")
    return create_l2_adapter(PluginL2AdapterConfig.from_dict(spec))


def key(i: int, *, model: str = "meta-llama/Llama-3.1-8B", kv_rank: int = 0, salt: str = "",
        group: int = 0) -> ObjectKey:
    return ObjectKey(chunk_hash=i.to_bytes(8, "big") * 4, model_name=model, kv_rank=kv_rank,
                     object_group_id=group, cache_salt=salt)


def memory_obj(nbytes: int, seed: int | None = None) -> TensorMemoryObj:
    """A bf16 chunk of ``nbytes`` (random bytes for a seed, zeros otherwise)."""
    if seed is None:
        raw = torch.zeros(nbytes, dtype=torch.uint8)
    else:
        gen = torch.Generator().manual_seed(seed)
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    data = raw.view(torch.bfloat16)
    meta = MemoryObjMetadata(shape=torch.Size([nbytes // 2]), dtype=torch.bfloat16, address=0,
                             phy_size=nbytes, fmt=MemoryFormat.KV_2LTD, ref_count=1)
    return TensorMemoryObj(data, meta, parent_allocator=None)


def same_bytes(a: TensorMemoryObj, b: TensorMemoryObj) -> bool:
    return bytes(a.byte_array) == bytes(b.byte_array)


def wait_fd(fd: int, timeout: float = FD_TIMEOUT_S) -> None:
    """Block until ``fd`` is signalled (and consume it); AssertionError after ``timeout``."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    assert poller.poll(timeout * 1000), f"event fd {fd} not signalled within {timeout} s"
    consume_fd(fd)


def store(adapter: Any, keys: list[ObjectKey], objs: list[Any]) -> Any:
    """Submit a store task and wait for its result (an L2StoreResult)."""
    task = adapter.submit_store_task(keys, objs)
    done: dict[int, Any] = {}
    while task not in done:
        wait_fd(adapter.get_store_event_fd())
        done.update(adapter.pop_completed_store_tasks())
    return done[task]


def lookup(adapter: Any, keys: list[ObjectKey]) -> list[bool]:
    """Submit a lookup-and-lock task and wait for its bitmap (as a list)."""
    task = adapter.submit_lookup_and_lock_task(keys, {})
    while True:
        wait_fd(adapter.get_lookup_and_lock_event_fd())
        bitmap = adapter.query_lookup_and_lock_result(task)
        if bitmap is not None:
            return [bitmap.test(i) for i in range(len(keys))]


def load(adapter: Any, keys: list[ObjectKey], objs: list[Any]) -> list[bool]:
    """Submit a load task and wait for its bitmap (as a list)."""
    task = adapter.submit_load_task(keys, objs)
    while True:
        wait_fd(adapter.get_load_event_fd())
        bitmap = adapter.query_load_result(task)
        if bitmap is not None:
            return [bitmap.test(i) for i in range(len(keys))]


def redis_name(adapter: Any, k: ObjectKey) -> bytes:
    """The Redis key the adapter stores ``k`` under."""
    from connector.lmcache_l2.keys import ChunkOwner

    bkey = adapter.keys.block_key(ChunkOwner(k.model_name, k.kv_rank, k.cache_salt),
                                  k.object_group_id, k.chunk_hash)
    return f"{adapter.settings.key_prefix}:{bkey.name}".encode()
