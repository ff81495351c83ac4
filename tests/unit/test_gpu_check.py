"""benchmarks/gpu_check.py (the script a lent GPU runs) on the CPU: byte-exact, and able to fail."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import gpu_check
from connector.vllm_connector.layout import build_layout
from connector.vllm_connector.transfer import BlockTransfer, slot_runs
from offload_tiers.cpu_tier import allocate_slab


def test_every_layout_round_trips_byte_exact_and_reports_ratios(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--device", "cpu", "--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["byte_exact"] is True
    assert {c["layout"] for c in report["cases"]} == {
        "flash_attn", "flash_attn_block_first", "flashinfer_nhd", "flashinfer_hnd", "mla",
        "mla_fp8", "mamba_page"}
    for case in report["cases"]:
        assert case["gather_byte_exact"] and case["scatter_byte_exact"], case
        assert case["other_blocks_untouched"] and case["segment_scatter_byte_exact"], case
        assert case["segment_gather_byte_exact"], case
        # nothing to page-lock on the CPU (what a registration gives: the test below)
        assert case["segment_page_locked"] is False
    assert report["ratios"]["gather_vs_copy"] > 0 and report["ratios"]["scatter_vs_copy"] > 0
    assert report["ratios"]["segment_scatter_vs_copy"] > 0
    assert report["ratios"]["segment_gather_vs_copy"] > 0


class _FakePins:
    """A registration that succeeds and, like ``HostRegistration``, is ``ok`` no more once
    closed: the report must say what held while the checks ran."""

    def __init__(self, array: Any) -> None:
        self.ok, self.why, self.closed = True, "", False

    def close(self) -> None:
        self.ok, self.closed = False, True


def test_page_locked_is_what_held_during_the_checks(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    """Each layout's case records ``segment_page_locked`` as registered while it gathered
    and scattered, not as read after the registration was closed (always False)."""
    made: list[_FakePins] = []

    def pins(array: Any) -> _FakePins:
        made.append(_FakePins(array))
        return made[-1]

    monkeypatch.setattr(gpu_check, "HostRegistration", pins)
    monkeypatch.setattr(gpu_check, "caches_device", lambda caches: "cuda")
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--device", "cpu", "--quick", "--json", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) == 7 and len(made) >= 7 and all(p.closed for p in made)
    assert all(c["segment_page_locked"] is True for c in cases), cases


class _CorruptingTransfer(BlockTransfer):
    def scatter(self, group: int, block_ids: list[int], slots: list[int], *,
                corrupt: bool = False, **kwargs: Any) -> int:
        return super().scatter(group, block_ids, slots, corrupt=True, **kwargs)


def test_a_wrong_byte_fails_the_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Negative control: loads that write noise make the script say DIFFER and exit 1."""
    monkeypatch.setattr(gpu_check, "BlockTransfer", _CorruptingTransfer)
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--device", "cpu", "--quick", "--json", str(out)]) == 1
    cases: list[dict[str, Any]] = json.loads(out.read_text())["cases"]
    floats = [c for c in cases if c["layout"] != "mla_fp8"]  # uint8 KV is not float noise
    assert all(not c["scatter_byte_exact"] for c in floats)
    assert all(not c["segment_scatter_byte_exact"] for c in floats)
    assert all(c["gather_byte_exact"] for c in cases)


def test_slot_runs_group_consecutive_slots() -> None:
    assert slot_runs([4, 5, 6, 9, 2, 3]) == [(0, 4, 3), (3, 9, 1), (4, 2, 2)]
    assert slot_runs([]) == []


@pytest.mark.parametrize("name", ["flash_attn", "flash_attn_block_first", "flashinfer_nhd",
                                  "flashinfer_hnd", "mla", "mla_fp8", "mamba_page"])
def test_packing_straight_into_columns_equals_the_select_then_copy(name: str) -> None:
    """The CUDA path's packing (each tensor's blocks selected straight into their columns
    of the packed buffer) gives the bytes the plain select-reorder-copy gives, in every
    layout (here on CPU tensors; gpu_check runs it on CUDA)."""
    gen = torch.Generator().manual_seed(1)
    if name == "mamba_page":
        caches, dims = gpu_check._mamba(2, 12, "cpu", gen)
        kind = "mamba"
    else:
        caches, dims = gpu_check._attention(name, 2, 12, 16, 4, 64, "cpu", gen)
        kind = "attention"
    layout = build_layout(caches, [(0, kind, 16, sorted(caches))], 12, dims)
    slab, owner = allocate_slab(4, layout.slot_bytes)
    mover = BlockTransfer(caches, layout, slab)
    group = mover.group(0)
    ids = torch.tensor([7, 2, 3, 11])
    direct = torch.zeros((4, group.nbytes), dtype=torch.uint8)
    plain = torch.zeros_like(direct)
    for s in group.slices:
        mover._read_into(s, ids, direct)
        plain[:, s.offset:s.offset + s.nbytes] = mover._read(s, ids, 4)
    assert torch.equal(direct, plain)
    del owner
