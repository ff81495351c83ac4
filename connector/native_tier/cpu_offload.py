"""vLLM's native OffloadingConnector on the CPU platform: a CPU transfer worker for it.

vLLM's stock ``CPUOffloadingSpec.get_worker`` refuses the CPU platform ("CPU Offloading is
currently only supported on CUDA-alike and XPU GPUs"): its worker copies with CUDA streams
and events. Everything else (the scheduler half, the ``CPUOffloadingManager`` and its LRU,
the canonical KV-cache description, chunking, hybrid groups) is platform-independent.

``CpuPeerOffloadingSpec`` keeps all of that and swaps in ``CpuTransferWorker``, which does
the same block copies synchronously with torch indexing, following the stock worker's
direct (worker-private) layout: one host page per chunk of ``blocks_per_chunk`` device
blocks, per canonical tensor; a group's first device block may start mid-chunk
(``block_indices``). Load it with::

    kv_connector="OffloadingConnector",
    kv_connector_extra_config={
        "spec_name": "CpuPeerOffloadingSpec",
        "spec_module_path": "connector.native_tier.cpu_offload",
        "cpu_bytes_to_use": 256 << 20,
    }
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from connector.native_tier.vllm_api import device_blocks


def _sub_block_rows(block_ids: np.ndarray, per_row: int, skip: int, count: int) -> torch.Tensor:
    """Rows of a ``(rows * per_row, page)`` view for ``count`` blocks starting ``skip`` in."""
    ids = block_ids.astype(np.int64)
    if per_row == 1:
        flat = ids
    else:
        flat = (ids[:, None] * per_row + np.arange(per_row, dtype=np.int64)[None, :]).ravel()
    rows = flat[skip:skip + count]
    if len(rows) != count:
        raise ValueError(f"transfer spec names {len(rows)} blocks, the group needs {count}")
    return torch.from_numpy(np.ascontiguousarray(rows))


class CpuTransferWorker(OffloadingWorker):
    """Synchronous device<->host block copies for the native connector on the CPU platform."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int,
                 num_cpu_chunks: int) -> None:
        if not kv_caches.tensors:
            raise ValueError("no KV-cache tensors to offload")
        self._bpc = blocks_per_chunk
        self._kv_caches = kv_caches  # vLLM's tensors: 0.34's device pointers name blocks of them
        self._refs: list[list[CanonicalKVCacheRef]] = kv_caches.group_data_refs
        self._device: list[torch.Tensor] = []
        self._host: list[torch.Tensor] = []
        for canonical in kv_caches.tensors:
            dev = canonical.tensor
            if dev.dtype != torch.int8 or dev.ndim != 2:
                dev = dev.view(torch.int8).view(-1, canonical.page_size_bytes)
            page = canonical.page_size_bytes
            host = torch.zeros((num_cpu_chunks * blocks_per_chunk, page), dtype=torch.int8)
            self._device.append(dev)
            self._host.append(host)
        self._done: list[TransferResult] = []

    def _transfer(self, job_id: int, host_spec: LoadStoreSpec, device: Any,
                  to_host: bool) -> bool:
        if not isinstance(host_spec, BlockIDsLoadStoreSpec):
            raise TypeError("the host side of a transfer must be a block-id spec")
        dev = device_blocks(device, self._kv_caches)
        host_ids = host_spec.block_ids
        if len(dev.group_sizes) != len(self._refs):
            raise ValueError("group count of the transfer does not match the KV-cache groups")
        t0 = time.perf_counter()
        moved = 0
        dev_off = host_off = 0
        for g_idx, (size, first_idx) in enumerate(
                zip(dev.group_sizes, dev.block_indices, strict=True)):
            if size == 0:
                continue
            skip = first_idx % self._bpc
            n_host = -(-(size + skip) // self._bpc)
            dev_rows = _sub_block_rows(dev.block_ids[dev_off:dev_off + size], 1, 0, size)
            host_rows = _sub_block_rows(host_ids[host_off:host_off + n_host], self._bpc,
                                        skip, size)
            dev_off += size
            host_off += n_host
            for ref in self._refs[g_idx]:
                nbytes = ref.page_size_bytes
                dev_t, host = self._device[ref.tensor_idx], self._host[ref.tensor_idx]
                if to_host:
                    host[host_rows, :nbytes] = dev_t[dev_rows, :nbytes]
                else:
                    dev_t[dev_rows, :nbytes] = host[host_rows, :nbytes]
                moved += size * nbytes
        if dev_off != len(dev.block_ids) or host_off != len(host_ids):
            raise ValueError("transfer spec block counts do not add up")
        self._done.append(TransferResult(job_id=job_id, success=True, transfer_size=moved,
                                         transfer_time=time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src: Any, dst_spec: LoadStoreSpec) -> bool:
        """Device -> host. ``src``: a ``GPULoadStoreSpec`` (<= 0.33) or ``DevicePointers``
        (0.34), see :func:`connector.native_tier.vllm_api.device_blocks`."""
        return self._transfer(job_id, dst_spec, src, to_host=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst: Any,
                    expedited: bool = False) -> bool:
        """Host -> device. ``expedited`` (0.33: a load the step waits on) changes nothing:
        every copy here is synchronous."""
        return self._transfer(job_id, src_spec, dst, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # copies are synchronous: every submitted job is already complete

    def shutdown(self) -> None:
        self._host.clear()
        self._device.clear()


class CpuPeerOffloadingSpec(CPUOffloadingSpec):
    """``CPUOffloadingSpec`` whose worker runs on the CPU platform (scheduler side unchanged)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self.config.canonical_layout:
            raise ValueError("CpuPeerOffloadingSpec supports the direct layout only")
        if self._worker is None:
            self._worker = CpuTransferWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._worker
