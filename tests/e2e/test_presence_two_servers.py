"""Two OpenAI servers with kvtier running at once on one Redis (issue 19): server B restores
a prefix that server A stored moments earlier (B learned it from A's announcement, not by
asking Redis per request), with A's output; and a prompt no engine stored is scheduled in
the step it arrives, without a Redis probe (asserted from B's own counters)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from connector.demo.presets import kvtier_transfer_config
from connector.demo.tiny_models import prompt_words
from tests.e2e.test_openai_server import complete
from tests.support.openai_server import OpenAIServer
from tests.support.redis_keys import scratch_prefix

pytestmark = pytest.mark.e2e

PROMPT = prompt_words(41, 200)  # 6 full blocks of 32 (and a tail vLLM does not register)
NOVEL = prompt_words(42, 150)
DEADLINE_S = 300.0  # ends a hang only; every wait below is for an event


def _poke(server: OpenAIServer) -> None:
    """A prompt shorter than one block: the engine steps (reports and metrics flow), kvtier
    neither looks it up nor stores it."""
    complete(server, "hi")


def _until(server: OpenAIServer, done: Callable[[dict[str, float]], bool]) -> dict[str, float]:
    import time

    deadline = time.monotonic() + DEADLINE_S
    while True:
        _poke(server)
        metrics = server.metrics()
        if done(metrics):
            return metrics
        assert time.monotonic() < deadline, f"never reached; last metrics {metrics}"


@pytest.fixture(scope="module")
def servers(tiny_llama_dir: Path, redis_url: str,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, OpenAIServer]]:
    logs = tmp_path_factory.mktemp("presence")
    with scratch_prefix(redis_url) as prefix:
        config = kvtier_transfer_config({"cpu_bytes": 64 << 20, "redis_url": redis_url,
                                         "redis_prefix": prefix})
        started: dict[str, OpenAIServer] = {}
        try:
            for name in ("A", "B"):
                started[name] = OpenAIServer(tiny_llama_dir, logs / f"{name}.log",
                                             kv_transfer_config=config).start()
            yield started
        except Exception:
            for server in started.values():
                print(server.log_tail())
            raise
        finally:
            for server in started.values():
                server.stop()


def test_b_restores_what_a_stored_and_a_novel_prompt_waits_for_no_probe(
        servers: dict[str, OpenAIServer]) -> None:
    a, b = servers["A"], servers["B"]
    # B's summary is synced (its walk of the empty prefix is done) before A stores anything:
    # what it learns of A's blocks comes from A's announcements.
    _until(b, lambda m: m.get("vllm:kvtier_presence_synced") == 1)
    learned_before = b.metrics().get("vllm:kvtier_presence_learned", 0)
    first = complete(a, PROMPT)
    assert first["cached"] == 0
    written = _until(a, lambda m: m.get("vllm:kvtier_blocks_written_redis", 0) >= 6)
    assert written["vllm:kvtier_blocks_written_redis"] == 6
    # A's first request came before any feed learned a key: answered at once, no probe
    assert written["vllm:kvtier_presence_known_absent"] == 1
    assert written["vllm:kvtier_probe_waits"] == 0
    _until(b, lambda m: m.get("vllm:kvtier_presence_learned", 0) >= learned_before + 6)

    restored = complete(b, PROMPT)
    assert restored["cached"] == 192 and restored["text"] == first["text"]
    after_restore = _until(b, lambda m: m.get("vllm:kvtier_hit_tokens_redis", 0) > 0)
    assert after_restore["vllm:kvtier_hit_tokens_redis"] == 192
    assert after_restore["vllm:kvtier_failed_restores"] == 0

    novel = complete(b, NOVEL)
    assert novel["cached"] == 0
    after_novel = _until(b, lambda m: m.get("vllm:kvtier_lookups", 0)
                         > after_restore["vllm:kvtier_lookups"])
    delta: dict[str, Any] = {k: after_novel.get(k, 0) - after_restore.get(k, 0)
                             for k in ("vllm:kvtier_presence_known_absent",
                                       "vllm:kvtier_probe_waits", "vllm:kvtier_lookups")}
    assert delta == {"vllm:kvtier_presence_known_absent": 1, "vllm:kvtier_probe_waits": 0,
                     "vllm:kvtier_lookups": 1}
