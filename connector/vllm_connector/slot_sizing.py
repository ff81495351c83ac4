"""How many CPU-tier slots an engine has, and how big each is: both halves size the tier
from vLLM's KV-cache config alone (:func:`expected_slot_bytes`, :func:`slot_count`), so
the scheduler's slot directory and every worker's slab agree on the number of slots.

Nothing here imports vLLM: the config objects are read by attribute.
"""

from __future__ import annotations

from typing import Any


def expected_slot_bytes(kv_cache_config: Any) -> int:
    """Bytes of the largest group's block over all its layers, as the config states it.

    Both halves size the CPU tier from this, so they agree on the number of slots; the
    worker's slab uses its real layout's slot size.
    """
    best = 0
    for group in kv_cache_config.kv_cache_groups:
        page = int(getattr(group.kv_cache_spec, "page_size_bytes", 0) or 0)
        best = max(best, page * len(group.layer_names))
    return best


def slot_count(cpu_bytes: int, slot_bytes: int) -> int:
    """How many slots a CPU tier of ``cpu_bytes`` holds (both halves call this)."""
    if slot_bytes <= 0:
        raise ValueError(f"slot size must be positive, got {slot_bytes}")
    count = cpu_bytes // slot_bytes
    if count < 1:
        raise ValueError(f"cpu_bytes={cpu_bytes} holds no block of {slot_bytes} bytes. "
                         f"Fix: set cpu_bytes >= {slot_bytes}")
    return count
