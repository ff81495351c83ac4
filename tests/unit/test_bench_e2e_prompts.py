"""bench_e2e's no-hit passes really share no prefix: with each other, the warm-up, the
shared workload (the tiny vocabulary makes prompt seeds repeat every PROMPT_SEED_PERIOD)."""

from __future__ import annotations

import pytest

from benchmarks.bench_e2e import MAX_NOHIT_PASSES, QUICK, nohit_phase
from connector.demo.tiny_models import PROMPT_SEED_PERIOD, prompt_words
from connector.demo.workload import Workload

BLOCK = 32  # the tiny Llama's block; a prefix hit needs one whole block in common


def _first_blocks(workload: Workload) -> list[str]:
    return [prompt_words(workload.system_seed(c), BLOCK) for c in range(workload.conversations)]


def test_seeds_one_period_apart_repeat_the_prompt() -> None:
    assert prompt_words(20, BLOCK) == prompt_words(20 + PROMPT_SEED_PERIOD, BLOCK)
    assert prompt_words(20, BLOCK) != prompt_words(21, BLOCK)


def test_every_no_hit_prompt_starts_with_a_block_of_its_own() -> None:
    seen = set(_first_blocks(QUICK))
    assert len(seen) == 1  # the shared workload: one system prompt
    for index in range(MAX_NOHIT_PASSES):
        blocks = _first_blocks(Workload(**nohit_phase(f"p{index}", index)["workload"]))
        assert not seen & set(blocks), f"pass {index} repeats an earlier prompt"
        assert len(set(blocks)) == len(blocks)
        seen.update(blocks)


def test_a_pass_beyond_the_distinct_ones_is_refused() -> None:
    with pytest.raises(ValueError, match="prompts of their own"):
        nohit_phase("too-many", MAX_NOHIT_PASSES)
