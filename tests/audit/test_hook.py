"""The pre-commit hook runs the audit light: nothing installed, nothing heavy imported."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("numpy", "redis", "zmq", "aiohttp", "pydantic", "msgspec", "vllm", "torch",
         "connector", "offload_tiers", "prometheus_client", "xxhash", "yaml")
BAD = textwrap.dedent("""
    def count(blocks: list[KVCacheBlock]) -> int:
        return sum(1 for b in blocks if b.block_hash is not None)
""")


def _imported(stderr: str) -> set[str]:
    """Top-level module names from ``-X importtime`` lines."""
    names = set()
    for line in stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+\d+ \|\s*(\S+)", line)
        if m:
            names.add(m.group(1).split(".")[0])
    return names


def _hook() -> dict[str, object]:
    hooks = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text(encoding="utf-8"))
    return next(h for h in hooks if h["id"] == "kvtier-audit")


def test_hook_is_a_script_not_an_installed_package() -> None:
    """``language: python`` makes pre-commit ``pip install .`` kvtier and all its runtime
    dependencies; the hook is a script run from the hook repository's checkout."""
    hook = _hook()
    assert hook["language"] == "script" and not hook.get("additional_dependencies")
    script = REPO / str(hook["entry"])
    assert script.is_file() and os.access(script, os.X_OK)
    assert script.read_text(encoding="utf-8").startswith("#!/usr/bin/env python3\n")
    mode = subprocess.run(["git", "ls-files", "-s", str(hook["entry"])], cwd=REPO,
                          capture_output=True, text=True, check=True).stdout
    assert mode.startswith("100755 "), mode  # executable in a clone, not only here


def test_hook_script_audits_and_imports_nothing_heavy(tmp_path: Path) -> None:
    """Run as pre-commit runs it (from another repository, files as arguments), with
    site-packages present: the heavy dependencies are installed here, yet none is imported."""
    (tmp_path / "bad.py").write_text(BAD, encoding="utf-8")
    (tmp_path / "ok.py").write_text("x = 1\n", encoding="utf-8")
    script = REPO / str(_hook()["entry"])
    proc = subprocess.run([sys.executable, "-X", "importtime", str(script), "bad.py", "ok.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stdout.startswith("bad.py:3:") and "KVT001" in proc.stdout
    imported = _imported(proc.stderr)
    assert "audit" in imported
    assert sorted(imported & set(HEAVY)) == []
    clean = subprocess.run([sys.executable, str(script), "ok.py"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert clean.returncode == 0, clean.stderr


def test_hook_script_runs_without_site_packages(tmp_path: Path) -> None:
    """A bare interpreter (``-S -I``: no site-packages, no environment) runs the hook."""
    (tmp_path / "bad.py").write_text(BAD, encoding="utf-8")
    script = REPO / str(_hook()["entry"])
    proc = subprocess.run([sys.executable, "-S", "-I", str(script), "--format", "json",
                           "bad.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and '"KVT001": 1' in proc.stdout, proc.stderr


def test_importing_the_audit_imports_nothing_heavy() -> None:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "import audit.cli"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = _imported(proc.stderr)
    assert "audit" in imported and sorted(imported & set(HEAVY)) == []
