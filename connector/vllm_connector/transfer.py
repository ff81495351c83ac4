"""Copies blocks between vLLM's KV tensors and CPU-tier slots, on any device.

``gather`` reads blocks of one group into slot rows of the CPU tier's slab; ``scatter``
writes slot rows back into blocks.

* **CPU**: through NumPy views of the same memory (torch's byte-wise indexing of uint8 rows
  runs at ~1 GB/s; NumPy copies each block's bytes as one chunk): per tensor, one copy per
  run of blocks whose ids *and* slots are both consecutive, else one fancy-indexed copy of
  all blocks through a temporary. A tensor NumPy cannot view (last dimension not
  contiguous) keeps torch's indexed copies.
* **CUDA**: blocks are packed on the device into one ``[n, group bytes]`` buffer (one indexed
  copy per tensor, at device-memory speed), which then crosses the bus in as few DMA copies
  as the slot rows allow: one per run of consecutive slots straight into the slab when it
  is page-locked (the CPU tier pins it where CUDA is present), else one copy through a
  reusable pinned staging buffer. All of it runs on a side stream: the current stream waits
  for it, and the host waits before a slot's bytes are handed on (gather) or before its slot
  may be reused (scatter), so a slot is never read or written under a copy in flight.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from connector.vllm_connector.layout import GroupLayout, KVLayout, TensorSlice


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """``(first index, first slot, length)`` of each run of consecutive slots, in order."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((i, slot, 1))
    return runs


class KVCacheDetached(RuntimeError):
    """A copy was asked for while vLLM's KV cache is unregistered (sleep mode)."""


class BlockTransfer:
    """Gather/scatter between the registered KV tensors and a uint8 slab of slots.

    Every view of the KV memory (the tensors of each slice, their NumPy views) is taken by
    :meth:`attach` from the tensors vLLM hands over, and dropped by :meth:`detach`: across
    a sleep vLLM may back the cache with other memory, so no view outlives a registration.
    The slab, the side stream and the staging buffer are host-side and stay.
    """

    def __init__(self, kv_caches: dict[str, Any], layout: KVLayout, slab: np.ndarray) -> None:
        self.layout = layout
        self.slab = torch.from_numpy(slab)
        self._slab_np = slab
        self._groups = {g.group: g for g in layout.groups}
        self._tensors: dict[tuple[str, int], torch.Tensor] = {}
        self._blocks_np: dict[tuple[str, int], np.ndarray | None] = {}
        self.attached = False
        self.attach(kv_caches)
        first = next(iter(self._tensors.values()))
        self.device = first.device
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        self._slab_pinned = self._cuda and bool(self.slab.is_pinned())
        self._staging: torch.Tensor | None = None  # pinned, grown on demand

    def attach(self, kv_caches: dict[str, Any]) -> None:
        """Take this layout's tensors (and, on the CPU, their NumPy views) from
        ``kv_caches`` as they are now; the layout must already describe them."""
        tensors: dict[tuple[str, int], torch.Tensor] = {}
        for group in self.layout.groups:
            for s in group.slices:
                value = kv_caches[s.layer]
                tensors[(s.layer, s.index)] = \
                    value[s.index] if isinstance(value, (list, tuple)) else value
        self._tensors = tensors
        # per tensor: its blocks as a NumPy uint8 view, block dim first (CPU only)
        self._blocks_np = {
            (s.layer, s.index): _numpy_blocks(tensors[(s.layer, s.index)], s.block_dim)
            for g in self.layout.groups for s in g.slices
            if tensors[(s.layer, s.index)].device.type == "cpu"}
        self.attached = True

    def detach(self) -> None:
        """Drop every view of the KV memory; copies raise :class:`KVCacheDetached` until
        :meth:`attach`."""
        self._tensors = {}
        self._blocks_np = {}
        self.attached = False

    def _check_attached(self) -> None:
        if not self.attached:
            raise KVCacheDetached("vLLM's KV cache is unregistered (sleep mode): no block "
                                  "can be copied until restore_kv_caches")

    def group(self, group: int) -> GroupLayout:
        return self._groups[group]

    @property
    def gathers_in_numpy(self) -> bool:
        """True when :meth:`gather` into the slab is NumPy copies only (CPU tensors NumPy can
        view): safe on a thread of its own, where a torch kernel would start OpenMP threads
        of its own beside the worker's."""
        return not self._cuda and all(v is not None for v in self._blocks_np.values())

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)

    def _read_into(self, s: TensorSlice, ids: torch.Tensor, packed: torch.Tensor) -> None:
        """Select blocks ``ids`` of ``s``'s tensor straight into their columns of
        ``packed`` (``[n, group bytes]`` uint8): one kernel, no temporary (the packing is
        bound by launches: ~40 % less time than select, reorder, copy on an H200)."""
        tensor = self._tensors[(s.layer, s.index)]
        if s.offset % tensor.element_size():  # columns not aligned for a typed view
            packed[:, s.offset:s.offset + s.nbytes] = self._read(s, ids, packed.shape[0])
            return
        cols = packed[:, s.offset:s.offset + s.nbytes].view(tensor.dtype)
        out = cols.view((packed.shape[0], *s.block_shape)).movedim(0, s.block_dim)
        torch.index_select(tensor, s.block_dim, ids, out=out)

    def _read(self, s: TensorSlice, ids: torch.Tensor, n: int) -> torch.Tensor:
        tensor = self._tensors[(s.layer, s.index)]
        data = tensor.index_select(s.block_dim, ids).movedim(s.block_dim, 0).contiguous()
        return data.view(torch.uint8).reshape(n, s.nbytes)

    def _write(self, s: TensorSlice, ids: torch.Tensor, raw: torch.Tensor, n: int,
               corrupt: bool) -> None:
        typed = raw.view(getattr(torch, s.dtype)).reshape((n, *s.block_shape))
        if corrupt and typed.is_floating_point():
            typed = torch.randn_like(typed) * 4.0
        self._tensors[(s.layer, s.index)].index_copy_(s.block_dim, ids,
                                                      typed.movedim(0, s.block_dim))

    def gather(self, group: int, block_ids: list[int], slots: list[int], *,
               dest: torch.Tensor | None = None, dest_pinned: bool = False) -> int:
        """Copy blocks ``block_ids`` of ``group`` into slab rows ``slots``; bytes copied.

        ``dest`` replaces the slab (a uint8 ``[rows, >= group bytes]`` buffer of the
        caller's, rows possibly strided: the host tier's shared segment); ``dest_pinned``
        says its memory is page-locked (each row then crosses in one DMA). Returns once the
        bytes are in place.
        """
        if not block_ids:
            return 0
        self._check_attached()
        target = self.slab if dest is None else dest
        layout = self._groups[group]
        ids = self._ids(block_ids)
        n = len(block_ids)
        if self._cuda:
            self._gather_cuda(layout, ids, slots, target,
                              pinned=self._slab_pinned if dest is None else dest_pinned)
            return n * layout.nbytes
        target_np = self._slab_np if dest is None else dest.numpy()
        runs = _paired_runs(block_ids, slots)
        for s in layout.slices:
            blocks = self._blocks_np[(s.layer, s.index)]
            cols = slice(s.offset, s.offset + s.nbytes)
            if blocks is None:
                target[torch.tensor(slots, dtype=torch.long), cols] = self._read(s, ids, n)
            elif runs is not None:
                for b, r, m in runs:
                    target_np[r:r + m, cols] = blocks[b:b + m].reshape(m, s.nbytes)
            else:
                target_np[slots, cols] = blocks[block_ids].reshape(n, s.nbytes)
        return n * layout.nbytes

    def scatter(self, group: int, block_ids: list[int], slots: list[int], *,
                corrupt: bool = False, source: np.ndarray | None = None,
                source_pinned: bool = False) -> int:
        """Copy slab rows ``slots`` into blocks ``block_ids`` of ``group``; bytes copied.

        ``source`` replaces the slab: a uint8 ``[rows, >= group bytes]`` array whose rows
        may be strided (the host tier's shared segment); ``source_pinned`` says its memory
        is page-locked (registered with CUDA), so each row crosses in one DMA rather than
        through the staging buffer. ``corrupt`` (tests only) writes
        noise instead of floating-point KV, to prove that loaded blocks are really used.
        Returns once the rows may be reused; the device's current stream waits for the
        blocks before its next kernel.
        """
        if not block_ids:
            return 0
        self._check_attached()
        layout = self._groups[group]
        ids = self._ids(block_ids)
        n = len(block_ids)
        src = self.slab if source is None else torch.from_numpy(source)
        if self._cuda:
            self._scatter_cuda(layout, ids, slots, corrupt, src,
                               pinned=self._slab_pinned if source is None else source_pinned)
            return n * layout.nbytes
        src_np = self._slab_np if source is None else source
        runs = _paired_runs(block_ids, slots)
        for s in layout.slices:
            blocks = self._blocks_np[(s.layer, s.index)]
            cols = slice(s.offset, s.offset + s.nbytes)
            if blocks is None or corrupt:
                self._write(s, ids, src[torch.tensor(slots, dtype=torch.long), cols], n,
                            corrupt)
            elif runs is not None:
                for b, r, m in runs:
                    blocks[b:b + m] = src_np[r:r + m, cols].reshape((m, *blocks.shape[1:]))
            else:
                blocks[block_ids] = src_np[slots, cols].reshape((n, *blocks.shape[1:]))
        return n * layout.nbytes

    # -- CUDA ---------------------------------------------------------------------------

    def _staging_rows(self, n: int, nbytes: int) -> torch.Tensor:
        """A pinned ``[n, nbytes]`` host buffer, reused across calls (each call ends with the
        side stream synchronized, so no copy into or out of it is still in flight)."""
        need = n * nbytes
        if self._staging is None or self._staging.numel() < need:
            self._staging = torch.empty(max(need, 1 << 20), dtype=torch.uint8,
                                        pin_memory=True)
        return self._staging[:need].view(n, nbytes)

    def _gather_cuda(self, layout: GroupLayout, ids: torch.Tensor, slots: list[int],
                     target: torch.Tensor, *, pinned: bool) -> None:
        assert self._stream is not None
        n, nbytes = len(slots), layout.nbytes
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            packed = torch.empty((n, nbytes), dtype=torch.uint8, device=self.device)
            for s in layout.slices:
                self._read_into(s, ids, packed)
            if pinned:
                for start, first, length in self._runs(slots, nbytes, target):
                    target[first:first + length, :nbytes].copy_(
                        packed[start:start + length], non_blocking=True)
            else:
                staging = self._staging_rows(n, nbytes)
                staging.copy_(packed, non_blocking=True)
        self._stream.synchronize()
        if not pinned:
            target[torch.tensor(slots, dtype=torch.long), :nbytes] = staging

    def _scatter_cuda(self, layout: GroupLayout, ids: torch.Tensor, slots: list[int],
                      corrupt: bool, source: torch.Tensor, *, pinned: bool) -> None:
        assert self._stream is not None
        n, nbytes = len(slots), layout.nbytes
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            packed = torch.empty((n, nbytes), dtype=torch.uint8, device=self.device)
            if pinned:
                for start, first, length in self._runs(slots, nbytes, source):
                    packed[start:start + length].copy_(
                        source[first:first + length, :nbytes], non_blocking=True)
            else:
                staging = self._staging_rows(n, nbytes)
                torch.index_select(source[:, :nbytes], 0,
                                   torch.tensor(slots, dtype=torch.long), out=staging)
                packed.copy_(staging, non_blocking=True)
            for s in layout.slices:
                self._write(s, ids, packed[:, s.offset:s.offset + s.nbytes], n, corrupt)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        self._stream.synchronize()  # the slots' bytes have crossed: they may be reused

    @staticmethod
    def _runs(slots: list[int], nbytes: int, rows: torch.Tensor) -> list[tuple[int, int, int]]:
        """Runs of consecutive slots that are one contiguous span of ``rows`` (rows of
        exactly ``nbytes``); single slots otherwise (a row's prefix is always contiguous)."""
        if rows.shape[1] == nbytes and rows.is_contiguous():
            return slot_runs(slots)
        return [(i, slot, 1) for i, slot in enumerate(slots)]


#: Use per-run copies when the runs average at least this many blocks (fewer, longer
#: copies beat one fancy-indexed copy through a temporary).
MIN_MEAN_RUN = 4


def _numpy_blocks(tensor: torch.Tensor, block_dim: int) -> np.ndarray | None:
    """``tensor``'s memory as NumPy uint8, block dimension first (a view, no copy); None
    when NumPy cannot view it (a last dimension that is not contiguous)."""
    try:
        raw = tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)
        return np.moveaxis(raw.numpy(), block_dim, 0)
    except (RuntimeError, TypeError):
        return None


def _paired_runs(block_ids: list[int], slots: list[int]) -> list[tuple[int, int, int]] | None:
    """``(first block id, first slot, length)`` of each run where block ids and slots both
    step by one; None when the runs are too short to beat one fancy-indexed copy."""
    runs: list[tuple[int, int, int]] = []
    for block, slot in zip(block_ids, slots, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == block and runs[-1][1] + runs[-1][2] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((block, slot, 1))
    return runs if len(runs) * MIN_MEAN_RUN <= len(block_ids) else None
