"""kvtier engines on one host sharing ``kvtier daemon``'s host tier, no Redis configured.

Real vLLM CPU engines (vLLM's default executors, engine core and worker in processes of
their own) on the tiny Llama, a real daemon process. Engine A computes two prompts and
exits; engine B, a new process with an empty CPU tier of its own, restores their prefixes
from the daemon's segment; a third engine given the same prefix stores nothing twice. The
outputs equal vLLM's without kvtier (the engine host's baseline engine). Waits are on the
daemon's /stats, never on time.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from connector.demo.tiny_models import prompt_words
from tests.support.connector_runner import run_in_subprocess
from tests.support.daemon_proc import HostTierDaemon

pytestmark = pytest.mark.e2e

PROMPT_A = prompt_words(31, 150)
PROMPT_B = prompt_words(32, 150)
A2 = PROMPT_A + " w5 w6"
B2 = PROMPT_B + " w7"
PREFIX_TOKENS = 128  # the four full 32-token blocks each prompt shares with its turn 2


def by_name(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {o["name"]: o for o in result["outputs"]}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostTierDaemon]:
    sock = tmp_path_factory.mktemp("host-tier") / "run" / "host.sock"
    proc = HostTierDaemon(sock, f"e2e-{uuid.uuid4().hex[:12]}", slots=256,
                          slot_bytes=64 << 10).start()
    try:
        yield proc
    finally:
        proc.kill()
        proc.remove_files()


@pytest.fixture(scope="module")
def extra(daemon: HostTierDaemon) -> dict[str, Any]:
    return {"cpu_bytes": 16 << 20, "host_tier_socket": str(daemon.sock)}


@pytest.fixture(scope="module")
def baseline(tiny_llama_dir: Path) -> dict[str, dict[str, Any]]:
    steps = [["generate", n, p] for n, p in (("A2", A2), ("B2", B2))]
    return by_name(run_in_subprocess({"model": "llama", "extra": None, "steps": steps}))


@pytest.fixture(scope="module")
def first(tiny_llama_dir: Path, extra: dict[str, Any], daemon: HostTierDaemon
          ) -> dict[str, Any]:
    run = run_in_subprocess({"model": "llama", "extra": extra, "steps": [
        ["generate", "A1", PROMPT_A], ["generate", "B1", PROMPT_B]]})
    written = run["stats"]["blocks_written_host"]
    daemon.wait_for(lambda s: s["host_tier"]["commits"] >= written,
                    what=f"engine A's {written} host-tier commits")
    return run


@pytest.fixture(scope="module")
def second(first: dict[str, Any], extra: dict[str, Any], daemon: HostTierDaemon
           ) -> dict[str, Any]:
    return run_in_subprocess({"model": "llama", "extra": extra, "steps": [
        ["generate", "A2", A2], ["generate", "B2", B2]]})


def test_engine_a_stores_its_blocks_in_the_host_tier(first: dict[str, Any],
                                                     daemon: HostTierDaemon) -> None:
    stats = first["stats"]
    assert stats["blocks_written_host"] == 2 * PREFIX_TOKENS // 32
    assert stats["host_store_drops"] == 0
    tier = daemon.tier()
    assert tier["entries"] == stats["blocks_written_host"] == tier["commits"]
    assert tier["commits_rejected"] == 0


def test_a_new_engine_restores_from_the_host_tier_with_identical_output(
        baseline: dict[str, dict[str, Any]], second: dict[str, Any]) -> None:
    runs = by_name(second)
    for name in ("A2", "B2"):
        assert runs[name]["delta"].get("hit_tokens_host", 0) == PREFIX_TOKENS, name
        assert runs[name]["delta"].get("hit_tokens_cpu", 0) == 0, name
        assert runs[name]["num_cached_tokens"] == PREFIX_TOKENS, name
        assert runs[name]["token_ids"] == baseline[name]["token_ids"], name
    assert second["stats"]["blocks_loaded_host"] == 2 * PREFIX_TOKENS // 32
    assert second["stats"]["host_misses_at_fetch"] == 0
    assert second["stats"]["load_errors"] == 0


def test_a_prefix_in_the_host_tier_is_not_stored_again(
        first: dict[str, Any], second: dict[str, Any], daemon: HostTierDaemon) -> None:
    """Two engines hold the prefix (both computed or restored it): one set of slots."""
    assert second["stats"]["blocks_written_host"] == 0
    tier = daemon.tier()
    assert tier["entries"] == first["stats"]["blocks_written_host"]
    assert tier["duplicates_dropped"] == 0


def test_the_daemon_killed_mid_run_the_engine_serves_on_with_identical_output(
        baseline: dict[str, dict[str, Any]], second: dict[str, Any], extra: dict[str, Any],
        daemon: HostTierDaemon) -> None:
    """Last in this file: it kills the module's daemon. A new engine attaches, the daemon is
    SIGKILLed under it, and both prompts still come out as vLLM alone computes them (each
    restored from the segment the engine still maps, or recomputed: both are right)."""
    assert daemon.proc is not None
    run = run_in_subprocess({"model": "llama", "extra": extra, "steps": [
        ["kill_pid", daemon.proc.pid], ["generate", "A2", A2], ["generate", "B2", B2]]})
    runs = by_name(run)
    assert runs[f"kill_pid-{daemon.proc.pid}"]["result"] is True
    for name in ("A2", "B2"):
        assert runs[name]["token_ids"] == baseline[name]["token_ids"], name
    assert run["stats"]["load_errors"] == 0
    daemon.proc.wait()
