"""Loaded by every Python process a test starts (``tests/conftest.py`` puts this directory
on ``PYTHONPATH``): vLLM's queue readers there go idle after 20 ms, not 1 s
(``tests/support/idle_wait.py``, loaded by its path: nothing else is imported, and vLLM's
module is patched only when the process imports it). ``KVTIER_TEST_VLLM_SPIN=1`` keeps
vLLM's spin (the spawned engines ``tests/e2e/test_fast_start.py`` compares with)."""

import importlib.util
import os
from pathlib import Path

if os.environ.get("KVTIER_TEST_VLLM_SPIN") != "1":
    _spec = importlib.util.spec_from_file_location(
        "_kvtier_test_idle_wait", Path(__file__).resolve().parent.parent / "idle_wait.py")
    assert _spec is not None and _spec.loader is not None
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
