"""Where the native tier meets vLLM's offloading API as it differs between releases.

vLLM 0.32, 0.33 and 0.34 were read from their wheels; every difference the native tier
depends on is named here once, and each has a test in ``tests/native/test_vllm_api.py``.

* ``OffloadingWorker.submit_store`` / ``submit_load`` (0.34): the device side of a transfer
  is a ``DevicePointers`` (one address and size per block and data reference, resolved from
  the canonical KV tensors by vLLM) instead of a ``GPULoadStoreSpec`` (block ids).
  :func:`device_blocks` turns either into block ids, checking every address against this
  worker's own tensors: a pointer kvtier cannot name as a block of them is refused, never
  written through.
* ``submit_load(..., expedited=)`` (0.33): a load the step waits on. kvtier's CPU copies are
  synchronous, so every load is as fast as it gets; the flag is accepted and ignored.
* ``OffloadingManager.lock`` (0.33): callers hold it around manager calls; 0.32 has none.
  :func:`manager_lock` is a no-op context there. The tier itself calls no manager method.
* ``SecondaryTierManager.touch`` (removed in 0.34): kvtier's tier never implemented it
  (Redis's own LRU sees the reads), so nothing to remove.
* ``JobResult.deferred_release`` (0.34): a failed promotion may defer the release of its
  primary chunks while the tier's I/O could still write them; ``drain_jobs`` must leave none
  unset. kvtier reports a load only once its I/O thread is done with the rows, so it never
  defers (the field stays None) and a drain has nothing to set.
* ``ReqContext`` token counts (0.34): not used; a chunk's length is still the position vLLM
  records for its key (``get_offload_key_position``, present in all three).
* The reset signal: vLLM tells a secondary tier of a connector-cache reset only by calling
  its ``drain_jobs()`` from ``TieringOffloadingManager.reset_cache`` (0.32, 0.33, 0.34: the
  one caller; ``on_reset_flushed`` (0.33) is the manager's, not forwarded to tiers).
  :data:`RESET_CALLER` names it; a test reads the installed vLLM's source and fails when
  another caller appears.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec, OffloadingManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager

try:  # vLLM >= 0.34
    from vllm.v1.kv_offload.base import DevicePointers
except ImportError:  # 0.32, 0.33: the device side is a GPULoadStoreSpec
    DevicePointers = None

#: The transfer workers are handed ``DevicePointers`` (0.34).
HAS_DEVICE_POINTERS: bool = DevicePointers is not None
#: Callers of an ``OffloadingManager`` hold its ``lock`` (0.33).
HAS_MANAGER_LOCK: bool = hasattr(OffloadingManager, "lock")
#: ``SecondaryTierManager.touch`` exists (<= 0.33).
HAS_TOUCH: bool = hasattr(SecondaryTierManager, "touch")
#: ``JobResult.deferred_release`` exists (0.34).
HAS_DEFERRED_RELEASE: bool = "deferred_release" in {f.name for f in dataclasses.fields(JobResult)}
#: The one place vLLM calls a secondary tier's ``drain_jobs()``: a connector-cache reset.
RESET_CALLER = ("v1/kv_offload/tiering/manager.py", "TieringOffloadingManager.reset_cache")


@dataclass(frozen=True, slots=True)
class DeviceBlocks:
    """The device side of one transfer, as block ids (whatever vLLM handed over)."""

    block_ids: np.ndarray  # int64, every group's blocks back to back
    group_sizes: tuple[int, ...]  # device blocks per group
    block_indices: tuple[int, ...]  # logical offset of each group's first block


def device_blocks(device: Any, kv_caches: CanonicalKVCaches) -> DeviceBlocks:
    """Block ids of a transfer's device side: a ``GPULoadStoreSpec`` (<= 0.33) as it is, a
    ``DevicePointers`` (0.34) mapped back through ``kv_caches`` (the tensors this worker
    was given). ValueError for an address that is not the start of a block of the group's
    tensors, or a size that is not its page: nothing is copied then."""
    if isinstance(device, GPULoadStoreSpec):
        return DeviceBlocks(np.asarray(device.block_ids, dtype=np.int64),
                            tuple(int(n) for n in device.group_sizes),
                            tuple(int(i) for i in device.block_indices))
    if DevicePointers is None or not isinstance(device, DevicePointers):
        raise TypeError(f"the device side of a transfer must be a GPULoadStoreSpec or "
                        f"DevicePointers, not {type(device).__name__}")
    refs = kv_caches.group_data_refs
    counts = tuple(int(n) for n in device.group_block_counts)
    if len(counts) != len(refs) or tuple(device.group_data_ref_counts) != tuple(
            len(r) for r in refs):
        raise ValueError("device pointers do not match the KV-cache groups")
    ptrs = np.asarray(device.ptrs, dtype=np.uint64)
    sizes = np.asarray(device.sizes, dtype=np.uint64)
    ids: list[np.ndarray] = []
    at = 0
    for n, group_refs in zip(counts, refs, strict=True):
        if n == 0:
            continue  # vLLM resolves no pointer for an empty group
        group_ids = None
        for ref in group_refs:
            tensor = kv_caches.tensors[ref.tensor_idx].tensor
            base, stride = np.uint64(tensor.data_ptr()), int(tensor.stride(0))
            rel = ptrs[at:at + n] - base  # uint64: an address below base wraps, caught below
            found = (rel // np.uint64(stride)).astype(np.int64)
            if (len(rel) != n or bool((rel % np.uint64(stride)).any())
                    or bool((found >= tensor.shape[0]).any()) or bool((found < 0).any())
                    or bool((sizes[at:at + n] != ref.page_size_bytes).any())
                    or (group_ids is not None and not np.array_equal(found, group_ids))):
                raise ValueError("a device pointer is not a block of this worker's KV tensors")
            group_ids = found
            at += n
        assert group_ids is not None
        ids.append(group_ids)
    if at != len(ptrs):
        raise ValueError("device pointer count does not add up")
    block_ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    return DeviceBlocks(block_ids, counts, tuple(int(i) for i in device.block_indices))


def manager_lock(manager: Any) -> contextlib.AbstractContextManager[Any]:
    """The lock callers of ``manager`` hold (0.33), or a no-op (0.32)."""
    lock = getattr(manager, "lock", None)
    return lock if lock is not None else contextlib.nullcontext()
