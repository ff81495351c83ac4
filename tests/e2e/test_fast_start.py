"""The engine host's fork server starts engines that compute what spawned ones compute.

The suite starts most engines' processes from a preloaded fork server
(:mod:`tests.support.fast_start`) instead of spawning them as vLLM's CPU platform does.
vLLM configures a CPU worker's OpenMP runtime through environment variables read when the
library loads; a worker forked from a server that loaded it with other settings would
compute with another thread set-up (seen: logprobs differing in the 7th digit). This test
pins the fidelity the suite depends on: the same prompts, through an engine of each kind
(from the fork server, and one whose processes vLLM spawns, as users run it, vLLM's 1 s
queue spin included), give the
same tokens and bit-identical logprobs, for the tiny Llama and the hybrid (Mamba) model.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.connector_runner import run_in_subprocess

pytestmark = pytest.mark.e2e

PROMPTS = [list(range(3, 3 + n)) for n in (40, 100, 300)]


def _outputs(model: str, spawned: bool) -> list[tuple[list[int], list[float]]]:
    steps = [["generate", f"p{i}", prompt] for i, prompt in enumerate(PROMPTS)]
    result: dict[str, Any] = run_in_subprocess(
        {"model": model, "extra": None, "steps": steps, "logprobs": True,
         "report_spin": True},
        env={"KVTIER_TEST_SPAWN": "1", "KVTIER_TEST_VLLM_SPIN": "1"} if spawned else None)
    assert result["engine_core_process"] == ("SpawnProcess" if spawned else "FastProcess")
    if spawned:  # as users run vLLM: its queue readers spin 1 s (tests/support/idle_wait.py)
        assert result["busy_loop_s"] == 1
    else:
        assert result["busy_loop_s"] == 0.02
    return [(o["token_ids"], o["logprobs"]) for o in result["outputs"]]


@pytest.mark.parametrize("model", ["llama", "hybrid"])
def test_fork_server_engine_computes_what_a_spawned_engine_computes(model: str) -> None:
    forked, spawned = _outputs(model, spawned=False), _outputs(model, spawned=True)
    assert len(forked) == len(PROMPTS) and all(len(lp) == len(t) > 0 for t, lp in forked)
    assert forked == spawned  # tokens and float logprobs, exactly
