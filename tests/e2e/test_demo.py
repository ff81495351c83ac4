"""``kvtier demo --quick --json``: real vLLM CPU engines (child processes), real Redis.

Asserts from the demo's JSON, never from timing: outputs equal vLLM's without kvtier, the
pass after the GPU prefix-cache reset (and the restarted engine) got its prefix from a
kvtier tier, and with ``--host-tier`` (and Redis behind the daemon) the restarted engine
restores from the host's shared CPU tier. Without Redis the demo's result is checked from
engine results in tests/unit/test_demo_result.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from rigs import engine_starts
from rigs.redis_server import SecretRedis

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
_SCRIPT = Path(sys.executable).with_name("kvtier")
# The installed console script, as a user runs it; the module when it is not installed.
KVTIER = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "connector.cli"]


def _run_demo(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "demo.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("KVTIER_REDIS_URL", None)
    proc = subprocess.run(
        [*KVTIER, "demo", "--quick", "--json", str(out),
         "--log-dir", str(tmp_path / "logs"), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=540,
    )
    engine_starts.record("kvtier demo (child engines)",
                         count=len(list((tmp_path / "logs").glob("*.spec.json"))))
    assert out.exists(), f"demo wrote no JSON (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    return proc, json.loads(out.read_text())


def _rows(data: dict) -> dict[str, dict]:
    return {row["label"]: row for row in data["rows"]}


@pytest.fixture(scope="module")
def with_redis(tmp_path_factory: pytest.TempPathFactory, secret_redis: SecretRedis
               ) -> tuple[Path, subprocess.CompletedProcess, dict]:
    """The full demo against a Redis that requires a password; its log directory is the
    reference (vLLM-alone outputs) the module's other demo runs reuse."""
    tmp_path = tmp_path_factory.mktemp("demo-redis")
    proc, data = _run_demo(tmp_path, "--redis-url", secret_redis.user_url)
    return tmp_path, proc, data


def _reference(with_redis: tuple[Path, subprocess.CompletedProcess, dict]) -> list[str]:
    return ["--reference", str(with_redis[0] / "logs")]


def test_demo_with_redis_serves_prefix_from_tiers(
        with_redis: tuple[Path, subprocess.CompletedProcess, dict],
        secret_redis: SecretRedis) -> None:
    """The demo against a Redis that requires a password (an ACL user's, in the URL as a
    user types it): the prefix comes back from Redis, and nothing the demo printed or left
    in its log directory holds the password."""
    tmp_path, proc, data = with_redis
    redis_url = secret_redis.user_url
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert data["reference"] == "computed"
    assert data["mode"] == "cpu+redis"
    assert data["redis"]["used"] is True
    assert data["outputs_identical"] is True
    rows = _rows(data)
    assert all(row["identical"] is True for row in data["rows"])

    reset = rows["kvtier: GPU prefix cache reset"]
    assert reset["cpu_tokens"] + reset["redis_tokens"] > 0
    restart = rows["kvtier: engine restarted (new process)"]
    assert restart["redis_tokens"] > 0, "a new engine process must find the prefix in Redis"
    assert restart["cpu_tokens"] == 0, "the CPU tier cannot survive a process restart"
    # kvtier recomputes less than vLLM alone after the same reset.
    assert reset["recomputed_tokens"] < rows["vLLM alone: GPU prefix cache reset"][
        "recomputed_tokens"]
    for row in data["rows"]:
        assert row["gpu_tokens"] + row["cpu_tokens"] + row["redis_tokens"] + row[
            "other_external_tokens"] + row["recomputed_tokens"] == row["prompt_tokens"]

    # The run's Redis keys were cleaned up.
    prefix = data["redis"]["key_prefix"]
    assert prefix and prefix.startswith("kvtier-demo-")
    client = redis.Redis.from_url(redis_url)
    assert list(client.scan_iter(match=f"{prefix}:*", count=1000)) == []
    assert "CPU + Redis" in proc.stdout

    files = sorted(p for p in (tmp_path / "logs").rglob("*") if p.is_file())
    assert {p.suffix for p in files} >= {".json", ".log"}  # specs, outputs, engine logs
    for text in [proc.stdout, proc.stderr, json.dumps(data)] + [
            p.read_text(errors="replace") for p in files]:
        assert secret_redis.found_in(text) == []
    assert any("redis_url_env" in p.read_text() for p in files if p.name.endswith(
        ".spec.json"))  # the child engines were told where to find the URL, not the URL


def test_demo_host_tier_with_redis_the_daemon_holds_the_connection(
        tmp_path: Path, with_redis: tuple[Path, subprocess.CompletedProcess, dict],
        secret_redis: SecretRedis) -> None:
    """``--host-tier`` with a Redis that requires a password: the demo starts ``kvtier
    daemon --cpu-bytes``, which holds the one Redis connection (its URL by environment); the
    engines set ``host_tier_redis`` and hold none; the daemon writes their saves behind. The
    restarted engine (a new process, its own CPU tier empty) restores from the host tier as
    much as the Redis run's restart restored from Redis, outputs identical; the daemon held
    one copy of each save, and its shared memory and socket are gone afterwards; so are the
    run's keys, and the password appears in nothing the demo printed or left. (Without
    Redis the demo runs the same engines and daemon: its mode and note are checked in
    tests/unit/test_demo_result.py.)"""
    proc, data = _run_demo(tmp_path, "--redis-url", secret_redis.user_url, "--host-tier",
                           *_reference(with_redis))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert data["mode"] == "cpu+host+redis"
    assert data["outputs_identical"] is True
    restart = _rows(data)["kvtier: engine restarted (new process)"]
    from_redis = _rows(with_redis[2])["kvtier: engine restarted (new process)"]["redis_tokens"]
    assert restart["host_tokens"] == from_redis > 0
    assert restart["cpu_tokens"] == restart["redis_tokens"] == 0
    assert restart["identical"] is True
    stats = data["host_tier"]["stats"]
    assert stats["commits"] == stats["entries"] > 0
    assert stats["duplicates_dropped"] == stats["commits_rejected"] == 0
    assert not Path(stats["segment_path"]).exists()
    assert not Path(stats["socket_path"]).exists()
    assert "host tier" in proc.stdout and "CPU + host tier + Redis" in proc.stdout
    assert stats["redis"] is True
    assert stats["redis_writes"] > 0 and stats["redis_write_failures"] == 0
    assert data["redis"]["keys_cleaned"] >= stats["redis_writes"]
    client = redis.Redis.from_url(secret_redis.user_url)
    assert list(client.scan_iter(match=f"{data['redis']['key_prefix']}:*", count=1000)) == []
    specs = [p.read_text() for p in (tmp_path / "logs").glob("*.spec.json")]
    kvtier_specs = [t for t in specs if "host_tier_socket" in t]
    assert kvtier_specs and all("host_tier_redis" in t and "redis_url_env" not in t
                                for t in kvtier_specs)
    assert "the engines hold no Redis connection" in proc.stdout
    files = sorted(p for p in (tmp_path / "logs").rglob("*") if p.is_file())
    for text in [proc.stdout, proc.stderr, json.dumps(data)] + [
            p.read_text(errors="replace") for p in files]:
        assert secret_redis.found_in(text) == []


def test_engine_failure_is_reported_with_its_log(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """A bad connector setting fails the child before it imports vLLM (the check kvtier's
    connector runs at engine start, run first), naming the key and the fix; the parent
    raises with the log tail. (A real engine failing at start on the same setting:
    tests/e2e/test_connector_faults.py -k bad_setting.)"""
    from connector.demo.engine import EngineRunError, run_engine
    from connector.demo.presets import kvtier_transfer_config

    spec = {"label": "bad-config", "model": "llama", "model_dir": str(tiny_llama_dir),
            "workload": {"conversations": 1, "turns": 1},
            "kv_transfer_config": kvtier_transfer_config({"cpu_bytes": 5}),
            "phases": [{"name": "cold"}]}
    with pytest.raises(EngineRunError) as info:
        run_engine(spec, log_dir=tmp_path, quiet=True, timeout_s=300)
    message = str(info.value)
    assert "bad-config" in message
    cause = message.split("errors:\n", 1)[1].split("log tail:", 1)[0]
    assert "ConnectorConfigError" in cause and "cpu_bytes" in cause, cause
    assert "Fix:" in cause, cause
    log = (tmp_path / "bad-config.log").read_text()
    assert "ConnectorConfigError" in log
    assert "importing vLLM" not in log, log[-2000:]  # the line just before vLLM's import


def test_demo_rejects_unknown_model(tmp_path: Path) -> None:
    proc = subprocess.run(
        [*KVTIER, "demo", "--model", "gpt5"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr
