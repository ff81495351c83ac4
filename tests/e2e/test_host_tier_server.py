"""vLLM's OpenAI server at ``--data-parallel-size 2`` on one host tier, no Redis configured.

One server process (API server, two engine cores, a worker each: vLLM's default
executors), one ``kvtier daemon --cpu-bytes`` process. Each engine core has its own kvtier
scheduler and worker, and only the daemon's segment is shared: a prefix one DP rank
computed is restored by the other one (``cached_tokens`` over HTTP, ``hit_tokens_host`` in
``/metrics``), with the text of vLLM alone (the engine host's baseline engine, same
sampling). Waits are on the daemon's /stats and the server's metrics, never on time.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from connector.demo.presets import kvtier_transfer_config
from connector.demo.tiny_models import prompt_words
from tests.support.connector_runner import run_in_subprocess
from tests.support.daemon_proc import HostTierDaemon
from tests.support.openai_server import OpenAIServer, complete

pytestmark = pytest.mark.e2e

PROMPTS = [prompt_words(70 + i, 150) for i in range(2)]  # 4 full blocks of 32 each
PREFIX_TOKENS = 128
DEADLINE_S = 300.0  # ends a hang only


@pytest.fixture(scope="module")
def runs(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    logs = tmp_path_factory.mktemp("host-tier-server")
    daemon = HostTierDaemon(logs / "run" / "host.sock", f"dp-{uuid.uuid4().hex[:12]}",
                            slots=256, slot_bytes=64 << 10).start()
    server = OpenAIServer(
        tiny_llama_dir, logs / "dp2.log", extra_args=["--data-parallel-size", "2"],
        kv_transfer_config=kvtier_transfer_config(
            {"cpu_bytes": 16 << 20, "host_tier_socket": str(daemon.sock)}), env={})
    out: dict[str, Any] = {}
    try:
        server.start(timeout_s=600)
        # vLLM hands sequential requests to the engine cores in turn: each prompt is
        # computed by one DP rank and asked again at once, of the other one, once the
        # first rank's blocks are in the host tier.
        out["first"], out["second"] = [], []
        for i, prompt in enumerate(PROMPTS):
            out["first"].append(complete(server, prompt))
            daemon.wait_for(lambda s, n=i + 1: s["host_tier"]["commits"]
                            >= n * PREFIX_TOKENS // 32, timeout=DEADLINE_S,
                            what=f"prompt {i}'s blocks in the host tier")
            out["second"].append(complete(server, prompt))
        deadline = time.monotonic() + DEADLINE_S
        while (metrics := server.metrics()).get("vllm:kvtier_hit_tokens_host", 0) \
                < len(PROMPTS) * PREFIX_TOKENS:
            assert time.monotonic() < deadline, f"no host hits; metrics {metrics}"
            complete(server, "hi")  # shorter than a block: steps the engines, reports flow
        out["metrics"] = metrics
        out["tier"] = daemon.tier()
    except Exception:
        print(server.log_tail())
        raise
    finally:
        server.stop()
        daemon.kill()
        daemon.remove_files()
    return out


def test_dp_ranks_restore_each_others_prefixes_from_the_host_tier(
        runs: dict[str, Any], tiny_llama_dir: Path) -> None:
    for first, second in zip(runs["first"], runs["second"], strict=True):
        assert first["cached"] == 0
        assert second["cached"] == PREFIX_TOKENS
    m = runs["metrics"]
    assert m["vllm:kvtier_hit_tokens_host"] == len(PROMPTS) * PREFIX_TOKENS
    assert m.get("vllm:kvtier_hit_tokens_cpu", 0) == 0  # not the rank's own CPU tier
    assert m["vllm:kvtier_load_errors"] == 0
    # one set of slots: the ranks that restored a prefix did not store it again
    assert runs["tier"]["entries"] == len(PROMPTS) * PREFIX_TOKENS // 32
    assert runs["tier"]["duplicates_dropped"] == 0
    baseline = run_in_subprocess({"model": "llama", "extra": None, "steps": [
        ["generate", f"P{i}", p] for i, p in enumerate(PROMPTS)]})
    texts = [o["text"] for o in baseline["outputs"]]
    assert [r["text"] for r in runs["first"]] == texts
    assert [r["text"] for r in runs["second"]] == texts
