"""vLLM is a test dependency of the daemon's wire tests: a failed import fails loudly.

``pytest.importorskip`` at module level would turn a broken vLLM install into a handful of
skipped reliability rows and a green run; :func:`import_vllm` makes it a collection error
that names the module and the fix (as ``tests/audit/test_vllm_tree.py`` does).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

__all__ = ["import_vllm"]


def import_vllm(name: str) -> ModuleType:
    """Import ``name`` (a vLLM module) or fail the test run with the reason."""
    try:
        return importlib.import_module(name)
    except Exception as exc:  # ImportError, or vLLM's own import-time errors
        pytest.fail(f"{name} does not import ({type(exc).__name__}: {exc}); vLLM is a test "
                    "dependency of tests/daemon: run scripts/bootstrap.sh", pytrace=False)
