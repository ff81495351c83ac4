"""Fault a host buffer's pages in ahead of use, without touching its bytes.

A fresh anonymous mapping costs a page fault, and the kernel's zeroing of the page, on the
first write to each 4 KiB page. A CPU tier's slab is written slot by slot as saves arrive,
so until every slot was used once, every save paid those faults inside vLLM's step.

``MADV_POPULATE_WRITE`` (Linux 5.14+) faults the range in as a write would, but writes
nothing: bytes already there stay as they are, so it may run on a thread of its own while
the buffer is in use. Elsewhere (another OS, an older kernel) nothing is done and pages
fault in on first use, as before.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading

import numpy as np

log = logging.getLogger(__name__)

#: ``madvise`` advice (linux/mman.h); Python's ``mmap`` module names it only from 3.13 on.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
#: Bytes faulted in per call: the thread gives the GIL and the CPU back between calls.
CHUNK_BYTES = 32 << 20


def _madvise() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def populate(buffer: np.ndarray, chunk_bytes: int = CHUNK_BYTES) -> bool:
    """Fault every whole page of ``buffer`` in (contents unchanged); False when the system
    cannot (then nothing was done beyond the chunks that succeeded)."""
    madvise = _madvise()
    if madvise is None or buffer.nbytes == 0:
        return False
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-buffer.ctypes.data // page) * page
    end = (buffer.ctypes.data + buffer.nbytes) // page * page
    while start < end:
        n = min(chunk_bytes, end - start)
        if madvise(start, n, MADV_POPULATE_WRITE) != 0:  # ctypes drops the GIL meanwhile
            log.debug("kvtier: MADV_POPULATE_WRITE refused (%s); pages fault in on use",
                      os.strerror(ctypes.get_errno()))
            return False
        start += n
    return True


def populate_in_background(buffer: np.ndarray, name: str = "kvtier-prefault"
                           ) -> threading.Thread:
    """:func:`populate` on a daemon thread of its own (it keeps ``buffer`` alive until done);
    the started thread."""
    thread = threading.Thread(target=populate, args=(buffer,), name=name, daemon=True)
    thread.start()
    return thread
