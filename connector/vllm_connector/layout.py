"""Where one block lives inside each layer's KV tensor: declared by vLLM, else read from strides.

vLLM hands the worker one tensor per layer (a list in older releases, e.g. Mamba conv + SSM
state). The block dimension is the one that vLLM's block ids index. Rules, in order:

1. **Declared.** ``declared_block_dims[layer][i]`` (read from vLLM by
   :mod:`connector.vllm_connector.declared_layout`) names the block dimension of tensor ``i``.
   It is used as given, after one check: its size must be ``num_blocks``.
2. **The one dimension of size num_blocks.** Undeclared tensors with exactly one such dimension.
3. **The outermost one.** Undeclared tensors with several: vLLM's page pool places whole
   blocks outermost inside a layer in its block-compact layouts (``LBHNC``, ``LBNHC``,
   ``BL..``, ``BHLNC``; Mamba's int8 page view ``[num_blocks, 1, 1, page_bytes]``), so the
   candidate with the strictly largest stride is the block dimension. Layouts that put
   another dimension outside the blocks (``LHBNC``; the legacy ``[2, num_blocks, ...]``)
   break this rule: that is why declarations come first.

Anything else (no candidate, a declaration of the wrong size, candidates with equal strides)
is a :class:`LayoutError` at engine start that names the layer, the shape and the fix. A
stored slot for group ``g`` is the concatenation of one block's bytes of every tensor of
every layer in ``g``, in layer-name order. This module never imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class LayoutError(ValueError):
    """The KV tensors cannot be laid out into slots (message says which layer and why)."""


@dataclass(frozen=True, slots=True)
class TensorSlice:
    """One tensor's share of a slot: which tensor, its block dim, where its bytes go."""

    layer: str
    index: int  # position in the layer's tensor list (0 for a plain tensor)
    block_dim: int
    block_shape: tuple[int, ...]  # shape of one block (block dim removed)
    dtype: str
    itemsize: int
    offset: int  # byte offset inside the slot
    nbytes: int  # bytes of one block


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """All tensor slices of one KV-cache group, packed back to back into a slot."""

    group: int
    kind: str  # "attention" | "mamba" | other spec kinds, lower-case
    block_size: int
    slices: tuple[TensorSlice, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slices)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The slot layout of every group; ``slot_bytes`` fits the largest group."""

    device: str
    num_blocks: int
    groups: tuple[GroupLayout, ...]

    @property
    def slot_bytes(self) -> int:
        return max((g.nbytes for g in self.groups), default=0)

    def descriptor(self) -> str:
        """A canonical string of the layout; part of the storage namespace."""
        parts = [self.device.split(":")[0]]
        for g in self.groups:
            tensors = ",".join(
                f"{s.dtype}[{'x'.join(map(str, s.block_shape))}]@{s.block_dim}" for s in g.slices
            )
            parts.append(f"g{g.group}:{g.kind}:{g.block_size}:{tensors}")
        return "|".join(parts)


def _as_list(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


_FIX = ("Fix: pass vLLM's declaration (declared_layout.declared_block_dims) to the layout, "
        "or, as a workaround, choose num_gpu_blocks_override so that no other dimension of "
        "the KV tensors has that size")


def find_block_dim(shape: tuple[int, ...], num_blocks: int, layer: str,
                   strides: tuple[int, ...] | None = None) -> int:
    """The block dimension of an undeclared tensor (rules 2 and 3 above); LayoutError if none.

    Without ``strides`` several dimensions of size ``num_blocks`` are an error.
    """
    dims = [d for d, size in enumerate(shape) if size == num_blocks]
    if len(dims) == 1:
        return dims[0]
    if not dims:
        raise LayoutError(
            f"layer {layer}: no dimension of shape {tuple(shape)} equals num_blocks={num_blocks}"
            f" and vLLM declared none. {_FIX}")
    if num_blocks == 1:
        return dims[0]  # one block: every candidate addresses the same bytes
    if strides is not None:
        ranked = sorted(dims, key=lambda d: strides[d], reverse=True)
        if strides[ranked[0]] > strides[ranked[1]]:
            return ranked[0]
    raise LayoutError(
        f"layer {layer}: shape {tuple(shape)} (strides {strides}) has several dimensions of "
        f"size num_blocks={num_blocks} and none is outermost; cannot tell which one indexes "
        f"blocks. {_FIX}")


def check_declared_dim(shape: tuple[int, ...], block_dim: int, num_blocks: int,
                       layer: str) -> int:
    """A block dimension declared by vLLM (rule 1), checked against the tensor's shape."""
    if not -len(shape) <= block_dim < len(shape):
        raise LayoutError(
            f"layer {layer}: vLLM declares block dimension {block_dim}, but the KV tensor has "
            f"shape {tuple(shape)}. Fix: the engine's KV tensors do not match its attention "
            "backend; report the backend and shape to kvtier")
    block_dim %= len(shape)
    if shape[block_dim] != num_blocks:
        raise LayoutError(
            f"layer {layer}: vLLM declares block dimension {block_dim}, but dimension "
            f"{block_dim} of shape {tuple(shape)} has size {shape[block_dim]}, not "
            f"num_blocks={num_blocks}. Fix: the engine's KV tensors do not match its "
            "declared layout (kernel-block views? pass declared_layout.manager_block_views)")
    return block_dim


def _block_dims(layer: str, tensors: list[Any], num_blocks: int,
                declared: dict[str, list[int]] | None) -> list[int]:
    """The block dimension of each tensor of ``layer``: declared, else from strides."""
    shapes = [tuple(int(s) for s in t.shape) for t in tensors]
    dims = None if declared is None else declared.get(layer)
    if dims is None:
        return [find_block_dim(shape, num_blocks, layer, tuple(int(s) for s in t.stride()))
                for shape, t in zip(shapes, tensors, strict=True)]
    if len(dims) != len(tensors):
        raise LayoutError(
            f"layer {layer}: vLLM declares {len(dims)} block dimension(s) {list(dims)}, but "
            f"the layer has {len(tensors)} KV tensor(s) of shapes {shapes}. Fix: report the "
            "layer's backend and shapes to kvtier")
    return [check_declared_dim(shape, int(dim), num_blocks, layer)
            for shape, dim in zip(shapes, dims, strict=True)]


def build_layout(kv_caches: dict[str, Any], groups: list[tuple[int, str, int, list[str]]],
                 num_blocks: int,
                 declared_block_dims: dict[str, list[int]] | None = None) -> KVLayout:
    """Lay out the slots. ``groups``: ``(group_id, kind, block_size, layer_names)``.

    ``declared_block_dims``: layer -> block dimension of each of its tensors, as vLLM
    declares them (:func:`declared_layout.declared_block_dims`); layers it leaves out, or
    all of them when it is None, follow the stride rules.
    """
    device = ""
    out: list[GroupLayout] = []
    for group_id, kind, block_size, layer_names in groups:
        slices: list[TensorSlice] = []
        offset = 0
        for layer in sorted(layer_names):
            if layer not in kv_caches:
                raise LayoutError(f"layer {layer} of group {group_id} has no KV tensor")
            tensors = _as_list(kv_caches[layer])
            dims = _block_dims(layer, tensors, num_blocks, declared_block_dims)
            for index, (tensor, block_dim) in enumerate(zip(tensors, dims, strict=True)):
                shape = tuple(int(s) for s in tensor.shape)
                block_shape = shape[:block_dim] + shape[block_dim + 1:]
                itemsize = int(tensor.element_size())
                nbytes = itemsize
                for s in block_shape:
                    nbytes *= s
                device = device or str(tensor.device)
                slices.append(TensorSlice(layer, index, block_dim, block_shape,
                                          str(tensor.dtype).replace("torch.", ""), itemsize,
                                          offset, nbytes))
                offset += nbytes
        out.append(GroupLayout(group_id, kind, block_size, tuple(slices)))
    if not out or all(not g.slices for g in out):
        raise LayoutError("no KV tensors to offload")
    return KVLayout(device or "cpu", num_blocks, tuple(out))
