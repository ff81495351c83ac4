"""Layouts read from shapes, and gather/scatter round trips on CPU tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from connector.vllm_connector.layout import LayoutError, build_layout, find_block_dim
from connector.vllm_connector.transfer import BlockTransfer

NB = 7


def test_block_dim_from_shapes() -> None:
    assert find_block_dim((NB, 2, 32, 64), NB, "cpu") == 0
    assert find_block_dim((2, NB, 32, 4, 32), NB, "cuda") == 1
    with pytest.raises(LayoutError, match="no dimension"):
        find_block_dim((3, 2, 32), NB, "x")
    with pytest.raises(LayoutError, match="several"):
        find_block_dim((NB, NB, 4), NB, "x")


def _caches() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    page = 4 * 2 * 8 * 16  # bytes of one attention block (float32 [2, 8, 16])
    shared = torch.zeros(NB * page, dtype=torch.int8)
    attn = shared.view(torch.float32).view(NB, 2, 8, 16)  # CPU-style
    mamba = torch.as_strided(shared, (NB, 1, 1, 300), (page, page, page, 1))  # int8 page view
    cuda_style = torch.randn(2, NB, 8, 2, 8)  # [2, blocks, block_size, heads, dim]
    attn.copy_(torch.randn_like(attn))
    return {"attn": attn, "mamba": mamba, "kv2": cuda_style}


def test_round_trip_all_layouts() -> None:
    caches = _caches()
    layout = build_layout(caches, [(0, "mamba", 8, ["mamba"]), (1, "attention", 8, ["attn"]),
                                   (2, "attention", 8, ["kv2"])], NB)
    assert layout.groups[0].nbytes == 300
    assert layout.groups[2].slices[0].block_dim == 1
    slab = np.zeros((4, layout.slot_bytes), dtype=np.uint8)
    mover = BlockTransfer(caches, layout, slab)
    want_attn = caches["attn"][[3, 5]].clone()
    want_kv2 = caches["kv2"][:, [2]].clone()
    want_mamba = caches["mamba"][4].clone()
    mover.gather(1, [3, 5], [0, 1])
    mover.gather(2, [2], [2])
    mover.gather(0, [4], [3])
    caches["kv2"].zero_()
    mover.scatter(1, [1, 6], [0, 1])
    mover.scatter(2, [0], [2])
    assert torch.equal(caches["attn"][[1, 6]], want_attn)
    assert torch.equal(caches["kv2"][:, [0]], want_kv2)
    mover.scatter(0, [2], [3])
    assert torch.equal(caches["mamba"][2], want_mamba)
    # Bytes of the shared page beyond the Mamba view are untouched by the Mamba scatter.
    assert layout.descriptor().startswith("cpu|g0:mamba:8:int8[1x1x300]@0")


def test_corrupt_switch_changes_loaded_floats() -> None:
    caches = _caches()
    layout = build_layout(caches, [(0, "attention", 8, ["attn"])], NB)
    slab = np.zeros((2, layout.slot_bytes), dtype=np.uint8)
    mover = BlockTransfer(caches, layout, slab)
    mover.gather(0, [1], [0])
    want = caches["attn"][1].clone()
    mover.scatter(0, [2], [0], corrupt=True)
    assert not torch.equal(caches["attn"][2], want)
    mover.scatter(0, [2], [0])
    assert torch.equal(caches["attn"][2], want)


def test_descriptor_tells_layouts_apart() -> None:
    """The descriptor is part of each rank's storage namespace (vllm_connector.namespace)."""
    caches = _caches()
    cpu = build_layout(caches, [(0, "attention", 8, ["attn"])], NB).descriptor()
    again = build_layout(_caches(), [(0, "attention", 8, ["attn"])], NB).descriptor()
    cuda = build_layout(caches, [(0, "attention", 8, ["kv2"])], NB).descriptor()
    half = build_layout({"attn": caches["attn"].half()}, [(0, "attention", 8, ["attn"])],
                        NB).descriptor()
    assert cpu == again
    assert len({cpu, cuda, half}) == 3
    assert "@0" in cpu and "@1" in cuda and "float16" in half


def test_a_layer_missing_or_no_tensors_is_an_error() -> None:
    with pytest.raises(LayoutError, match="no KV tensor"):
        build_layout(_caches(), [(0, "attention", 8, ["nope"])], NB)
    with pytest.raises(LayoutError, match="no KV tensors"):
        build_layout({}, [(0, "attention", 8, [])], NB)
