"""Layouts (declared by vLLM, else read from strides), and gather/scatter round trips on CPU."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from connector.vllm_connector.declared_layout import declared_block_dims, manager_block_views
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


@pytest.mark.parametrize("block_ids,slots", [
    ([3, 5, 0], [2, 0, 3]),  # scattered: one fancy-indexed copy per tensor
    ([0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]),  # one run of both: one copy per tensor
])
def test_slot_bytes_are_the_stored_format_on_every_path(block_ids: list[int],
                                                        slots: list[int]) -> None:
    """The CPU path's slot bytes are exactly each tensor's blocks, block dim first, in C
    order (the format the CUDA path, Redis values and other engines' slots share), and
    scatter puts them back; bf16 (no NumPy dtype) included."""
    caches = _caches()
    caches["bf16"] = torch.randn(2, NB, 8, 4).to(torch.bfloat16)
    layout = build_layout(caches, [(0, "mamba", 8, ["mamba"]), (1, "attention", 8, ["attn"]),
                                   (2, "attention", 8, ["kv2", "bf16"])], NB)
    slab = np.zeros((8, layout.slot_bytes), dtype=np.uint8)
    mover = BlockTransfer(caches, layout, slab)
    ids = torch.tensor(block_ids)
    for group in layout.groups:
        mover.gather(group.group, block_ids, slots)
        for sl in group.slices:
            want = caches[sl.layer].index_select(sl.block_dim, ids).movedim(
                sl.block_dim, 0).contiguous().view(torch.uint8).reshape(len(ids), sl.nbytes)
            got = torch.from_numpy(slab[slots, sl.offset:sl.offset + sl.nbytes])
            assert torch.equal(got, want), (sl.layer, group.group)
    before = {name: t.clone() for name, t in caches.items()}
    for name in ("kv2", "bf16"):
        caches[name].zero_()
    mover.scatter(2, block_ids, slots)
    others = torch.tensor([b for b in range(NB) if b not in block_ids])
    for name in ("kv2", "bf16"):
        assert torch.equal(caches[name].index_select(1, ids), before[name].index_select(1, ids))
        assert not caches[name].index_select(1, others).any()  # nothing else written


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


# ---------------------------------------------------------------- num_blocks equal to another dim
# vLLM may size num_blocks to anything (num_gpu_blocks_override): equal to the block size, a
# head count, a head size, 2. Each case: (tensor factory, num_blocks, true block dim, declared).

def _cpu(nb: int, heads: int, bs: int, width: int) -> Any:
    return lambda: torch.randn(nb, heads, bs, width)  # [num_blocks, kv_heads, bs, 2*head_dim]


def _cuda_contiguous(nb: int) -> Any:
    return lambda: torch.randn(2, nb, 8, 2, 4)  # [2, num_blocks, block_size, heads, head_dim]


def _cuda_hnd(nb: int) -> Any:
    # Legacy FlashAttention HND stride order (0, 1, 3, 2, 4): memory [2, nb, heads, bs, dim],
    # handed over permuted back to the logical [2, nb, bs, heads, dim].
    return lambda: torch.randn(2, nb, 2, 8, 4).permute(0, 1, 3, 2, 4)


def _cuda_cross_layer(nb: int) -> Any:
    # Legacy cross-layer stride order: memory [nb, layers, 2, bs, heads, dim], block outermost;
    # layer 1's view is the logical [2, nb, bs, heads, dim].
    return lambda: torch.randn(nb, 3, 2, 8, 2, 4)[:, 1].movedim(1, 0)


def _lhbnc(nb: int) -> Any:
    # vLLM 0.32 LHBNC: the [B, H, N, C] view of a layer whose heads are outside the blocks.
    return lambda: torch.randn(nb, nb, 8, 16).movedim(0, 1)


CASES = {
    "cpu num_blocks == block_size": (_cpu(8, 2, 8, 16), 8, 0, None),
    "cpu num_blocks == block_size, declared": (_cpu(8, 2, 8, 16), 8, 0, [0]),
    "cpu num_blocks == kv_heads": (_cpu(4, 4, 8, 16), 4, 0, None),
    "cpu num_blocks == 2*head_size": (_cpu(16, 2, 8, 16), 16, 0, None),
    "cpu num_blocks == all of them": (_cpu(8, 8, 8, 8), 8, 0, [0]),
    "cuda [2, 2, ...] contiguous, declared": (_cuda_contiguous(2), 2, 1, [1]),
    "cuda [2, 2, ...] HND, declared": (_cuda_hnd(2), 2, 1, [1]),
    "cuda [2, 8, 8, ...] HND": (_cuda_hnd(8), 8, 1, None),
    "cuda [2, 2, ...] cross-layer": (_cuda_cross_layer(2), 2, 1, None),
    "cuda [2, 2, ...] cross-layer, declared": (_cuda_cross_layer(2), 2, 1, [1]),
    "vllm LHBNC num_blocks == kv_heads, declared": (_lhbnc(4), 4, 0, [0]),
}


def _blocks(tensor: torch.Tensor, dim: int, ids: list[int]) -> list[torch.Tensor]:
    return [tensor.select(dim, b).clone() for b in ids]


def _assert_round_trip(caches: dict[str, Any], layers: list[str], nb: int,
                       truth: dict[tuple[str, int], int],
                       declared: dict[str, list[int]] | None) -> None:
    """Gather two blocks of every layer, scatter them into two others: byte-exact there,
    every other block of every tensor untouched. ``truth``: (layer, index) -> block dim."""
    layout = build_layout(caches, [(0, "attention", 8, layers)], nb, declared)
    assert {(s.layer, s.index): s.block_dim for s in layout.groups[0].slices} == truth
    tensors = {key: caches[key[0]] if isinstance(caches[key[0]], torch.Tensor)
               else caches[key[0]][key[1]] for key in truth}
    src, dst = [nb - 1, 0], [1, nb - 1] if nb > 2 else [0, 1]  # nb == 2: a swap
    want = {key: _blocks(t, truth[key], src) for key, t in tensors.items()}
    mover = BlockTransfer(caches, layout, np.zeros((2, layout.slot_bytes), dtype=np.uint8))
    mover.gather(0, src, [0, 1])
    for t in tensors.values():
        t.zero_()
    mover.scatter(0, dst, [0, 1])
    for key, t in tensors.items():
        got = _blocks(t, truth[key], list(range(nb)))
        for b in range(nb):
            expect = want[key][dst.index(b)] if b in dst else torch.zeros_like(got[b])
            assert torch.equal(got[b].view(torch.uint8), expect.view(torch.uint8)), (key, b)


@pytest.mark.parametrize("case", list(CASES))
def test_num_blocks_equal_to_another_dim_round_trips(case: str) -> None:
    make, nb, dim, declared = CASES[case]
    torch.manual_seed(1)
    caches = {"layer": make()}
    assert list(caches["layer"].shape).count(nb) > 1  # really ambiguous by size
    _assert_round_trip(caches, ["layer"], nb, {("layer", 0): dim},
                       None if declared is None else {"layer": declared})


def _page_pool(nb: int, page: int) -> torch.Tensor:
    torch.manual_seed(2)
    return torch.randint(-128, 128, (nb * page,), dtype=torch.int8)


@pytest.mark.parametrize("declared", [False, True])
def test_mamba_page_view_with_num_blocks_equal_to_page_bytes(declared: bool) -> None:
    """Hybrid pool: attention and an int8 Mamba view ``[nb, 1, 1, page_bytes]`` over the same
    pages, with num_blocks == page_bytes == 64 (and attention's block size 4 == heads)."""
    nb = page = 64
    pool = _page_pool(nb, page)
    attn = pool.view(torch.float32).view(nb, 4, 4, 1)
    mamba = torch.as_strided(pool, (nb, 1, 1, page), (page, page, page, 1))
    dims = {"attn": [0], "mamba": [0]} if declared else None
    _assert_round_trip({"mamba": mamba}, ["mamba"], nb, {("mamba", 0): 0}, dims)
    _assert_round_trip({"attn": attn}, ["attn"], nb, {("attn", 0): 0}, dims)


@pytest.mark.parametrize("declared", [False, True])
def test_legacy_mamba_state_list_with_num_blocks_equal_to_a_state_dim(declared: bool) -> None:
    """Legacy CUDA Mamba: a list [conv, ssm] of views over one page per block; conv's last
    dimension has the size of num_blocks."""
    nb, page = 4, 64
    pool = _page_pool(nb, page).view(torch.float32)  # 16 floats a page
    conv = torch.as_strided(pool, (nb, 2, nb), (16, nb, 1))
    ssm = torch.as_strided(pool, (nb, 2, 3), (16, 3, 1), storage_offset=8)
    caches = {"mamba": [conv, ssm]}
    _assert_round_trip(caches, ["mamba"], nb, {("mamba", 0): 0, ("mamba", 1): 0},
                       {"mamba": [0, 0]} if declared else None)


def test_declared_dims_are_checked_against_the_tensor() -> None:
    caches = {"layer": torch.randn(8, 2, 8, 16)}
    with pytest.raises(LayoutError, match=r"declares block dimension 1.*size 2, not num_blocks"):
        build_layout(caches, [(0, "attention", 8, ["layer"])], 8, {"layer": [1]})
    with pytest.raises(LayoutError, match="declares block dimension 4"):
        build_layout(caches, [(0, "attention", 8, ["layer"])], 8, {"layer": [4]})
    with pytest.raises(LayoutError, match=r"declares 2 block dimension\(s\)"):
        build_layout(caches, [(0, "attention", 8, ["layer"])], 8, {"layer": [0, 0]})
    # A layer the declaration leaves out follows the stride rule.
    layout = build_layout(caches, [(0, "attention", 8, ["layer"])], 8, {"other": [3]})
    assert layout.groups[0].slices[0].block_dim == 0


def test_undeclared_candidates_with_equal_strides_are_an_error() -> None:
    same = torch.randn(8, 1, 16).expand(8, 8, 16)  # dims 0 and 1: size 8, stride 16 and 0
    assert find_block_dim(tuple(same.shape), 8, "x", tuple(same.stride())) == 0
    tie = torch.as_strided(torch.randn(64), (8, 8), (1, 1))
    with pytest.raises(LayoutError, match="none is outermost.*num_gpu_blocks_override"):
        find_block_dim(tuple(tie.shape), 8, "x", tuple(tie.stride()))
    with pytest.raises(LayoutError, match="no dimension.*declared none"):
        build_layout({"l": torch.randn(3, 4)}, [(0, "attention", 8, ["l"])], 8)
    assert find_block_dim((1, 1, 1, 300), 1, "one block", (300, 300, 300, 1)) == 0


# ---------------------------------------------------------------- what vLLM declares


def _config(groups: list[tuple[Any, list[str]]], forward: dict[str, Any] | None = None,
            num_blocks: int = 8) -> tuple[Any, Any]:
    vllm_config = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=forward or {}),
        cache_config=SimpleNamespace(cache_dtype="auto"))
    kv_cache_config = SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=spec, layer_names=names) for spec, names in groups])
    return vllm_config, kv_cache_config


class _FlashLike:
    """A legacy backend: declares ``[2, num_blocks, block_size, heads, head_size]``."""

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)


class _OldSignature:
    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads * head_size)


class _Refuses:
    @staticmethod
    def get_kv_cache_shape(*args: Any, **kwargs: Any) -> tuple[int, ...]:
        raise ValueError("num_blocks too large")


def test_declared_block_dims_reads_every_kind_of_declaration() -> None:
    attn = SimpleNamespace(block_size=8, num_kv_heads=2, head_size=4)
    views = SimpleNamespace(block_size=8, has_layer_views=True)
    raw = SimpleNamespace(block_size=8, has_layer_views=False)
    mamba = SimpleNamespace(block_size=8, shapes=((2, 8), (3,)))
    uniform = SimpleNamespace(block_size=8, kv_cache_specs={"u": views})
    forward = {"flash": SimpleNamespace(get_attn_backend=lambda: _FlashLike),
               "old": SimpleNamespace(attn_backend=_OldSignature),
               "refuses": SimpleNamespace(attn_backend=_Refuses),
               "rank": SimpleNamespace(attn_backend=_FlashLike)}
    vllm_config, kv_cache_config = _config(
        [(views, ["v"]), (raw, ["r"]), (mamba, ["m", "m_bad"]), (uniform, ["u"]),
         (attn, ["flash", "old", "refuses", "rank", "no_module"])], forward)
    caches = {"v": torch.zeros(8, 8, 8, 8), "r": torch.zeros(100, dtype=torch.int8),
              "m": [torch.zeros(8, 2, 8), torch.zeros(8, 3)], "m_bad": [torch.zeros(8, 2, 8)],
              "u": torch.zeros(8, 1), "flash": torch.zeros(2, 8, 8, 2, 4),
              "old": torch.zeros(8, 8, 8), "refuses": torch.zeros(8, 8, 8),
              "rank": torch.zeros(8, 8, 8), "no_module": torch.zeros(8, 8, 8)}
    assert declared_block_dims(vllm_config, kv_cache_config, caches) == {
        "v": [0], "m": [0, 0], "u": [0], "flash": [1], "old": [0]}


def test_kernel_block_views_are_regrouped_into_manager_blocks() -> None:
    """vLLM 0.32 kernel-block splitting: dim 0 counts 2 kernel blocks per manager block."""
    nb = 4
    spec = SimpleNamespace(block_size=64, has_layer_views=True)
    vllm_config, kv_cache_config = _config([(spec, ["split", "plain"])], num_blocks=nb)
    torch.manual_seed(3)
    caches = {"split": torch.randn(nb * 2, 2, 32, 8), "plain": torch.randn(nb, 2, 32, 8)}
    views = manager_block_views(kv_cache_config, caches)
    assert views["plain"] is caches["plain"]
    assert views["split"].shape == (nb, 2, 2, 32, 8)
    assert views["split"].data_ptr() == caches["split"].data_ptr()
    dims = declared_block_dims(vllm_config, kv_cache_config, views)
    with pytest.raises(LayoutError, match="manager_block_views"):
        build_layout(caches, [(0, "attention", 64, ["split"])], nb, dims)
    _assert_round_trip({"split": views["split"]}, ["split"], nb, {("split", 0): 0}, dims)
    # Manager block 1 is kernel blocks 2 and 3 of the tensor vLLM's kernels read.
    assert torch.equal(caches["split"][2:4], views["split"][1])


def test_vllm_views_declare_block_dim_zero_in_every_layout() -> None:
    """Against vLLM's own allocator: every KVCacheLayout, num_blocks == block_size == heads,
    and a Mamba page view with num_blocks == page bytes. Block b of layer l starts at
    ``l * layer_stride + b * block_stride`` (allocate_kv_cache's contract)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        MambaSpec,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    nb = 4
    attn = FullAttentionSpec(block_size=nb, num_kv_heads=nb, head_size=8, dtype=torch.float32)
    mamba = MambaSpec(block_size=nb, shapes=((4,),), dtypes=(torch.float32,))
    cases = [(attn, nb, layout) for layout in KVCacheLayout]
    cases.append((mamba, mamba.page_size_bytes, KVCacheLayout.LBHNC))
    for spec, blocks, layout in cases:
        page = spec.page_size_bytes
        outer = 2 * page if layout.is_block_outermost else None
        layer_stride, block_stride, *_ = compute_layout_strides(
            spec, blocks, 2, layout, fixed_strides=(None, outer, None, None, None))
        torch.manual_seed(4)
        raw = torch.randint(-128, 128, (2 * blocks * page,), dtype=torch.int8)
        views = create_kv_cache_views(raw, spec, blocks, layout, KVCacheTensor(
            size=raw.numel(), layers=["a", "b"], layer_stride=layer_stride,
            block_stride=block_stride))
        caches = dict(zip(["a", "b"], views, strict=True))
        assert list(views[0].shape).count(blocks) > 1, layout
        for layer, view in enumerate(views):
            for b in range(blocks):
                start = view[b].data_ptr() - raw.data_ptr()
                assert start == layer * layer_stride + b * block_stride, (layout, layer, b)
        vllm_config, kv_cache_config = _config([(spec, ["a", "b"])], num_blocks=blocks)
        dims = declared_block_dims(vllm_config, kv_cache_config, caches)
        assert dims == {"a": [0], "b": [0]}
        _assert_round_trip(caches, ["a", "b"], blocks, {("a", 0): 0, ("b", 0): 0}, dims)
