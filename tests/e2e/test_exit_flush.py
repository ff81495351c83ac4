"""Nothing lost at exit (issue 44): an engine that exits right after its last request
leaves every saved block in Redis Cluster, and a new engine restores them.

Real vLLM CPU engines (tiny Llama) on a real 3-master Redis Cluster the module starts on
loopback ports. The storing engines are scripts as users write them
(:mod:`tests.support.exit_store`: ``LLM(...)`` at module level, the script just ends): one
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM tears the engine down during the
interpreter's exit, where the Redis tier's last flush used to hit "cannot schedule new
futures after interpreter shutdown" and write nothing), one with vLLM's default executors.
Then a new engine (default executors) asks every prompt's second turn. The same for the
OpenAI server stopped by SIGTERM, and for vLLM's OffloadingConnector with kvtier's Redis
tier (the native tier).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from connector.demo.presets import kvtier_transfer_config
from connector.demo.tiny_models import prompt_words
from offload_tiers.redis.presence_feed import ANNOUNCE_SUFFIX
from rigs.daemon_proc import REPO
from rigs.openai_server import OpenAIServer, complete
from tests.support.connector_runner import run_in_subprocess
from tests.support.engine_host import run_native_engine
from tests.support.exit_store import SLOW_MACHINE_TIMEOUT_S
from tests.support.redis_cluster import RedisClusterProcs
from tests.support.redis_tls import start_tls_acl_server, tls_url
from tests.support.tls_certs import make_tls_files

pytestmark = pytest.mark.e2e

IN_PROCESS = [60, 61, 62, 63]  # prompt seeds stored by the in-process engine
DEFAULT_EXECUTORS = [64, 65, 66, 67]
OPENAI = [70, 71]  # sent to the OpenAI server, which is then stopped by SIGTERM
NATIVE = [68, 69]  # stored in process by vLLM's OffloadingConnector + kvtier's Redis tier
STORED = IN_PROCESS + DEFAULT_EXECUTORS + OPENAI  # by kvtier's connector
TLS_ALONE = [74, 75]  # in process, on a standalone TLS redis-server of its own
ACL_USER, ACL_PASSWORD = "kvtier-exit", "exit-secret"
PREFIX_TOKENS = 128  # each 150-word prompt's four full 32-token blocks


def turn2(seed: int) -> str:
    return prompt_words(seed, 150) + " w5"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    procs = RedisClusterProcs(Path(tmp_path_factory.mktemp("exit-cluster"))).start()
    yield procs
    procs.stop()


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"kvtier-test-{uuid.uuid4().hex[:12]}"  # the cluster is the module's own


def store_and_exit(cluster: RedisClusterProcs, prefix: str, seeds: list[int],
                   env: dict[str, str], *mode: str) -> dict[str, Any]:
    """Run the user's script to its end; what it printed, and its log."""
    proc = subprocess.run([sys.executable, "-m", "tests.support.exit_store", cluster.url,
                           prefix, json.dumps(seeds), *mode], cwd=REPO, text=True,
                          capture_output=True, env={**os.environ, **env}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    stored = [line for line in proc.stdout.splitlines() if line.startswith("STORED ")]
    assert stored, proc.stdout[-2000:]
    return {"prompt_tokens": json.loads(stored[0].split(" ", 1)[1]), "log": proc.stderr}


def serve_then_sigterm(cluster: RedisClusterProcs, prefix: str, logs: Path) -> dict[str, Any]:
    """The OpenAI server (kvtier on the Cluster) answers OPENAI's prompts, then is stopped
    by SIGTERM as an operator who keeps its writes stops it; its log.

    vLLM's SIGTERM with its default ``--shutdown-timeout 0`` SIGKILLs the engine core and
    its workers at once (``kill_process_tree``): no connector code runs then, and saves
    still queued for Redis are not written (docs/connector.md, "Stopping an engine"). With
    a shutdown timeout the workers are shut down and kvtier's flush runs. vLLM's windows
    (the timeout, ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``) and the flush's bound are set so
    that only a hang reaches them on a loaded machine."""
    from connector.demo.tiny_models import tiny_llama

    server = OpenAIServer(
        tiny_llama(), logs / "server.log",
        kv_transfer_config=kvtier_transfer_config({
            "cpu_bytes": 16 << 20, "redis_url": cluster.url, "redis_prefix": prefix,
            "redis_timeout_s": SLOW_MACHINE_TIMEOUT_S,
            "redis_shutdown_flush_s": SLOW_MACHINE_TIMEOUT_S}),
        extra_args=["--shutdown-timeout", "600"],
        env={"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "600"})
    server.start()
    try:
        for seed in OPENAI:
            complete(server, prompt_words(seed, 150))
    finally:
        server.stop()  # SIGTERM, then waits for the server's processes to end
    return {"log": (logs / "server.log").read_text(errors="replace")}


@pytest.fixture(scope="module")
def stored(cluster: RedisClusterProcs, prefix: str,
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    runs = {
        "in_process": store_and_exit(cluster, prefix, IN_PROCESS,
                                     {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
        "default_executors": store_and_exit(cluster, prefix, DEFAULT_EXECUTORS, {}),
        "openai": serve_then_sigterm(cluster, prefix, tmp_path_factory.mktemp("openai")),
    }
    everything = sum(cluster.total_keys(f"{prefix}:*").values())
    streams = sum(cluster.total_keys(f"{prefix}:{ANNOUNCE_SUFFIX}*").values())
    runs["keys"] = everything - streams  # block values, not the presence stream
    runs["native"] = store_and_exit(cluster, f"{prefix}-native", NATIVE,
                                    {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, "native")
    runs["native_keys"] = sum(cluster.total_keys(f"{prefix}-native:*").values())
    return runs


@pytest.fixture(scope="module")
def baseline() -> dict[str, Any]:
    seeds = STORED + NATIVE + TLS_ALONE
    steps = [["generate", f"T{s}", turn2(s)] for s in seeds]
    return {o["name"]: o for o in run_in_subprocess(
        {"model": "llama", "extra": None, "steps": steps})["outputs"]}


@pytest.fixture(scope="module")
def restored(stored: dict[str, Any], cluster: RedisClusterProcs, prefix: str
             ) -> dict[str, Any]:
    steps = [["generate", f"T{s}", turn2(s)] for s in STORED]
    extra = {"cpu_bytes": 16 << 20, "redis_url": cluster.url, "redis_prefix": prefix,
             "redis_timeout_s": SLOW_MACHINE_TIMEOUT_S}
    return {o["name"]: o for o in run_in_subprocess(
        {"model": "llama", "extra": extra, "steps": steps})["outputs"]}


@pytest.fixture(scope="module")
def restored_native(stored: dict[str, Any], cluster: RedisClusterProcs, prefix: str
                    ) -> dict[str, Any]:
    spec = {"mode": "kvtier", "redis_url": cluster.url, "redis_prefix": f"{prefix}-native",
            "tier": {"redis_timeout_s": SLOW_MACHINE_TIMEOUT_S},
            "prompts": [[f"T{s}", turn2(s)] for s in NATIVE]}
    return {o["name"]: o for o in run_native_engine(spec)["outputs"]}


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A standalone redis-server over TLS, with an ACL user and a verified server (the
    Cluster above is plain TCP): the in-process script stores its prompts and exits; a new
    engine asks their turn 2."""
    seeds = TLS_ALONE
    work = tmp_path_factory.mktemp("exit-tls")
    tls = make_tls_files(work / "certs")
    server, port = start_tls_acl_server(work / "redis", tls, ACL_USER, ACL_PASSWORD)
    url = tls_url(port, ACL_USER, ACL_PASSWORD)
    extra: dict[str, Any] = {"redis_ssl_ca_certs": str(tls.ca_cert)}
    try:
        run = store_and_exit_to(url, "exit", seeds, extra)
        names = list(server.client().scan_iter(match="exit:*", count=1000))
        keys = sum(1 for n in names if not n.endswith(f":{ANNOUNCE_SUFFIX}".encode()))
        restore = {"cpu_bytes": 16 << 20, "redis_url": url, "redis_prefix": "exit",
                   "redis_timeout_s": SLOW_MACHINE_TIMEOUT_S, **extra}
        restored = {o["name"]: o for o in run_in_subprocess({
            "model": "llama", "extra": restore,
            "steps": [["generate", f"T{s}", turn2(s)] for s in seeds]})["outputs"]}
        yield {"seeds": seeds, "run": run, "keys": keys, "restored": restored}
    finally:
        server.stop()


def store_and_exit_to(url: str, prefix: str, seeds: list[int], extra: dict[str, Any]
                      ) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "tests.support.exit_store", url, prefix,
                           json.dumps(seeds), "kvtier", json.dumps(extra)], cwd=REPO,
                          text=True, capture_output=True, timeout=600,
                          env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"log": proc.stderr}


def test_on_a_standalone_tls_redis_too(single: dict[str, Any],
                                          baseline: dict[str, Any]) -> None:
    """The same on one redis-server over TLS (ACL user, server verified): every block
    there once the script ended, each prefix restored with vLLM alone's output."""
    assert "not made before closing" not in single["run"]["log"]
    assert single["keys"] == len(single["seeds"]) * PREFIX_TOKENS // 32
    for seed in single["seeds"]:
        got, want = single["restored"][f"T{seed}"], baseline[f"T{seed}"]
        assert got["delta"].get("hit_tokens_redis", 0) == PREFIX_TOKENS, (seed, got["delta"])
        assert got["token_ids"] == want["token_ids"]


def test_an_engine_that_exits_leaves_every_block_on_the_cluster(
        stored: dict[str, Any]) -> None:
    """Both scripts' saves reached the masters before their processes ended: four full
    blocks per prompt, eight prompts; no executor refused the flush."""
    for run in ("in_process", "default_executors", "openai"):
        assert "cannot schedule new futures" not in stored[run]["log"]
        assert "not made before closing" not in stored[run]["log"]
    assert "force killing" not in stored["openai"]["log"]  # its workers shut down, unkilled
    for run in ("in_process", "default_executors"):
        assert all(n >= PREFIX_TOKENS + 1 for n in stored[run]["prompt_tokens"])
    assert stored["keys"] == len(STORED) * PREFIX_TOKENS // 32


def test_the_native_tier_s_exit_leaves_its_chunks_and_a_new_engine_restores_them(
        stored: dict[str, Any], restored_native: dict[str, Any],
        baseline: dict[str, Any]) -> None:
    """vLLM's OffloadingConnector with kvtier's Redis tier, in process, at module level:
    its chunks reach the Cluster before the process ends; a new native engine (default
    executors, an empty CPU tier) restores both prefixes from it with vLLM alone's output."""
    assert "cannot schedule new futures" not in stored["native"]["log"]
    assert stored["native_keys"] >= len(NATIVE) * PREFIX_TOKENS // 32
    for seed in NATIVE:
        got, want = restored_native[f"T{seed}"], baseline[f"T{seed}"]
        assert got["num_cached_tokens"] == PREFIX_TOKENS, (seed, got)
        assert got["token_ids"] == want["token_ids"]


def test_a_new_engine_restores_them_with_vllm_alone_s_output(
        restored: dict[str, Any], baseline: dict[str, Any]) -> None:
    for seed in STORED:
        got, want = restored[f"T{seed}"], baseline[f"T{seed}"]
        assert got["delta"].get("hit_tokens_redis", 0) == PREFIX_TOKENS, (seed, got["delta"])
        assert got["num_cached_tokens"] == PREFIX_TOKENS
        assert got["token_ids"] == want["token_ids"]
