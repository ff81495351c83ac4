"""kvtier inside vLLM's OpenAI-compatible server (a subprocess), driven over HTTP by the
``openai`` client: streamed and non-streamed completions, identical to the server without
kvtier; after ``/reset_prefix_cache`` the prefix comes from kvtier's CPU tier, after a
server restart from Redis (``prompt_tokens_details.cached_tokens`` and ``vllm:kvtier_*``).

The Redis requires a password (an ACL user): the servers get it as users should give it,
outside vLLM's printed config (``redis_url_env``; ``redis_password_file``), and it never
appears in a server's log or ``/metrics``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from connector.demo.presets import kvtier_transfer_config
from connector.demo.tiny_models import prompt_words
from tests.support.openai_server import OpenAIServer
from tests.support.redis_keys import scratch_prefix, wait_for_keys
from tests.support.redis_server import SecretRedis

pytestmark = pytest.mark.e2e

PROMPT = prompt_words(31, 200)  # 200 tokens: 6 full blocks of 32 and a partial tail
STREAMED = prompt_words(32, 170)
PROMPT_BLOCKS, STREAMED_BLOCKS = 6, 5  # what the restarted server restores from Redis


def complete(server: OpenAIServer, prompt: str, *, stream: bool = False) -> dict[str, Any]:
    """One greedy completion through the real OpenAI client; its text and cached tokens."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0,
                    timeout=120)
    model = str(server.model_dir)
    if not stream:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                        temperature=0.0)
        details = out.usage.prompt_tokens_details if out.usage else None
        return {"text": out.choices[0].text,
                "cached": (details.cached_tokens or 0) if details else 0}
    text, cached = "", 0
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                           temperature=0.0, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage and chunk.usage.prompt_tokens_details:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    return {"text": text, "cached": cached}


def session(server: OpenAIServer, reset_first: bool) -> dict[str, Any]:
    """Both prompts, then vLLM's prefix cache emptied and both prompts again."""
    out: dict[str, Any] = {}
    if reset_first:
        assert server.post("/reset_prefix_cache")["success"] is not False
    out["P1"] = complete(server, PROMPT)
    out["S1"] = complete(server, STREAMED, stream=True)
    assert server.post("/reset_prefix_cache")["success"] is not False
    out["P2"] = complete(server, PROMPT)
    out["S2"] = complete(server, STREAMED, stream=True)
    out["metrics"] = server.metrics()
    out["metrics_text"] = server.metrics_text()
    return out


URL_ENV = "KVTIER_TEST_SECRET_REDIS_URL"


@pytest.fixture(scope="module")
def prefix(secret_redis: SecretRedis) -> Iterator[str]:
    with scratch_prefix(secret_redis.admin_url) as name:
        yield name


@pytest.fixture(scope="module")
def runs(tiny_llama_dir: Path, secret_redis: SecretRedis, prefix: str,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    logs = tmp_path_factory.mktemp("servers")
    password_file = logs / "redis-password"
    password_file.write_text(secret_redis.user_password + "\n")
    password_file.chmod(0o600)
    common = {"cpu_bytes": 64 << 20, "redis_prefix": prefix, "redis_timeout_s": 2.0}
    by_env = kvtier_transfer_config({**common, "redis_url_env": URL_ENV})
    plain_url = f"redis://127.0.0.1:{secret_redis.server.port}/0"  # no credentials in it
    by_file = kvtier_transfer_config({**common, "redis_url": plain_url,
                                      "redis_username": "kvtier",
                                      "redis_password_file": str(password_file)})
    env = {URL_ENV: secret_redis.user_url}
    out: dict[str, dict[str, Any]] = {}
    for name, config in (("baseline", None), ("kvtier", by_env), ("restarted", by_file)):
        server = OpenAIServer(tiny_llama_dir, logs / f"{name}.log", kv_transfer_config=config,
                              env=env).start()
        try:
            out[name] = session(server, reset_first=False)
            if name == "kvtier":  # its Redis writes land in the background: wait for them
                wait_for_keys(secret_redis.admin_url, prefix, PROMPT_BLOCKS + STREAMED_BLOCKS)
        except Exception:
            print(server.log_tail())
            raise
        finally:
            server.stop()
        out[name]["log"] = server.log_path.read_text(errors="replace")
    return out


def test_outputs_identical_to_the_server_without_kvtier(runs: dict[str, Any]) -> None:
    base = runs["baseline"]
    for name in ("kvtier", "restarted"):
        for request in ("P1", "S1", "P2", "S2"):
            assert runs[name][request]["text"] == base[request]["text"], (name, request)
    assert base["P2"]["cached"] == 0 and base["S2"]["cached"] == 0  # the reset emptied vLLM


def test_cpu_tier_serves_the_prefix_after_vllm_forgets_it(runs: dict[str, Any]) -> None:
    kv = runs["kvtier"]
    assert kv["P1"]["cached"] == 0
    assert kv["P2"]["cached"] == 192 and kv["S2"]["cached"] == 160
    metrics = kv["metrics"]
    assert metrics["vllm:kvtier_hit_tokens_cpu"] == 192 + 160
    assert metrics["vllm:kvtier_load_errors"] == 0


def test_restarted_server_restores_from_redis(runs: dict[str, Any]) -> None:
    again = runs["restarted"]
    assert again["P1"]["cached"] == 192 and again["S1"]["cached"] == 160
    metrics = again["metrics"]
    assert metrics["vllm:kvtier_hit_tokens_redis"] == 192 + 160
    assert metrics["vllm:kvtier_redis_available"] == 1
    assert metrics["vllm:kvtier_failed_restores"] == 0


def test_the_password_is_in_no_log_and_no_metric(runs: dict[str, Any],
                                                secret_redis: SecretRedis) -> None:
    """The servers stored to and restored from the password-protected Redis (above), and
    neither password appears in a server's log or ``/metrics``."""
    assert runs["restarted"]["metrics"]["vllm:kvtier_hit_tokens_redis"] > 0
    for name in ("kvtier", "restarted"):
        assert runs[name]["log"], name
        assert secret_redis.found_in(runs[name]["log"]) == [], name
        assert secret_redis.found_in(runs[name]["metrics_text"]) == [], name
    assert URL_ENV in runs["kvtier"]["log"]  # vLLM printed the config: it names the variable


def test_data_parallel_engines_each_restore_from_their_cpu_tier(
        tiny_llama_dir: Path, tmp_path: Path, secret_redis: SecretRedis, prefix: str) -> None:
    """``--data-parallel-size 2``: two engine cores, each with its own kvtier scheduler and
    worker. Requests spread over both; after ``/reset_prefix_cache`` every one of them is
    restored by kvtier, with the output of the pass that computed everything. The Redis URL
    (password included) reaches both engine cores' processes by ``redis_url_env``."""
    prompts = [prompt_words(90 + i, 150) for i in range(4)]
    config = kvtier_transfer_config({"cpu_bytes": 64 << 20, "redis_url_env": URL_ENV,
                                     "redis_prefix": prefix, "redis_timeout_s": 2.0})
    server = OpenAIServer(tiny_llama_dir, tmp_path / "dp2.log", kv_transfer_config=config,
                          env={URL_ENV: secret_redis.user_url},
                          extra_args=["--data-parallel-size", "2"]).start(timeout_s=600)
    try:
        first = [complete(server, p) for p in prompts]
        assert server.post("/reset_prefix_cache")["success"] is not False
        second = [complete(server, p) for p in prompts]
        metrics = server.metrics()
    except Exception:
        print(server.log_tail())
        raise
    finally:
        server.stop()
    assert [r["cached"] for r in first] == [0, 0, 0, 0]
    assert [r["cached"] for r in second] == [128, 128, 128, 128]
    assert [r["text"] for r in second] == [r["text"] for r in first]
    assert metrics["vllm:kvtier_hit_tokens_cpu"] == 4 * 128
    assert metrics["vllm:kvtier_load_errors"] == 0
    assert metrics["vllm:kvtier_redis_available"] == 2  # both engine cores' workers
    assert secret_redis.found_in(server.log_path.read_text(errors="replace")) == []
