"""Page-locking memory kvtier did not allocate (the host tier's shared segment) for CUDA.

A CUDA copy from pageable host memory is staged by the driver through its own pinned
buffer, synchronously; from page-locked memory it is one DMA, asynchronous. torch pins
what it allocates (``pin_memory=True``); a mapping of a shared-memory file has to be
registered with ``cudaHostRegister`` instead, and unregistered before it is unmapped.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


class HostRegistration:
    """``nbytes`` at ``array``'s address, registered as page-locked (``ok``) or not
    (``why`` says why). Holds ``array`` so the memory stays mapped while registered."""

    def __init__(self, array: np.ndarray) -> None:
        self._array: np.ndarray | None = array
        self.address = int(array.ctypes.data)
        self.nbytes = int(array.nbytes)
        self.ok = False
        self.why = ""
        try:
            import torch

            if not torch.cuda.is_available():
                self.why = "no CUDA device"
                return
            err = torch.cuda.cudart().cudaHostRegister(self.address, self.nbytes, 0)
        except Exception as exc:  # a torch without the binding: copies stay staged
            self.why = f"cudaHostRegister unavailable ({exc})"
            return
        if int(err) != 0:
            self.why = f"cudaHostRegister failed ({err})"
            return
        self.ok = True

    def close(self) -> None:
        """Unregister (idempotent); then the memory may be unmapped."""
        if self._array is None:
            return
        if self.ok:
            import torch

            torch.cuda.synchronize()  # no copy from or to it is still in flight
            err = torch.cuda.cudart().cudaHostUnregister(self.address)
            if int(err) != 0:
                log.warning("kvtier: cudaHostUnregister of %d bytes failed (%s)", self.nbytes,
                            err)
        self.ok = False
        self._array = None


class PinnedMapping:
    """Keeps one mapping (the host tier's current segment) registered: a new one replaces
    the old, which is unregistered first. ``pinned(segment)`` is cheap after the first
    call for the same segment (and free when disabled: off CUDA)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._owner: object | None = None
        self._registration: HostRegistration | None = None

    def pinned(self, segment: Any) -> bool:
        """Whether ``segment``'s whole mapping (``segment.memory()``) is page-locked now;
        registers it on first sight of ``segment`` (only when enabled: on CUDA)."""
        if not self.enabled:
            return False
        if segment is not self._owner:
            self.close()
            self._owner = segment
            self._registration = HostRegistration(segment.memory())
            if self._registration.ok:
                log.info("kvtier: host-tier segment page-locked for CUDA (%d bytes)",
                         self._registration.nbytes)
            else:
                log.warning("kvtier: host-tier segment not page-locked (%s); loads from it "
                            "are staged", self._registration.why)
        assert self._registration is not None
        return self._registration.ok

    def close(self) -> None:
        if self._registration is not None:
            self._registration.close()
        self._owner = None
        self._registration = None
