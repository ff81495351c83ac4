"""The kvtier command dispatches lazily, and the daemon/tiers/audit paths never import vLLM."""

from __future__ import annotations

import subprocess
import sys

import pytest

from connector.cli import main


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("daemon", "audit", "demo", "bench"):
        assert name in out


def test_unknown_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_no_arguments_is_a_usage_error() -> None:
    assert main([]) == 2


@pytest.mark.parametrize(
    "module",
    ["offload_tiers", "offload_tiers.keys", "audit", "connector", "connector.cli",
     "connector.events.wire", "connector.events.index", "connector.daemon.cli"],
)
def test_import_does_not_pull_in_vllm_or_torch(module: str) -> None:
    code = (
        f"import importlib, sys; importlib.import_module({module!r}); "
        "bad = sorted(m for m in ('vllm', 'torch') if m in sys.modules); "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing {module} imported {out.stdout.strip()}"


def test_connector_attribute_is_the_vllm_connector_class() -> None:
    """``kv_connector_module_path="connector"`` resolves, as vLLM resolves it (import the
    module, getattr the name), to the connector class itself (this imports vLLM)."""
    import importlib

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from connector.vllm_connector import connector as tiered_connector

    kv_connector, kv_connector_module_path = "TieredOffloadingConnector", "connector"
    cls = getattr(importlib.import_module(kv_connector_module_path), kv_connector)
    assert cls is tiered_connector.TieredOffloadingConnector
    assert issubclass(cls, KVConnectorBase_V1)
    with pytest.raises(AttributeError, match="module 'connector' has no attribute 'NoSuchThing'"):
        _ = importlib.import_module("connector").NoSuchThing


def test_bench_finds_the_checkouts_benchmarks(tmp_path, monkeypatch) -> None:
    from connector.demo.bench_cli import benchmarks_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVTIER_BENCHMARKS", raising=False)
    found = benchmarks_dir()
    assert found is not None and (found / "bench_tiers.py").is_file()


def test_bench_without_benchmarks_says_where_to_look(tmp_path, monkeypatch, capsys) -> None:
    from connector.demo import bench_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench_cli, "__file__", str(tmp_path / "a" / "b" / "bench_cli.py"))
    assert bench_cli.main(["tiers"]) == 2
    assert "KVTIER_BENCHMARKS" in capsys.readouterr().err


def test_the_daemon_s_status_lines_go_out_in_one_write(monkeypatch) -> None:  # noqa: ANN001
    """Supervisors (and rigs/daemon_proc.py) read "listening on ...:PORT" from the
    daemon's output, where log lines of other threads land too: the text and its newline in
    one write, so nothing can come between them (print writes them separately)."""
    from connector.daemon.cli import say_line

    writes: list[str] = []

    class Recorder:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            writes.append("<flush>")

    monkeypatch.setattr(sys, "stdout", Recorder())
    say_line("kvtier daemon listening on http://127.0.0.1:44965")
    assert writes == ["kvtier daemon listening on http://127.0.0.1:44965\n", "<flush>"]
