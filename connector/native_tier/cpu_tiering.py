"""vLLM's native multi-tier offloading (``TieringOffloadingSpec``) on the CPU platform.

``TieringOffloadingSpec`` keeps its primary tier in a shared memory region
(``/dev/shm/vllm_offload_{engine_id}.mmap``): the worker copies device blocks into it, the
scheduler-side secondary tiers read and write the same bytes through ``primary_kv_view``.
Its stock worker (``CPUOffloadingWorker``) asserts CUDA/XPU tensors, and its ``get_worker``
refuses the CPU platform. ``CpuTieringOffloadingSpec`` keeps everything else of the spec
(manager, secondary tiers, metrics, the region and its layout) and swaps in the CPU copy
worker of :mod:`connector.native_tier.cpu_offload`, pointed at this rank's views of the
shared region instead of private host tensors. Load it with::

    kv_connector="OffloadingConnector",
    kv_connector_extra_config={
        "spec_name": "CpuTieringOffloadingSpec",
        "spec_module_path": "connector.native_tier.cpu_tiering",
        "cpu_bytes_to_use": 256 << 20,
        "secondary_tiers": [...],
    }

Direct (worker-private) layout only, as in the peer worker.
"""

from __future__ import annotations

import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from connector.native_tier.cpu_offload import CpuTransferWorker


class _ChunkRows:
    """A ``(chunks * blocks_per_chunk, page)`` row view over a strided ``(chunks, bpc*page)``
    region view: the peer worker indexes host rows as ``host[rows, :nbytes]``."""

    def __init__(self, view: torch.Tensor, blocks_per_chunk: int) -> None:
        chunks, width = view.shape
        page = width // blocks_per_chunk
        self._view = view.as_strided((chunks, blocks_per_chunk, page),
                                     (view.stride(0), page, 1))
        self._bpc = blocks_per_chunk

    def _split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rows // self._bpc, rows % self._bpc

    def __getitem__(self, index: tuple[torch.Tensor, slice]) -> torch.Tensor:
        rows, cols = index
        chunk, sub = self._split(rows)
        return self._view[chunk, sub, cols]

    def __setitem__(self, index: tuple[torch.Tensor, slice], value: torch.Tensor) -> None:
        rows, cols = index
        chunk, sub = self._split(rows)
        self._view[chunk, sub, cols] = value


class CpuTieringWorker(CpuTransferWorker):
    """The peer CPU worker, copying into this rank's area of the shared primary region."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int,
                 num_cpu_chunks: int, region: SharedOffloadRegion) -> None:
        super().__init__(kv_caches, blocks_per_chunk, 0)
        self._region = region
        self._host = [
            _ChunkRows(region.create_next_worker_view(t.page_size_bytes * blocks_per_chunk),
                       blocks_per_chunk)
            for t in kv_caches.tensors
        ]

    def shutdown(self) -> None:
        super().shutdown()
        self._region.cleanup()


class CpuTieringOffloadingSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` whose worker runs on the CPU platform."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self.config.canonical_layout:
            raise ValueError("CpuTieringOffloadingSpec supports the direct layout only")
        if self._worker is None:
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(
                engine_id=self._engine_id, num_chunks=self.num_chunks, rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker)
            try:
                self._worker = CpuTieringWorker(kv_caches, self.blocks_per_chunk,
                                                self.num_chunks, region)
            except Exception:
                region.cleanup()
                raise
        return self._worker
