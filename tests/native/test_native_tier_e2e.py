"""End to end: vLLM's OffloadingConnector + TieringOffloadingSpec + kvtier's Redis tier, on a
real vLLM CPU engine (tiny Llama, vLLM's default executors).

vLLM's stock tiering worker refuses the CPU platform, so the spec is
``CpuTieringOffloadingSpec`` (``connector/native_tier/cpu_tiering.py``): the same
``TieringOffloadingSpec`` (manager, secondary tiers, shared primary region) with a CPU
copy worker. Engines, one at a time, each in its own process:

  baseline   vLLM alone
  first      native + kvtier tier: computes A and B, cascades them to Redis
  second     a NEW engine on the same Redis: restores A's prefix from Redis
  bfloat16   a new engine of another model dtype (so another KV dtype) on the same Redis:
             restores nothing of the float32 values, outputs equal vLLM alone in bfloat16
             (the CPU backend here runs neither fp8 weights nor an fp8 KV cache: no AVX-512)
  damaged    a new engine after every value was damaged in Redis (flipped bytes, values
             of other keys): misses, recomputes, same outputs
  down       a new engine whose Redis does not answer: misses and counted drops
  wheel      the README's native-tier config served from kvtier's installed wheel (own venv)
  cpu alone  vLLM's plain CPU offloading (``CpuPeerOffloadingSpec``, kvtier's CPU worker):
             the prefix after a reset comes from the CPU tier, outputs equal vLLM alone
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from connector.demo.tiny_models import prompt_words
from rigs import engine_starts
from rigs.ports import free_port
from rigs.redis_keys import scratch_prefix
from rigs.redis_server import SecretRedis
from tests.support import no_faults
from tests.support.connector_runner import corrupt_redis
from tests.support.engine_host import run_native_engine as run_in_subprocess

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]

PROMPT_A = prompt_words(21, 150)  # 4 full chunks of 32 tokens + a tail
PROMPT_B = prompt_words(22, 140)
A2 = PROMPT_A + " w5 w6"
N = "vllm:kvtier_native_"
BF16 = {"dtype": "bfloat16"}


def by_name(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {o["name"]: o for o in result["outputs"]}


URL_ENV = "KVTIER_TEST_SECRET_REDIS_URL"


@pytest.fixture(scope="module")
def prefix(secret_redis: SecretRedis) -> Iterator[str]:
    with scratch_prefix(secret_redis.admin_url) as name:
        yield name


@pytest.fixture(scope="module")
def admin_url(secret_redis: SecretRedis) -> str:
    """The test's own view of the password-protected Redis (scans, damage)."""
    return secret_redis.admin_url


@pytest.fixture(scope="module")
def by_file(secret_redis: SecretRedis, tmp_path_factory: pytest.TempPathFactory
            ) -> dict[str, Any]:
    """The tier's settings for the ACL user, its password in a private file."""
    path = tmp_path_factory.mktemp("secret") / "redis-password"
    path.write_text(secret_redis.user_password + "\n")
    path.chmod(0o600)
    return {"redis_url": f"redis://127.0.0.1:{secret_redis.server.port}/0",
            "tier": {"redis_username": "kvtier", "redis_password_file": str(path)}}


def kvtier(where: dict[str, Any], prefix: str, prompts: list[list[Any]],
           engine: dict[str, Any] | None = None, wait_for: list[list[Any]] | None = None,
           env: dict[str, str] | None = None, **tier: Any) -> dict[str, Any]:
    """``where``: ``redis_url`` and tier settings naming the Redis. ``wait_for``: metrics the
    engine is stepped for until they reach a value (cascades to Redis are counted when a
    later step collects them; see native_tier_engine)."""
    # A stalled machine must not make a miss (no_faults); only the fault test below sets a
    # short timeout.
    tier = {"redis_timeout_s": no_faults.REDIS_TIMEOUT_S, **where.get("tier", {}), **tier}
    return run_in_subprocess({"mode": "kvtier", "redis_url": where.get("redis_url"),
                              "redis_prefix": prefix, "prompts": prompts, "tier": tier,
                              "engine": engine or {}, "wait_for": wait_for or []}, env=env)


@pytest.fixture(scope="module")
def baseline(tiny_llama_dir: Any) -> dict[str, dict[str, Any]]:
    return by_name(run_in_subprocess({"mode": "none", "prompts": [
        ["A1", PROMPT_A], ["B1", PROMPT_B], ["A2", A2]]}))


@pytest.fixture(scope="module")
def first(baseline: Any, by_file: dict[str, Any], prefix: str) -> dict[str, Any]:
    return kvtier(by_file, prefix, [["A1", PROMPT_A], ["B1", PROMPT_B]],
                  wait_for=[[N + "stored_chunks", 8]])  # A and B: 4 full chunks each


@pytest.fixture(scope="module")
def second(first: dict[str, Any], secret_redis: SecretRedis, prefix: str) -> dict[str, Any]:
    """A new engine that reads the whole URL (ACL user and password) from a variable."""
    return kvtier({"tier": {"redis_url_env": URL_ENV}}, prefix, [["A2", A2]],
                  env={URL_ENV: secret_redis.user_url})


@pytest.fixture(scope="module")
def bfloat16(second: dict[str, Any], by_file: dict[str, Any], prefix: str) -> dict[str, Any]:
    alone = by_name(run_in_subprocess({"mode": "none", "engine": BF16,
                                       "prompts": [["A2", A2]]}))
    result = kvtier(by_file, prefix, [["A2", A2]], engine=BF16,
                    wait_for=[[N + "stored_chunks", 4]])
    result["alone"] = alone
    return result


@pytest.fixture(scope="module")
def damaged(second: dict[str, Any], by_file: dict[str, Any], admin_url: str,
            prefix: str) -> dict[str, Any]:
    damage = corrupt_redis(admin_url, prefix)
    result = kvtier(by_file, prefix, [["B1", PROMPT_B]])
    result["damage"] = damage
    return result


def test_first_engine_cascades_its_chunks_to_redis(first: dict[str, Any], baseline: Any,
                                                   admin_url: str, prefix: str) -> None:
    outs = by_name(first)
    for name in ("A1", "B1"):
        assert outs[name]["token_ids"] == baseline[name]["token_ids"]
    m = first["metrics"]
    assert m[N + "stored_chunks"] >= 8  # A and B: 4 full chunks each
    assert m.get(N + "store_drops", 0) == 0 and m.get(N + "store_failures", 0) == 0
    assert m[N + "redis_available"] == 1
    keys = list(redis.Redis.from_url(admin_url).scan_iter(match=f"{prefix}:*", count=1000))
    assert len(keys) >= 8
    assert len({k.split(b":")[1] for k in keys}) == 1  # one namespace fingerprint


def test_no_password_in_the_engines_output(first: dict[str, Any], second: dict[str, Any],
                                           secret_redis: SecretRedis) -> None:
    """Both engines stored to or restored from the password-protected Redis (the tests
    around this one), and nothing they or their processes printed holds a password."""
    for result in (first, second):
        assert "KvtierRedisTier" in result["log"]  # vLLM printed the tier's settings
        assert secret_redis.found_in(result["log"]) == []
        assert secret_redis.found_in(json.dumps(result["metrics"])) == []


def test_new_engine_restores_the_prefix_from_redis(second: dict[str, Any],
                                                   baseline: Any) -> None:
    out = by_name(second)["A2"]
    assert out["token_ids"] == baseline["A2"]["token_ids"]  # identical to vLLM alone
    assert out["num_cached_tokens"] >= 128  # 4 chunks of 32 came back
    m = second["metrics"]
    assert m[N + "loaded_chunks"] >= 4
    assert m[N + "lookup_checked_hits"] >= 4  # a new engine knows nothing: it asked Redis
    assert m["vllm:kv_offload_tiering_chunk_hits"] >= 4
    assert m.get(N + "load_misses", 0) == 0 and m.get(N + "unpositioned_keys", 0) == 0


def test_engine_of_another_dtype_restores_nothing_of_the_first_engine_s(
        bfloat16: dict[str, Any], admin_url: str, prefix: str) -> None:
    out = by_name(bfloat16)["A2"]
    assert out["token_ids"] == bfloat16["alone"]["A2"]["token_ids"]  # = vLLM alone, bfloat16
    assert out["num_cached_tokens"] == 0  # A's float32 chunks are in Redis: none served
    m = bfloat16["metrics"]
    assert m.get(N + "loaded_chunks", 0) == 0 and m.get(N + "lookup_checked_hits", 0) == 0
    assert m.get(N + "lookup_known_hits", 0) == 0
    assert m.get("vllm:kv_offload_tiering_chunk_hits", 0) == 0
    assert m[N + "stored_chunks"] >= 4  # its own chunks, under its own fingerprint
    keys = list(redis.Redis.from_url(admin_url).scan_iter(match=f"{prefix}:*", count=1000))
    assert len({k.split(b":")[1] for k in keys}) == 2


def test_damaged_values_are_misses_and_outputs_stay_identical(damaged: dict[str, Any],
                                                              baseline: Any) -> None:
    assert damaged["damage"]["flipped"] + damaged["damage"]["swapped"] >= 8
    out = by_name(damaged)["B1"]
    assert out["token_ids"] == baseline["B1"]["token_ids"]
    m = damaged["metrics"]
    assert m.get(N + "loaded_chunks", 0) == 0
    assert m[N + "corrupt_values"] >= 1
    assert out["num_cached_tokens"] == 0


def test_redis_down_gives_misses_and_counted_drops(damaged: dict[str, Any], baseline: Any,
                                                   prefix: str) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    result = kvtier({"redis_url": dead}, prefix, [["A1", PROMPT_A]], redis_timeout_s=0.2,
                    wait_for=[[[N + "store_drops", N + "store_failures"], 4]])
    out = by_name(result)["A1"]
    assert out["token_ids"] == baseline["A1"]["token_ids"]
    m = result["metrics"]
    assert m[N + "redis_available"] == 0
    assert m.get(N + "stored_chunks", 0) == 0
    assert m[N + "store_drops"] + m.get(N + "store_failures", 0) >= 4


def test_plain_cpu_offloading_restores_the_prefix_on_cpu_only_vllm(
        baseline: dict[str, dict[str, Any]]) -> None:
    """docs/native-tier.md's "native offloading on CPU-only vLLM", CPU tier alone: after vLLM's
    prefix cache is reset (every GPU-cached block dropped), A's 4 full chunks (128 tokens)
    are cached again: only the offloading connector's CPU tier can hold them."""
    runs = by_name(run_in_subprocess({"mode": "cpu", "reset_between": True,
                                      "prompts": [["A1", PROMPT_A], ["A2", A2]]}))
    assert runs["A1"]["num_cached_tokens"] == 0
    assert runs["A2"]["num_cached_tokens"] == 128
    for name in ("A1", "A2"):
        assert runs[name]["token_ids"] == baseline[name]["token_ids"], name


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with kvtier's wheel (``pip wheel --no-deps .``) that sees the test venv's
    packages (vLLM, torch) but not the checkout or its editable install."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".venv*", ".git", "__pycache__", "build", "*.egg-info", "tests", "benchmarks"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp / "dist"), str(source)], check=True)
    venv = tmp / "venv"  # no pip of its own: this venv's pip installs into it (--python)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # A plain path line: the test venv's own .pth files (the editable install) stay unread.
    (Path(site) / "test-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    wheel = next((tmp / "dist").glob("kvtier-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "-q", "--no-deps", str(wheel)], check=True)
    return venv


def test_the_wheel_serves_the_readme_native_config_on_the_cpu(
        wheel_venv: Path, baseline: dict[str, dict[str, Any]], tiny_llama_dir: Path,
        redis_url: str) -> None:
    """The README's native-tier config (``CpuTieringOffloadingSpec`` + ``KvtierRedisTier``, URL from
    ``redis_url_env``), served by a real engine from the installed wheel alone: A's prefix
    after a reset comes from the CPU tier, its chunks cascade to Redis, outputs equal vLLM's."""
    with scratch_prefix(redis_url) as prefix:
        config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {
                      "spec_name": "CpuTieringOffloadingSpec",
                      "spec_module_path": "connector.native_tier.cpu_tiering",
                      "cpu_bytes_to_use": 64 << 20,
                      "secondary_tiers": [{"type": "KvtierRedisTier",
                                           "module_path": "connector.native_tier.tier",
                                           "redis_url_env": "KVTIER_REDIS_URL",
                                           "redis_prefix": prefix}]}}
        spec = {"kv_transfer_config": config, "stored_chunks": 4,
                "prompts": [["A1", PROMPT_A], ["A2", A2]]}
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(KVTIER_REDIS_URL=redis_url, HF_HUB_OFFLINE="1")
        engine_starts.record("kvtier wheel venv (own process)")
        proc = subprocess.run(
            [str(wheel_venv / "bin" / "python"), str(REPO / "tests/native/wheel_engine.py"),
             str(tiny_llama_dir), json.dumps(spec)],
            cwd=wheel_venv, env=env, capture_output=True, text=True, timeout=900, check=False)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        assert lines, f"exit {proc.returncode}:\n{proc.stderr[-4000:]}"
        result = json.loads(lines[-1][len("RESULT "):])
        keys = list(redis.Redis.from_url(redis_url).scan_iter(match=f"{prefix}:*", count=1000))
    for module, path in result["modules"].items():
        assert path.startswith(str(wheel_venv)), (module, path)
    runs = by_name(result)
    assert runs["A2"]["num_cached_tokens"] == 128  # 4 full chunks, after the reset
    for name in ("A1", "A2"):
        assert runs[name]["token_ids"] == baseline[name]["token_ids"], name
    assert result["stored_chunks"] >= 4 and len(keys) >= 4
