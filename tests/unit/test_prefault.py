"""Prefaulting a slab: every page resident afterwards (mincore), not one byte changed, and
the CPU tier's pageable slab gets it from its allocation on."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import numpy as np
import pytest

from offload_tiers import cpu_tier
from offload_tiers.prefault import populate, populate_in_background

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident_pages(buf: np.ndarray) -> tuple[int, int]:
    """(resident, whole) pages of ``buf``'s whole pages (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = -(-buf.ctypes.data // PAGE) * PAGE
    pages = (buf.ctypes.data + buf.nbytes - start) // PAGE
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, pages * PAGE, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec.raw), pages


def test_populate_faults_every_page_in_and_changes_no_byte() -> None:
    mm = mmap.mmap(-1, 64 * PAGE)  # fresh anonymous memory: no page resident yet
    buf = np.frombuffer(mm, dtype=np.uint8)
    buf[5 * PAGE:5 * PAGE + 3] = (7, 8, 9)  # one page written before: it must survive
    assert _resident_pages(buf) == (1, 64)
    if not populate(buf, chunk_bytes=16 * PAGE):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert _resident_pages(buf) == (64, 64)
    assert buf[5 * PAGE:5 * PAGE + 3].tolist() == [7, 8, 9]
    assert not buf[:5 * PAGE].any() and not buf[5 * PAGE + 3:].any()
    del buf
    mm.close()


def test_the_background_thread_faults_the_buffer_in() -> None:
    mm = mmap.mmap(-1, 32 * PAGE)
    buf = np.frombuffer(mm, dtype=np.uint8)
    thread = populate_in_background(buf)
    assert thread.daemon and thread.name == "kvtier-prefault"
    thread.join()
    resident, pages = _resident_pages(buf)
    if resident < pages and not populate(buf):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert resident == pages == 32
    del buf
    mm.close()


def test_a_pageable_slab_is_handed_to_the_background_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    handed: list[np.ndarray] = []
    monkeypatch.setattr(cpu_tier, "populate_in_background", handed.append)
    slab, owner = cpu_tier.allocate_slab(4, 1 << 20, pin=False)
    assert owner is None and len(handed) == 1 and handed[0] is slab
