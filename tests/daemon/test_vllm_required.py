"""A vLLM module that does not import fails the run; it is never a silent skip."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.daemon.vllm_required import import_vllm

REPO = Path(__file__).resolve().parents[2]


def test_a_module_that_does_not_import_fails_instead_of_skipping() -> None:
    with pytest.raises(pytest.fail.Exception, match="test dependency"):
        import_vllm("kvtier_test_no_such_module")


def test_a_test_module_using_it_makes_the_run_fail(tmp_path: Path) -> None:
    mod = tmp_path / "test_needs_missing.py"
    mod.write_text(textwrap.dedent("""
        from tests.daemon.vllm_required import import_vllm

        missing = import_vllm("kvtier_test_no_such_module")

        def test_never_runs():
            pass
    """))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--rootdir", str(REPO), str(mod)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out  # a skip would exit 0
    assert "skipped" not in out and "vLLM is a test dependency" in out
