"""Never KV of other weights (issue #17): engines sharing one Redis prefix, in-place weight
updates and connector resets, as RLHF flows run them (tiny Llama, vLLM's default executors).

* A, unchanged weights, resets its connector cache and serves four prompts.
* B updates its weights in place (``collective_rpc``), names them (vLLM's
  ``set_weight_version``), resets, serves the same prompts: nothing of A's is restored; then
  it resets again without renaming (a nonce) and serves them again: nothing restored, and the
  outputs equal the first pass (its own recomputation).
* C receives the same update under the same name: it restores what B stored, and its outputs
  equal B's.

Before the fix the generation was a per-process counter: A and B, one reset each, shared a
namespace and B restored A's KV.

A lagging or repeated generation (issue 43.3), one engine D with a CPU tier and Redis:

* (a) D stores prompt P, its weights are updated in place and named (``rl-v2``), vLLM's own
  prefix cache is reset (not the connector's), P is asked again: the version change alone
  moves the namespace before that step's first look-up, so nothing of the old weights is
  restored (before the fix the first look-up after the change used the old generation).
* (b) D stores P under ``named:rl-v2``, its weights are updated in place again without a new
  name and the connector cache is reset: a nonce, so the ``rl-v2`` store is not restored
  (before the fix a reset compared the version with the last reset's, not the last move's,
  and came back to ``named:rl-v2``); its output equals its own recomputation.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from connector.demo.tiny_models import prompt_words
from rigs.redis_keys import scratch_prefix
from tests.support import no_faults
from tests.support.connector_runner import run_in_subprocess

pytestmark = pytest.mark.e2e

PROMPTS = [prompt_words(70 + i, 90) for i in range(4)]  # ~5 blocks of 32 tokens each


def _serve(tag: str) -> list[list[Any]]:
    return [["generate", f"{tag}{i}", p] for i, p in enumerate(PROMPTS)]


def by_name(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {o["name"]: o for o in result["outputs"]}


@pytest.fixture(scope="module")
def runs(tiny_llama_dir: Any, redis_url: str) -> Iterator[dict[str, dict[str, Any]]]:
    with scratch_prefix(redis_url) as prefix:
        # Stores land before each generate returns; a stalled machine must not make a
        # fetch time out into a recomputed miss (no_faults).
        extra = {"cpu_bytes": 64 << 20, "redis_url": redis_url, "redis_prefix": prefix,
                 "write_mode": "through", **no_faults.CONNECTOR}
        a = run_in_subprocess({"model": "llama", "extra": extra,
                               "steps": [["reset_connector"], *_serve("a")]})
        b = run_in_subprocess({"model": "llama", "extra": extra, "steps": [
            ["perturb_weights", 1], ["weight_version", "rl-step-1"], ["reset_connector"],
            *_serve("b"), ["reset_connector"], *_serve("own")]})
        c = run_in_subprocess({"model": "llama", "extra": extra, "steps": [
            ["perturb_weights", 1], ["weight_version", "rl-step-1"], ["reset_connector"],
            *_serve("c")]})
        yield {"a": by_name(a), "b": by_name(b), "c": by_name(c)}


def test_an_updated_engine_restores_nothing_another_engine_stored(
        runs: dict[str, dict[str, Any]]) -> None:
    a, b = runs["a"], runs["b"]
    assert all(n > 0 for n in b["perturb_weights-1"]["result"])  # every worker updated
    stored = sum(a[f"a{i}"]["delta"].get("blocks_written_redis", 0) for i in range(4))
    assert stored >= 4 * 2  # A did store its prompts in the shared Redis prefix
    for i in range(4):
        first = b[f"b{i}"]
        assert first["delta"].get("hit_tokens_redis", 0) == 0, first["delta"]
        assert first["delta"].get("hit_tokens_cpu", 0) == 0
        assert first["num_cached_tokens"] == 0
        assert first["token_ids"] != a[f"a{i}"]["token_ids"]  # the weights really differ


def test_after_an_unnamed_reset_outputs_equal_the_engines_own_recomputation(
        runs: dict[str, dict[str, Any]]) -> None:
    b = runs["b"]
    for i in range(4):
        own = b[f"own{i}"]
        assert own["delta"].get("hit_tokens_redis", 0) == 0  # a nonce: nobody else's KV
        assert own["delta"].get("hit_tokens_cpu", 0) == 0  # and not its own older KV
        assert own["token_ids"] == b[f"b{i}"]["token_ids"]


def test_engines_given_the_same_named_update_share_their_kv(
        runs: dict[str, dict[str, Any]]) -> None:
    b, c = runs["b"], runs["c"]
    for i in range(4):
        hit = c[f"c{i}"]
        assert hit["delta"].get("failed_restores", 0) == 0, hit["delta"]
        assert hit["delta"].get("hit_tokens_redis", 0) >= 64, hit["delta"]
        assert hit["token_ids"] == b[f"b{i}"]["token_ids"]


P = prompt_words(91, 90)


@pytest.fixture(scope="module")
def lagging(tiny_llama_dir: Any, redis_url: str) -> Iterator[dict[str, dict[str, Any]]]:
    with scratch_prefix(redis_url) as prefix:
        extra = {"cpu_bytes": 64 << 20, "redis_url": redis_url, "redis_prefix": prefix,
                 "write_mode": "through", **no_faults.CONNECTOR}
        d = run_in_subprocess({"model": "llama", "extra": extra, "steps": [
            ["generate", "old", P],
            ["perturb_weights", 2], ["weight_version", "rl-v2"], ["reset"],
            ["generate", "v2", P],
            ["perturb_weights", 3], ["reset_connector"],
            ["generate", "again", P],
            ["reset_connector"], ["generate", "own", P]]})
        yield by_name(d)


def test_a_version_change_alone_moves_the_first_lookup_of_the_next_step(
        lagging: dict[str, dict[str, Any]]) -> None:
    old, v2 = lagging["old"], lagging["v2"]
    assert old["delta"].get("blocks_saved", 0) >= 2, old["delta"]  # P in the CPU tier
    assert old["delta"].get("blocks_written_redis", 0) >= 2  # and in Redis
    assert v2["delta"].get("hit_tokens_cpu", 0) == 0, v2["delta"]
    assert v2["delta"].get("hit_tokens_redis", 0) == 0
    assert v2["num_cached_tokens"] == 0
    assert v2["token_ids"] != old["token_ids"]  # the weights really differ


def test_a_reset_with_no_new_name_since_the_version_was_followed_restores_nothing(
        lagging: dict[str, dict[str, Any]]) -> None:
    v2, again, own = lagging["v2"], lagging["again"], lagging["own"]
    assert v2["delta"].get("blocks_written_redis", 0) >= 2, v2["delta"]  # P under rl-v2
    assert again["delta"].get("hit_tokens_redis", 0) == 0, again["delta"]
    assert again["delta"].get("hit_tokens_cpu", 0) == 0
    assert again["num_cached_tokens"] == 0
    assert again["token_ids"] != v2["token_ids"]  # updated again: other outputs
    assert own["delta"].get("hit_tokens_redis", 0) == 0
    assert again["token_ids"] == own["token_ids"]  # its own recomputation
