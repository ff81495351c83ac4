"""``kvtier demo``'s result and printout for each set of tiers (pure logic: engine results as
the demo's engine children write them, no engine). The end-to-end runs are in
tests/e2e/test_demo.py; the host tier without Redis is checked here only."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from connector.demo.cli import Engines, RedisChoice, _print_result, _result
from connector.demo.report import KVTIER_HOST
from connector.demo.workload import Workload
from rigs.ports import free_port

PROMPT_TOKENS = "vllm:prompt_tokens"


def _phase(name: str, output: list[int], **counters: float) -> dict[str, Any]:
    return {"name": name, "wall_s": 1.0,
            "counters": {PROMPT_TOKENS: 64.0, **counters},
            "requests": [{"ttft_s": 0.01, "output": output}]}


def _engines(host_stats: dict[str, Any] | None) -> Engines:
    base = {"startup_s": 20.0, "phases": [_phase("cold", [1, 2]), _phase("reset", [1, 2])]}
    first = {"startup_s": 21.0, "phases": [_phase("cold", [1, 2]), _phase("reset", [1, 2])]}
    restart = {"startup_s": 22.0, "phases": [_phase("restart", [1, 2], **{KVTIER_HOST: 32.0})]}
    return Engines(base, "computed", first, restart, "kvtier-demo-x", 0, host_stats)


HOST_STATS = {"entries": 2, "num_slots": 256, "bytes_used": 1 << 20, "commits": 2,
              "duplicates_dropped": 0, "redis": False}


def test_host_tier_without_redis_is_named_so_and_restores_from_the_host_tier(
        capsys: pytest.CaptureFixture[str]) -> None:
    choice = RedisChoice(None, "redis://127.0.0.1:1", "--redis-url", False,
                         "ConnectionError: refused")
    args = argparse.Namespace(model="llama", quick=True)
    result = _result(args, choice, Workload(), _engines(HOST_STATS), 60.0)
    assert result["mode"] == "cpu+host"
    assert result["redis"]["used"] is False and result["redis"]["key_prefix"] is None
    assert result["host_tier"] == {"used": True, "stats": HOST_STATS}
    assert result["notes"] == [
        "CPU tier and host tier, no Redis: none reachable at redis://127.0.0.1:1 "
        "(ConnectionError: refused); the restarted engine restores from the host tier."]
    restart = {r["label"]: r for r in result["rows"]}["kvtier: engine restarted (new process)"]
    assert restart["host_tokens"] == 32 and restart["redis_tokens"] == 0
    assert result["outputs_identical"] is True
    _print_result(result)
    out = capsys.readouterr().out
    assert "tiers: CPU + host tier — CPU tier and host tier, no Redis" in out
    assert "2 saves committed" in out and "the engines hold no Redis" not in out


def test_no_redis_and_no_host_tier_is_cpu_only() -> None:
    choice = RedisChoice(None, "redis://127.0.0.1:1", "--redis-url", False, "refused")
    engines = _engines(None)
    engines.restart = None
    result = _result(argparse.Namespace(model="llama", quick=True), choice, Workload(),
                     engines, 1.0)
    assert result["mode"] == "cpu-only"
    assert result["notes"][0].startswith("CPU tier only: no Redis reachable")


def test_outputs_that_differ_from_vllm_alone_are_marked_no_and_the_demo_exits_1(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The negative control of the "identical" column: a kvtier pass whose outputs differ
    from vLLM alone's is marked NO, the run is not identical, ``kvtier demo`` exits 1. (That
    corrupted loads do change the outputs is asserted with real engines in
    tests/e2e/test_connector_llama.py, ``debug_corrupt_loads``.)"""
    from connector.demo import cli

    engines = _engines(HOST_STATS)
    engines.first["phases"][1] = _phase("reset", [9, 9])  # a wrong block was loaded
    choice = RedisChoice(None, "redis://127.0.0.1:1", "--redis-url", False, "refused")
    result = _result(argparse.Namespace(model="llama", quick=True), choice, Workload(),
                     engines, 1.0)
    rows = {r["label"]: r for r in result["rows"]}
    assert rows["kvtier: GPU prefix cache reset"]["identical"] is False
    assert rows["kvtier: fresh engine"]["identical"] is True
    assert result["outputs_identical"] is False
    monkeypatch.setattr(cli, "run_demo", lambda args: result)
    assert cli.main(["--quick"]) == 1
    assert "NO — see the rows marked NO" in capsys.readouterr().out


def test_an_unreachable_redis_runs_the_cpu_tier_alone_and_says_so(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    """``kvtier demo --redis-url`` at a closed port, through ``main``: the real ping fails,
    the demo says it runs the CPU tier alone, the kvtier engine's transfer config names no
    Redis, the restart phase is skipped, and the table says CPU ONLY. The engines are the
    launcher's stand-in (they return what engine children return); that a CPU-tier-only
    kvtier engine serves the prefix with vLLM alone's outputs is asserted with real engines
    in tests/e2e/test_connector_layout.py and test_connector_tp.py (hybrid)."""
    from connector.demo import cli, engine

    specs: list[dict[str, Any]] = []

    def run_engine(spec: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        specs.append(spec)
        hits = {} if spec["kv_transfer_config"] is None else {"vllm:kvtier_hit_tokens_cpu": 32}
        return {"startup_s": 1.0, "phases": [_phase("cold", [1, 2]),
                                             _phase("reset", [1, 2], **hits)]}

    monkeypatch.setattr(engine, "run_engine", run_engine)
    monkeypatch.setattr(cli, "model_path", lambda model: tmp_path)
    url = f"redis://127.0.0.1:{free_port()}"  # nothing listens there
    out_json = tmp_path / "demo.json"
    assert cli.main(["--quick", "--redis-url", url, "--json", str(out_json)]) == 0
    captured = capsys.readouterr()
    assert "Running the CPU tier alone" in captured.err and url in captured.err
    assert "3/3 skipped" in captured.err
    assert [s["label"] for s in specs] == ["vllm-alone", "kvtier"]
    extra = specs[1]["kv_transfer_config"]["kv_connector_extra_config"]
    assert not {"redis_url", "redis_url_env", "host_tier_socket"} & set(extra)
    assert "CPU ONLY" in captured.out and url in captured.out
    data = json.loads(out_json.read_text())
    assert data["mode"] == "cpu-only" and data["redis"]["used"] is False
    assert "ConnectionError" in data["redis"]["detail"]
    rows = {r["label"]: r for r in data["rows"]}
    assert "kvtier: engine restarted (new process)" not in rows
    assert rows["kvtier: GPU prefix cache reset"]["cpu_tokens"] == 32
    assert any("CPU tier only" in note for note in data["notes"])
