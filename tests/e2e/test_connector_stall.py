"""Nothing in the engine's step waits on Redis: a Redis that does not answer delays only the
request whose prefix it restores.

vLLM's OpenAI server (subprocess, default executors) with kvtier, driven by concurrent
streaming HTTP requests. Redis is reached through a loopback proxy that the test holds (it
forwards nothing) while request ``A`` waits for its prefix from Redis. Everything is ordered
by events, not by seconds: ``A`` is sent once the decoding stream ``D`` streams; the proxy
is released only after kvtier has answered ``A``'s look-up "ask again" (its Redis probe is
out), a request ``B``, sent after that, has finished, and ``D`` has received 5 tokens since.
``B``'s prompt is shorter than a block: kvtier has nothing to ask Redis for it (a longer
prompt would wait for its own probe, by design). An engine step that waited on Redis would
stall ``B`` and ``D`` until the test's deadline (far below the Redis timeout) and fail.
Outputs equal those of a first engine (``LLM(...)`` with kvtier and the server's engine
settings) that computed every token (it had nothing to restore) and stored ``LONG``
(``D``'s and ``B``'s prompts are shorter than a block: nothing of theirs is stored, they
stay misses).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from connector.demo.presets import kvtier_transfer_config
from connector.demo.tiny_models import prompt_words
from rigs.openai_server import OpenAIServer
from rigs.redis_keys import scratch_prefix, wait_for_keys
from rigs.tcp_proxy import TcpProxy
from tests.support.connector_runner import run_in_subprocess

pytestmark = pytest.mark.e2e

LONG = prompt_words(71, 600)   # restored from Redis: 18 full blocks
DECODE = prompt_words(72, 20)  # the decoding stream's prompt
DECODE_TOKENS = 1000  # as many as the model's length allows; D is restarted when it ends
SHORT = prompt_words(73, 20)   # under one block (32): no hit, nothing to ask Redis
LONG_BLOCKS = 18
D_TOKENS_WHILE_HELD = 5
DEADLINE_S = 300.0  # only a hung engine reaches it (then the test fails)
REDIS_TIMEOUT_S = 900.0  # longer than any wait of the test: Redis held never times out


class Stream:
    """One streamed completion as a task, and when each of its events happened."""

    def __init__(self, client: httpx.AsyncClient, server: OpenAIServer, prompt: str,
                 max_tokens: int) -> None:
        self.arrivals: list[float] = []
        self.text = ""
        self.sent = time.monotonic()
        self.done_at: float | None = None
        self.task = asyncio.create_task(self._run(client, server, prompt, max_tokens))

    async def _run(self, client: httpx.AsyncClient, server: OpenAIServer, prompt: str,
                   max_tokens: int) -> None:
        body = {"model": str(server.model_dir), "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "stream": True, "ignore_eos": True}
        async with client.stream("POST", f"{server.base}/v1/completions", json=body,
                                 timeout=DEADLINE_S) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    self.arrivals.append(time.monotonic())
                    self.text += chunk["choices"][0]["text"]
        self.done_at = time.monotonic()

    async def finished(self) -> dict[str, Any]:
        await asyncio.wait_for(self.task, DEADLINE_S)
        return {"sent": self.sent, "arrivals": self.arrivals, "done": self.done_at,
                "text": self.text}


class DecodeChain:
    """The decoding stream ``D``, started again whenever it ends, until :meth:`finished`:
    a request is decoding for as long as the race lasts, however slow the machine (one
    stream of ``DECODE_TOKENS`` once ended before a loaded machine had finished the race).
    ``arrivals`` are every stream's tokens; the text compared with the baseline is the
    first stream's (all of it)."""

    def __init__(self, client: httpx.AsyncClient, server: OpenAIServer) -> None:
        self._client, self._server = client, server
        self.streams = [Stream(client, server, DECODE, DECODE_TOKENS)]
        self._stop = False
        self.task = asyncio.create_task(self._keep_decoding())

    async def _keep_decoding(self) -> None:
        while True:
            await self.streams[-1].task  # an HTTP error ends the chain (and fails the race)
            if self._stop:
                return
            self.streams.append(Stream(self._client, self._server, DECODE, DECODE_TOKENS))

    @property
    def arrivals(self) -> list[float]:
        return [t for stream in self.streams for t in stream.arrivals]

    async def finished(self) -> dict[str, Any]:
        """Stop restarting; the first stream in full, every stream's arrivals."""
        self._stop = True
        first = await self.streams[0].finished()
        if len(self.streams) > 1:  # a later stream is not compared: no need to wait for it
            self.task.cancel()
            self.streams[-1].task.cancel()
            await asyncio.gather(self.task, self.streams[-1].task, return_exceptions=True)
        else:
            await asyncio.wait_for(self.task, DEADLINE_S)
        return {**first, "arrivals": self.arrivals, "streams": len(self.streams)}


async def until(condition: Callable[[], Any], what: str) -> None:
    """Poll in-process state (the streams' records) until ``condition()``; the deadline only
    ends a hang."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.01)


async def probe_waits(server: OpenAIServer) -> float:
    metrics = await asyncio.to_thread(server.metrics)
    return metrics.get("vllm:kvtier_probe_waits", 0.0)


async def race(server: OpenAIServer, proxy: TcpProxy) -> dict[str, Any]:
    """D streams; A is sent; then B. ``proxy`` (kvtier's way to Redis) is held from before
    A until B has finished and D got more tokens, then released."""
    async with httpx.AsyncClient() as client:
        decode = DecodeChain(client, server)  # A starts once D streams
        await until(lambda: decode.arrivals or decode.task.done(), "D's first token")
        if not decode.arrivals:  # D ended without a token: its error, or say so
            await decode.task
            raise AssertionError("D streamed no token")
        marks: dict[str, float] = {}
        asked = await probe_waits(server)
        proxy.hold()
        restore = Stream(client, server, LONG, 4)
        deadline = time.monotonic() + DEADLINE_S
        while await probe_waits(server) <= asked:  # A's look-up: "ask again" (probe out)
            if time.monotonic() >= deadline:  # say what A's look-up did instead
                counters = await asyncio.to_thread(server.metrics)
                raise AssertionError(f"A's Redis probe never went out: {counters}")
            await asyncio.sleep(0.05)
        marks["a_waits"] = time.monotonic()
        short = Stream(client, server, SHORT, 4)
        b = await short.finished()

        def d_tokens_since_a_waits() -> int:
            return sum(t > marks["a_waits"] for t in decode.arrivals)

        await until(lambda: d_tokens_since_a_waits() >= D_TOKENS_WHILE_HELD
                    or decode.task.done(), "D's tokens while Redis is held")
        assert not restore.arrivals, "A got a token while Redis was held"
        if decode.task.done():  # only an HTTP error ends the chain: raise it
            await decode.task
        assert d_tokens_since_a_waits() >= D_TOKENS_WHILE_HELD
        marks["released"] = time.monotonic()
        proxy.release()
        return {"A": await restore.finished(), "B": b, "D": await decode.finished(), **marks}


@pytest.fixture(scope="module")
def prefix(redis_url: str) -> Iterator[str]:
    with scratch_prefix(redis_url) as name:
        yield name


@pytest.fixture(scope="module")
def runs(tiny_llama_dir: Path, redis_srv: Any, prefix: str,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``first``: an engine with kvtier (``LLM(...)``, the server's engine settings, vLLM's
    default executors) computes D, A and B greedily as the server's requests ask them
    (nothing to restore: the reference outputs) and stores LONG in Redis; ``slow``, a new
    server whose way to Redis is the held proxy, runs the race and restores LONG."""
    logs = tmp_path_factory.mktemp("stall")
    out: dict[str, Any] = {}
    extra = {"cpu_bytes": 64 << 20, "redis_prefix": prefix,
             "redis_timeout_s": REDIS_TIMEOUT_S}
    asked = {"D": (DECODE, DECODE_TOKENS), "A": (LONG, 4), "B": (SHORT, 4)}
    first = run_in_subprocess({"model": "llama", "extra": dict(extra, redis_url=redis_srv.url),
                               "steps": [["generate", name, prompt, None,
                                          {"max_tokens": tokens, "ignore_eos": True}]
                                         for name, (prompt, tokens) in asked.items()]})
    out["first"] = {o["name"]: o for o in first["outputs"]}
    wait_for_keys(redis_srv.url, prefix, LONG_BLOCKS)  # written in the background
    proxy = TcpProxy("127.0.0.1", redis_srv.port).start()
    slow = OpenAIServer(tiny_llama_dir, logs / "slow.log", kv_transfer_config=(
        kvtier_transfer_config(dict(extra, redis_url=f"redis://127.0.0.1:{proxy.port}/0"))))
    slow.start()
    try:
        out["slow"] = asyncio.run(race(slow, proxy))
        out["metrics"] = slow.metrics()
    finally:
        slow.stop()
        proxy.stop()
    return out


def test_outputs_identical_with_slow_redis(runs: dict[str, Any]) -> None:
    """Equal to the first engine's outputs, which vLLM computed whole (nothing restored)."""
    for name in ("D", "A", "B"):
        first = runs["first"][name]
        assert first["delta"].get("hit_tokens_cpu", 0) == 0, name
        assert first["delta"].get("hit_tokens_redis", 0) == 0, name
        assert runs["slow"][name]["text"] == first["text"], name


def test_restore_came_from_redis(runs: dict[str, Any]) -> None:
    m = runs["metrics"]
    assert m["vllm:kvtier_hit_tokens_redis"] >= LONG_BLOCKS * 32
    assert m["vllm:kvtier_load_errors"] == 0
    assert m.get("vllm:kvtier_probe_gave_up", 0) == 0  # A waited for its probe's answer
    assert m.get("vllm:kvtier_redis_unavailable_events", 0) == 0  # nothing timed out


def test_engine_keeps_stepping_while_a_restore_waits_on_redis(runs: dict[str, Any]) -> None:
    slow = runs["slow"]
    a_first = slow["A"]["arrivals"][0]
    held = [t for t in slow["D"]["arrivals"] if slow["a_waits"] < t < slow["released"]]
    print("KVTIER-STALL", {"held_s": round(slow["released"] - slow["a_waits"], 2),
                           "decode_tokens_while_held": len(held),
                           "restore_wait_s": round(a_first - slow["A"]["sent"], 2)})
    # A's first token came only after Redis was let through: it waited on Redis ...
    assert slow["released"] < a_first
    # ... while the decoding stream kept getting tokens, step after step ...
    assert len(held) >= D_TOKENS_WHILE_HELD
    # ... and a request without a hit, sent after A waited, finished before Redis answered.
    assert slow["a_waits"] < slow["B"]["sent"] < slow["B"]["done"] < slow["released"]
