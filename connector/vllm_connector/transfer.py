"""Copies blocks between vLLM's KV tensors and CPU-tier slots, on any device.

``gather`` reads blocks of one group into slot rows of the CPU tier's slab; ``scatter``
writes slot rows back into blocks. One indexed copy per tensor per call, whatever the
number of blocks. On CUDA the copies run on a side stream through pinned staging buffers
(``non_blocking``), fenced by events; on the CPU they are plain indexed copies.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from connector.vllm_connector.layout import GroupLayout, KVLayout, TensorSlice


class BlockTransfer:
    """Gather/scatter between the registered KV tensors and a uint8 slab of slots."""

    def __init__(self, kv_caches: dict[str, Any], layout: KVLayout, slab: np.ndarray) -> None:
        self.layout = layout
        self.slab = torch.from_numpy(slab)
        self._groups = {g.group: g for g in layout.groups}
        self._tensors: dict[tuple[str, int], torch.Tensor] = {}
        for group in layout.groups:
            for s in group.slices:
                value = kv_caches[s.layer]
                tensor = value[s.index] if isinstance(value, (list, tuple)) else value
                self._tensors[(s.layer, s.index)] = tensor
        first = next(iter(self._tensors.values()))
        self.device = first.device
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self.device) if self._cuda else None

    def group(self, group: int) -> GroupLayout:
        return self._groups[group]

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)

    def gather(self, group: int, block_ids: list[int], slots: list[int], *,
               dest: torch.Tensor | None = None) -> int:
        """Copy blocks ``block_ids`` of ``group`` into slab rows ``slots``; bytes copied.

        ``dest`` replaces the slab (a uint8 ``[rows, >= slot bytes]`` buffer of the caller's).
        """
        if not block_ids:
            return 0
        target = self.slab if dest is None else dest
        layout = self._groups[group]
        ids = self._ids(block_ids)
        rows = torch.tensor(slots, dtype=torch.long)
        n = len(block_ids)
        if self._cuda:
            assert self._stream is not None
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            staged: list[tuple[TensorSlice, torch.Tensor]] = []
            with torch.cuda.stream(self._stream):
                for s in layout.slices:
                    flat = self._read(s, ids, n)
                    host = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=True)
                    host.copy_(flat, non_blocking=True)
                    staged.append((s, host))
            self._stream.synchronize()
            for s, host in staged:
                target[rows, s.offset:s.offset + s.nbytes] = host
        else:
            for s in layout.slices:
                target[rows, s.offset:s.offset + s.nbytes] = self._read(s, ids, n)
        return n * layout.nbytes

    def _read(self, s: TensorSlice, ids: torch.Tensor, n: int) -> torch.Tensor:
        tensor = self._tensors[(s.layer, s.index)]
        data = tensor.index_select(s.block_dim, ids).movedim(s.block_dim, 0).contiguous()
        return data.view(torch.uint8).reshape(n, s.nbytes)

    def scatter(self, group: int, block_ids: list[int], slots: list[int], *,
                corrupt: bool = False) -> int:
        """Copy slab rows ``slots`` into blocks ``block_ids`` of ``group``; bytes copied.

        ``corrupt`` (tests only) writes noise instead of floating-point KV, to prove that
        loaded blocks are really used.
        """
        if not block_ids:
            return 0
        layout = self._groups[group]
        ids = self._ids(block_ids)
        rows = torch.tensor(slots, dtype=torch.long)
        slab = self.slab
        n = len(block_ids)
        stream_ctx = torch.cuda.stream(self._stream) if self._cuda else contextlib.nullcontext()
        if self._cuda:
            assert self._stream is not None
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with stream_ctx:
            for s in layout.slices:
                tensor = self._tensors[(s.layer, s.index)]
                raw = slab[rows, s.offset:s.offset + s.nbytes]
                dtype = getattr(torch, s.dtype)
                typed = raw.view(dtype).reshape((n, *s.block_shape))
                if corrupt and typed.is_floating_point():
                    typed = torch.randn_like(typed) * 4.0
                if self._cuda:
                    typed = typed.pin_memory().to(self.device, non_blocking=True)
                tensor.index_copy_(s.block_dim, ids, typed.movedim(0, s.block_dim))
        if self._cuda:
            assert self._stream is not None
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        return n * layout.nbytes
