"""Nothing in the engine's step waits on Redis: a slow Redis (a loopback proxy adding
latency to every chunk) delays only the request whose prefix it restores.

vLLM's OpenAI server (subprocess, default executors) with kvtier, driven by concurrent
streaming HTTP requests: a decoding stream ``D`` runs while request ``A`` restores a long
prefix from Redis through the slow proxy. The assertions are about order, not speed: ``D``
keeps receiving tokens while ``A`` waits for Redis, and a request ``B`` without a hit, sent
after ``A``, finishes before ``A``'s first token. Outputs equal the server without kvtier.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from connector.demo.presets import kvtier_transfer_config
from connector.demo.tiny_models import prompt_words
from tests.support.openai_server import OpenAIServer
from tests.support.redis_keys import scratch_prefix
from tests.support.tcp_proxy import TcpProxy

pytestmark = pytest.mark.e2e

LONG = prompt_words(71, 600)   # restored from Redis: 18 full blocks
DECODE = prompt_words(72, 20)  # the decoding stream's prompt
SHORT = prompt_words(73, 40)   # no hit anywhere
LATENCY_S = 0.15  # per forwarded chunk (up to 64 KiB), each way


async def stream(client: httpx.AsyncClient, server: OpenAIServer, prompt: str,
                 max_tokens: int) -> dict[str, Any]:
    """One streamed completion; the arrival time of every chunk with text."""
    body = {"model": str(server.model_dir), "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "ignore_eos": True}
    sent = time.monotonic()
    arrivals: list[float] = []
    text = ""
    async with client.stream("POST", f"{server.base}/v1/completions", json=body,
                             timeout=300) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                arrivals.append(time.monotonic())
                text += chunk["choices"][0]["text"]
    return {"sent": sent, "arrivals": arrivals, "done": time.monotonic(), "text": text}


async def warm_up(server: OpenAIServer) -> None:
    """Only LONG is stored (D and B must stay misses in the race)."""
    async with httpx.AsyncClient() as client:
        await stream(client, server, LONG, 4)


async def race(server: OpenAIServer) -> dict[str, Any]:
    async with httpx.AsyncClient() as client:
        decode = asyncio.create_task(stream(client, server, DECODE, 900))
        await asyncio.sleep(0.5)  # A starts once D is streaming
        assert not decode.done(), "the decoding stream ended before the race began"
        restore = asyncio.create_task(stream(client, server, LONG, 4))
        await asyncio.sleep(0.05)
        short = asyncio.create_task(stream(client, server, SHORT, 4))
        return {"D": await decode, "A": await restore, "B": await short}


@pytest.fixture(scope="module")
def prefix(redis_url: str) -> Iterator[str]:
    with scratch_prefix(redis_url) as name:
        yield name


@pytest.fixture(scope="module")
def runs(tiny_llama_dir: Path, redis_srv: Any, prefix: str,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    logs = tmp_path_factory.mktemp("stall")
    out: dict[str, Any] = {}
    base = OpenAIServer(tiny_llama_dir, logs / "baseline.log").start()
    try:
        out["baseline"] = asyncio.run(race(base))
    finally:
        base.stop()
    extra = {"cpu_bytes": 64 << 20, "redis_prefix": prefix, "redis_timeout_s": 10.0}
    warm = OpenAIServer(tiny_llama_dir, logs / "warm.log", kv_transfer_config=(
        kvtier_transfer_config(dict(extra, redis_url=redis_srv.url)))).start()
    try:
        asyncio.run(warm_up(warm))  # LONG's blocks go to Redis (flushed at shutdown)
    finally:
        warm.stop()
    proxy = TcpProxy("127.0.0.1", redis_srv.port).start()
    slow = OpenAIServer(tiny_llama_dir, logs / "slow.log", kv_transfer_config=(
        kvtier_transfer_config(dict(extra, redis_url=f"redis://127.0.0.1:{proxy.port}/0"))))
    slow.start()
    try:
        proxy.latency_s = LATENCY_S
        out["slow"] = asyncio.run(race(slow))
        out["metrics"] = slow.metrics()
    finally:
        slow.stop()
        proxy.stop()
    return out


def test_outputs_identical_with_slow_redis(runs: dict[str, Any]) -> None:
    for name in ("D", "A", "B"):
        assert runs["slow"][name]["text"] == runs["baseline"][name]["text"], name


def test_restore_came_from_redis(runs: dict[str, Any]) -> None:
    assert runs["metrics"]["vllm:kvtier_hit_tokens_redis"] >= 18 * 32
    assert runs["metrics"]["vllm:kvtier_load_errors"] == 0


def test_engine_keeps_stepping_while_a_restore_waits_on_redis(runs: dict[str, Any]) -> None:
    slow = runs["slow"]
    a_sent, a_first = slow["A"]["sent"], slow["A"]["arrivals"][0]
    during = [t for t in slow["D"]["arrivals"] if a_sent < t < a_first]
    print("KVTIER-STALL", {"restore_wait_s": round(a_first - a_sent, 2),
                           "decode_tokens_meanwhile": len(during),
                           "short_done_before_restore": slow["B"]["done"] < a_first})
    # The restore waited for several slow round trips (probe, then fetch) ...
    assert a_first - a_sent > 2 * LATENCY_S
    # ... while the decoding stream kept getting tokens, step after step.
    assert len(during) >= 5
    # A request without a hit, sent after A, is not held up by A's Redis traffic.
    assert slow["B"]["done"] < a_first
