"""Where one block lives inside each layer's KV tensor, read from the tensors' shapes.

vLLM hands the worker one tensor per layer (sometimes a list, e.g. Mamba conv + SSM state on
CUDA). The block dimension is the one whose size is the number of KV-cache blocks:

* CPU attention: ``[num_blocks, kv_heads, block_size, 2*head_dim]`` (dim 0)
* CUDA attention: ``[2, num_blocks, block_size, heads, head_dim]`` and friends (dim 1)
* Mamba pages on CPU: an int8 view ``[num_blocks, 1, 1, page_bytes]`` over shared memory

Nothing is assumed: a tensor with no block dimension, or an ambiguous one, is an error at
start. A stored slot for group ``g`` is the concatenation of one block's bytes of every
tensor of every layer in ``g``, in layer-name order.
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


def find_block_dim(shape: tuple[int, ...], num_blocks: int, layer: str) -> int:
    """The dimension of ``shape`` that indexes blocks; LayoutError if none or ambiguous."""
    dims = [d for d, size in enumerate(shape) if size == num_blocks]
    if len(dims) == 1:
        return dims[0]
    if not dims:
        raise LayoutError(
            f"layer {layer}: no dimension of shape {tuple(shape)} equals num_blocks={num_blocks}"
        )
    raise LayoutError(
        f"layer {layer}: shape {tuple(shape)} has several dimensions of size "
        f"num_blocks={num_blocks}; cannot tell which one indexes blocks"
    )


def build_layout(kv_caches: dict[str, Any], groups: list[tuple[int, str, int, list[str]]],
                 num_blocks: int) -> KVLayout:
    """Lay out the slots. ``groups``: ``(group_id, kind, block_size, layer_names)``."""
    device = ""
    out: list[GroupLayout] = []
    for group_id, kind, block_size, layer_names in groups:
        slices: list[TensorSlice] = []
        offset = 0
        for layer in sorted(layer_names):
            if layer not in kv_caches:
                raise LayoutError(f"layer {layer} of group {group_id} has no KV tensor")
            for index, tensor in enumerate(_as_list(kv_caches[layer])):
                shape = tuple(int(s) for s in tensor.shape)
                block_dim = find_block_dim(shape, num_blocks, layer)
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
