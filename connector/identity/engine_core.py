"""vLLM's weight version, read from the engine core that built this connector.

vLLM 0.32 keeps the version a user names (``LLM.update_weight_version``,
``finish_weight_update(weight_version=...)``, the server's ``/update_weight_version``) on its
``EngineCore`` object, in the process where the scheduler and the connector's scheduler half
run. The connector is built inside ``EngineCore.__init__``, so the engine core is found once on
the call stack; afterwards reading the version is one attribute read (no IPC, no lock).
Where it cannot be found, the version is ``None`` and every reset draws a nonce.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

_ATTR = "_weight_version"


class WeightVersionSource:
    """Reads the weight version of the engine core found on the stack at construction."""

    def __init__(self, max_depth: int = 64) -> None:
        self._core: weakref.ReferenceType[Any] | None = None
        frame = sys._getframe(1)
        for _ in range(max_depth):
            if frame is None:
                break
            owner = frame.f_locals.get("self")
            if owner is not None and isinstance(getattr(owner, _ATTR, None), str) \
                    and any(c.__name__ == "EngineCore" for c in type(owner).__mro__):
                self._core = weakref.ref(owner)
                break
            frame = frame.f_back

    @property
    def found(self) -> bool:
        return self._core is not None

    def read(self) -> str | None:
        core = self._core() if self._core is not None else None
        value = getattr(core, _ATTR, None) if core is not None else None
        return value if isinstance(value, str) else None
