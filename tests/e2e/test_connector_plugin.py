"""The installed entry point registers the connector; bad settings fail at engine start."""

from __future__ import annotations

from typing import Any

import pytest

from connector.demo.tiny_models import prompt_words
from tests.support.connector_runner import run_in_subprocess

pytestmark = pytest.mark.e2e


def test_loads_by_name_without_module_path(tiny_llama_dir: Any) -> None:
    prompt = prompt_words(31, 80)
    result = run_in_subprocess({
        "model": "llama", "extra": {"cpu_bytes": 16 << 20}, "no_module_path": True,
        "steps": [["generate", "a", prompt], ["reset"], ["generate", "b", prompt + " w1"]]})
    a, b = result["outputs"]
    assert b["delta"].get("hit_tokens_cpu", 0) == 64


def test_bad_setting_fails_at_start_naming_key_and_fix(tiny_llama_dir: Any) -> None:
    with pytest.raises(RuntimeError) as err:
        run_in_subprocess({"model": "llama", "extra": {"cpu_bytes": 16 << 20, "write_mode": "x"},
                           "steps": []})
    assert "write_mode" in str(err.value) and "Fix:" in str(err.value)
