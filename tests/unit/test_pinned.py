"""Page-locking the host tier's segment for CUDA: on a machine without CUDA, nothing is
registered, every caller is told why, and loads from the segment take the plain path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from connector.vllm_connector.pinned import HostRegistration, PinnedMapping
from offload_tiers.shared_segment import SharedSegment


def test_without_cuda_nothing_is_registered_and_the_reason_is_given(tmp_path: Path) -> None:
    with SharedSegment.create(str(tmp_path / "seg"), 2, 128) as segment:
        memory = segment.memory()
        assert memory.nbytes == segment.size
        registration = HostRegistration(memory)
        assert registration.ok is False
        assert registration.why == "no CUDA device"
        registration.close()
        registration.close()  # idempotent


def test_a_disabled_mapping_never_registers(tmp_path: Path) -> None:
    pins = PinnedMapping(enabled=False)
    with SharedSegment.create(str(tmp_path / "seg"), 2, 128) as segment:
        assert pins.pinned(segment) is False
    pins.close()


def test_a_new_segment_replaces_the_registered_one(tmp_path: Path) -> None:
    """Enabled (as on CUDA) but here without a device: each new owner gets a registration
    of its own and the old one is dropped (it no longer holds the old mapping)."""
    pins = PinnedMapping(enabled=True)
    first = SharedSegment.create(str(tmp_path / "a"), 2, 128)
    second = SharedSegment.create(str(tmp_path / "b"), 2, 128)
    assert pins.pinned(first) is torch.cuda.is_available()
    held = pins._registration
    assert pins.pinned(second) is torch.cuda.is_available()
    assert pins._registration is not held and held is not None and held._array is None
    pins.close()
    first.close()
    second.close()
    assert first.closed and second.closed


def test_memory_is_the_whole_mapping_and_payloads_lie_inside_it(tmp_path: Path) -> None:
    with SharedSegment.create(str(tmp_path / "seg"), 3, 100) as segment:
        memory = segment.memory()
        segment.write(2, b"k" * 16, 7, b"x" * 100)
        start = segment.payload_offset(2)
        assert bytes(memory[start:start + 100]) == b"x" * 100
        assert segment.payloads.ctypes.data == memory.ctypes.data + segment.payload_offset(0)
        assert np.shares_memory(memory, segment.payloads)
