"""``kvtier demo --reference DIR``: an earlier run's vLLM-alone pass is reused only when
everything its outputs depend on is the same (pure logic: files, no engine)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from connector.demo.reference import LABEL, fingerprinted, load_reference


def _earlier_run(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    spec = fingerprinted({"label": LABEL, "model": "llama", "model_dir": str(model),
                          "workload": {"conversations": 3}, "kv_transfer_config": None,
                          "phases": [{"name": "cold"}, {"name": "reset"}]})
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / f"{LABEL}.spec.json").write_text(json.dumps(spec))
    (logs / f"{LABEL}.out.json").write_text(json.dumps(
        {"label": LABEL, "startup_s": 1.0, "phases": [{"name": "cold"}, {"name": "reset"}]}))
    return logs, spec


def test_same_model_release_and_workload_is_reused(tmp_path: Path) -> None:
    logs, spec = _earlier_run(tmp_path)
    outputs, reason = load_reference(logs, spec)
    assert outputs is not None and outputs["label"] == LABEL
    assert reason == f"reused from {logs}"


def test_another_workload_or_rebuilt_model_is_recomputed(tmp_path: Path) -> None:
    logs, spec = _earlier_run(tmp_path)
    other = {**spec, "workload": {"conversations": 4}}
    assert load_reference(logs, other) == (
        None, f"the reference in {logs} differs from this run in workload")
    weights = Path(spec["model_dir"]) / "model.safetensors"
    os.utime(weights, ns=(1, 1))  # the model was rebuilt: another mtime
    outputs, reason = load_reference(logs, fingerprinted({**spec, "fingerprint": None}))
    assert outputs is None and reason.endswith("differs from this run in fingerprint")


def test_missing_or_incomplete_reference_is_recomputed(tmp_path: Path) -> None:
    logs, spec = _earlier_run(tmp_path)
    (logs / f"{LABEL}.out.json").write_text(json.dumps({"label": LABEL, "phases": []}))
    outputs, reason = load_reference(logs, spec)
    assert outputs is None and "not a complete" in reason
    outputs, reason = load_reference(tmp_path / "nowhere", spec)
    assert outputs is None and reason.startswith("no reusable reference in")
