"""End to end with tensor_parallel_size=2: each chunk row of vLLM's shared primary region
holds both ranks' shares; kvtier stores the row under one key and a new TP=2 engine restores
it, outputs identical to vLLM alone at TP=2. A TP=1 engine never reads TP=2 values."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from connector.demo.tiny_models import prompt_words
from rigs.redis_keys import scratch_prefix
from tests.support import no_faults
from tests.support.engine_host import run_native_engine as run_in_subprocess

pytestmark = pytest.mark.e2e

PROMPT = prompt_words(31, 150)
PROMPT2 = PROMPT + " w8 w9"
TP2 = {"tensor_parallel_size": 2}
N = "vllm:kvtier_native_"
# This test is about the layout, not about faults: an existence check that times out is a
# miss by design, so the deadline is one only a hung Redis reaches (no_faults: 10 s was
# once not enough here, beside two other engine-running files).
SLOW_MACHINE = {"redis_timeout_s": no_faults.REDIS_TIMEOUT_S}


@pytest.fixture(scope="module")
def prefix(redis_url: str) -> Iterator[str]:
    with scratch_prefix(redis_url) as name:
        yield name


def outs(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {o["name"]: o for o in result["outputs"]}


def test_tp2_engine_restores_from_redis(tiny_llama_dir: Any, redis_url: str,
                                        prefix: str) -> None:
    base = outs(run_in_subprocess({"mode": "none", "engine": TP2,
                                   "prompts": [["P1", PROMPT], ["P2", PROMPT2]]}))
    spec = {"mode": "kvtier", "redis_url": redis_url, "redis_prefix": prefix, "engine": TP2,
            "tier": SLOW_MACHINE}
    # The cascade to Redis is counted when a later step collects it: wait for the count.
    first = run_in_subprocess({**spec, "prompts": [["P1", PROMPT]],
                               "wait_for": [[N + "stored_chunks", 4]]})
    assert outs(first)["P1"]["token_ids"] == base["P1"]["token_ids"]
    assert first["metrics"][N + "stored_chunks"] >= 4
    # A new engine's first look-up is a miss while its tier has not reached Redis yet (a
    # loaded machine delays that past the engine's start): wait for that event first.
    ready = [[N + "redis_available", 1]]
    second = run_in_subprocess({**spec, "prompts": [["P2", PROMPT2]], "wait_before": ready})
    out = outs(second)["P2"]
    assert out["token_ids"] == base["P2"]["token_ids"]
    # Both engines' counters on failure: the first one's say what reached Redis.
    counters = {"first": first["metrics"], "second": second["metrics"]}
    assert out["num_cached_tokens"] >= 128, counters
    assert second["metrics"][N + "loaded_chunks"] >= 4, counters
    tp1 = run_in_subprocess({"mode": "kvtier", "redis_url": redis_url, "redis_prefix": prefix,
                             "tier": SLOW_MACHINE, "prompts": [["P2", PROMPT2]],
                             "wait_before": ready})
    assert tp1["metrics"].get(N + "loaded_chunks", 0) == 0  # another namespace: never served
    assert outs(tp1)["P2"]["num_cached_tokens"] == 0
