"""kvtier starts, and restores a prefix, when num_blocks equals another KV dimension.

Issue #17 (finding 4): the CPU attention tensor is ``[num_blocks, kv_heads, block_size,
2*head_dim]``; with ``num_gpu_blocks_override`` equal to the block size (32) two dimensions
have the size num_blocks, and a layout guessed from sizes refused the engine. The layout
now comes from what vLLM declares (:mod:`connector.vllm_connector.declared_layout`).

One engine process with vLLM's default executors. The reference output is computed by the
same engine with nothing to restore: the same prompt under another ``cache_salt`` (another
prefix-cache namespace in vLLM and in kvtier) is a full recomputation, exactly what an
engine without kvtier computes.
"""

from __future__ import annotations

from typing import Any

import pytest

from connector.demo.tiny_models import prompt_words
from tests.support.connector_runner import run_in_subprocess

pytestmark = pytest.mark.e2e

BLOCK_SIZE = 32
PROMPT = prompt_words(21, 150)
LONGER = PROMPT + " w5 w6"


def test_num_blocks_equal_to_block_size_starts_and_restores_from_cpu_tier(
        tiny_llama_dir: Any) -> None:
    steps = [["generate", "first", PROMPT, "tenant-a"], ["reset"],
             ["generate", "restored", LONGER, "tenant-a"],
             ["generate", "recomputed", LONGER, "tenant-b"]]
    result = run_in_subprocess({
        "model": "llama", "extra": {"cpu_bytes": 16 << 20}, "steps": steps,
        "engine": {"block_size": BLOCK_SIZE, "num_gpu_blocks_override": BLOCK_SIZE,
                   "max_model_len": 512}})
    runs = {o["name"]: o for o in result["outputs"]}
    restored, recomputed = runs["restored"], runs["recomputed"]
    print("KVTIER-LAYOUT-SUMMARY", {n: (r["delta"].get("hit_tokens_cpu", 0),
                                        r["num_cached_tokens"]) for n, r in runs.items()})
    # After reset_prefix_cache() vLLM's cache is empty: the 4 full blocks come from kvtier.
    assert restored["delta"].get("hit_tokens_cpu", 0) == 4 * BLOCK_SIZE
    assert restored["delta"].get("blocks_loaded_cpu", 0) == 4
    assert restored["num_cached_tokens"] == 4 * BLOCK_SIZE
    assert recomputed["delta"].get("hit_tokens_cpu", 0) == 0
    assert recomputed["num_cached_tokens"] == 0
    assert restored["prompt_tokens"] == recomputed["prompt_tokens"] > 4 * BLOCK_SIZE
    assert restored["token_ids"] == recomputed["token_ids"]
    assert result["stats"]["load_errors"] == 0
