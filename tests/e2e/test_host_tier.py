"""kvtier engines on one host sharing ``kvtier daemon``'s host tier, no Redis configured.

Real vLLM CPU engines (vLLM's default executors, engine core and worker in processes of
their own) on the tiny Llama, a real daemon process. Engine A computes two prompts and
exits; engine B, a new process with an empty CPU tier of its own, restores their prefixes
from the daemon's segment; a third engine given the same prefix stores nothing twice; two
TP=2 engines share a prefix shard by shard; an engine SIGKILLed mid-save leaves nothing
served; the daemon SIGKILLed under an engine; engines that reach Redis only through the
daemon (``host_tier_redis``), also while the daemon's Redis refuses it. The outputs
equal vLLM's without kvtier (the engine host's baseline engine). Waits are on the daemon's
/stats, never on time.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_py

from connector.demo.tiny_models import prompt_words
from rigs.daemon_proc import HostTierDaemon
from rigs.tcp_proxy import TcpProxy
from tests.support import no_faults
from tests.support.connector_runner import run_in_subprocess

pytestmark = pytest.mark.e2e

PROMPT_A = prompt_words(31, 150)
PROMPT_B = prompt_words(32, 150)
PROMPT_C = prompt_words(33, 150)
PROMPT_E = prompt_words(34, 150)
A2 = PROMPT_A + " w5 w6"
B2 = PROMPT_B + " w7"
C2 = PROMPT_C + " w8"
E2 = PROMPT_E + " w9"
PROMPT_F = prompt_words(35, 150)  # stored while the daemon's Redis refuses it
F2 = PROMPT_F + " w10"
PROMPT_G = prompt_words(36, 150)  # one rank's shards of one save, the other's of another
G2 = PROMPT_G + " w11"
TP2 = {"tensor_parallel_size": 2}
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
    steps = [["generate", n, p] for n, p in (("A2", A2), ("B2", B2), ("C2", C2),
                                             ("F1", PROMPT_F), ("F2", F2))]
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


@pytest.fixture(scope="module")
def killed_mid_save(tp2_runs: Any, extra: dict[str, Any], daemon: HostTierDaemon
                    ) -> dict[str, Any]:
    """An engine whose workers copy PROMPT_C's blocks into leased slots and are SIGKILLed
    before committing them (the commit is what a kill mid-save loses); its engine core is
    killed next. Returns the daemon's view once it has noticed both deaths."""
    entries_before = daemon.tier()["entries"]
    run = run_in_subprocess({"model": "llama", "extra": extra, "steps": [
        ["stop_before_host_commits"], ["generate", "C1", PROMPT_C], ["kill_engine"]]})
    tier = daemon.wait_for(lambda s: s["host_tier"]["connections"] == 0,
                           what="the daemon noticing the killed engine's processes")["host_tier"]
    return {"run": run, "tier": tier, "entries_before": entries_before}


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


@pytest.fixture(scope="module")
def tp2_runs(second: dict[str, Any], extra: dict[str, Any], daemon: HostTierDaemon
             ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two TP=2 engines, one after the other: the first computes E2 (no hit: vLLM's own
    computation at TP=2) and exits; the second, a new process, asks E2 again."""
    entries = daemon.tier()["entries"]
    first = run_in_subprocess({"model": "llama", "extra": extra, "engine": TP2,
                               "steps": [["generate", "E2", E2]]})
    written = first["stats"]["blocks_written_host"]
    daemon.wait_for(lambda s: s["host_tier"]["entries"] >= entries + written,
                    what=f"the TP=2 engine's {written} shards")
    return first, run_in_subprocess({"model": "llama", "extra": extra, "engine": TP2,
                                     "steps": [["generate", "E2", E2]]})


def test_tp2_a_new_engine_restores_every_ranks_shard_from_the_host_tier(
        tp2_runs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """At tensor_parallel_size=2 each rank stores its own shard of every block; a new
    TP=2 engine restores the prefix only with both ranks' shards, with the first engine's
    output."""
    first, second = (by_name(run)["E2"] for run in tp2_runs)
    blocks = PREFIX_TOKENS // 32  # E2's 151 tokens + 8 generated: four full blocks
    assert tp2_runs[0]["stats"]["blocks_written_host"] == 2 * blocks  # a shard per rank
    assert first["num_cached_tokens"] == 0
    assert second["delta"].get("hit_tokens_host", 0) == PREFIX_TOKENS
    assert second["num_cached_tokens"] == PREFIX_TOKENS
    assert second["token_ids"] == first["token_ids"]
    assert tp2_runs[1]["stats"]["blocks_loaded_host"] == 2 * blocks
    assert tp2_runs[1]["stats"]["load_errors"] == 0


@pytest.fixture(scope="module")
def mixed_saves(tp2_runs: Any, extra: dict[str, Any], daemon: HostTierDaemon
                ) -> dict[str, Any]:
    """Issue 43 item 1 with TP=2 engines: X's rank 1 skips its host saves (rank 0's four
    shards become entries); Y computes the same prompt (no host hit: rank 1 has none) and
    both ranks save it: rank 0's shards are duplicates of X's (dropped), rank 1's are new.
    Every rank's digest is then present, rank 0's of X's save and rank 1's of Y's. Z, a new
    TP=2 engine, asks the prompt's second turn."""
    blocks = PREFIX_TOKENS // 32
    tier = daemon.tier()
    x = run_in_subprocess({"model": "llama", "extra": extra, "engine": TP2, "steps": [
        ["skip_host_commits", 1], ["generate", "G1", PROMPT_G]]})
    daemon.wait_for(lambda s: s["host_tier"]["commits"] >= tier["commits"] + blocks,
                    what="X's rank-0 shards")
    y = run_in_subprocess({"model": "llama", "extra": extra, "engine": TP2,
                           "steps": [["generate", "G1", PROMPT_G]]})
    after_y = daemon.wait_for(
        lambda s: s["host_tier"]["commits"] >= tier["commits"] + 2 * blocks
        and s["host_tier"]["duplicates_dropped"] >= tier["duplicates_dropped"] + blocks,
        what="Y's shards: rank 1's committed, rank 0's dropped")["host_tier"]
    z = run_in_subprocess({"model": "llama", "extra": extra, "engine": TP2,
                           "steps": [["generate", "G2", G2]]})
    return {"x": x, "y": y, "z": z, "tier": tier, "after_y": after_y}


def test_tp2_shards_of_two_saves_are_never_served_as_one_block(
        mixed_saves: dict[str, Any]) -> None:
    """No host hit is assembled from shards of two saves: Z finds every rank's digest but
    of different saves, counts it, takes no token from the host tier, computes the prompt
    itself."""
    blocks = PREFIX_TOKENS // 32
    x, y, z = (by_name(mixed_saves[k]) for k in ("x", "y", "z"))
    assert x["skip_host_commits"]["result"] == [0, 1]
    assert x["G1"]["delta"].get("blocks_written_host", 0) == blocks  # rank 0's only
    assert y["G1"]["delta"].get("hit_tokens_host", 0) == 0
    assert y["G1"]["delta"].get("blocks_written_host", 0) == 2 * blocks
    assert z["G2"]["delta"].get("host_mixed_saves", 0) >= 1
    assert z["G2"]["delta"].get("hit_tokens_host", 0) == 0
    assert z["G2"]["num_cached_tokens"] == 0
    assert mixed_saves["z"]["stats"]["blocks_loaded_host"] == 0
    assert mixed_saves["z"]["stats"]["load_errors"] == 0


def test_an_engine_killed_mid_save_leaves_no_entry_and_no_lease(
        killed_mid_save: dict[str, Any]) -> None:
    """The killed engine's blocks were copied into leased slots and never committed (the
    daemon found those writes begun: the fault really hit mid-save), none became an entry,
    and every slot it leased came back, emptied."""
    runs = by_name(killed_mid_save["run"])
    assert all(runs["kill_engine"]["result"]), runs["kill_engine"]
    assert runs["C1"]["delta"].get("blocks_written_host", 0) == 0
    tier = killed_mid_save["tier"]
    assert tier["abandoned_writes"] == PREFIX_TOKENS // 32
    assert tier["entries"] == killed_mid_save["entries_before"]
    assert tier["leased_slots"] == 0
    assert tier["clients"] == 0


@pytest.fixture(scope="module")
def after_kills(killed_mid_save: dict[str, Any], extra: dict[str, Any],
                daemon: HostTierDaemon) -> dict[str, Any]:
    """A new engine: C2 (whose prefix the killed engine had half-written), then the daemon
    is SIGKILLed under it, then A2 and B2. Kills the module's daemon: its tests come last."""
    assert daemon.proc is not None
    run = run_in_subprocess({"model": "llama", "extra": extra, "steps": [
        ["generate", "C2", C2], ["kill_pid", daemon.proc.pid], ["generate", "A2", A2],
        ["generate", "B2", B2]]})
    daemon.proc.wait()
    return run


def test_after_an_engine_killed_mid_save_its_prefix_is_recomputed_identically(
        baseline: dict[str, dict[str, Any]], after_kills: dict[str, Any]) -> None:
    """Nothing of the killed engine's half-written slots is served: the next engine finds
    no entry for that prefix, recomputes it, and answers as vLLM alone does."""
    c2 = by_name(after_kills)["C2"]
    assert c2["delta"].get("hit_tokens_host", 0) == 0
    assert c2["num_cached_tokens"] == 0
    assert c2["token_ids"] == baseline["C2"]["token_ids"]
    assert c2["delta"]["blocks_written_host"] == PREFIX_TOKENS // 32


def test_the_daemon_killed_mid_run_the_engine_serves_on_with_identical_output(
        baseline: dict[str, dict[str, Any]], after_kills: dict[str, Any]) -> None:
    """The daemon is SIGKILLed under a running engine, and both prompts still come out as
    vLLM alone computes them (each restored from the segment the engine still maps, or
    recomputed: both are right)."""
    run = after_kills
    runs = by_name(run)
    killed = [o for o in run["outputs"] if o["name"].startswith("kill_pid-")]
    assert [o["result"] for o in killed] == [True]
    for name in ("A2", "B2"):
        assert runs[name]["token_ids"] == baseline[name]["token_ids"], name
    assert run["stats"]["load_errors"] == 0


# ---------------------------------------------------------------- the daemon's Redis
@pytest.fixture(scope="module")
def redis_daemons(tmp_path_factory: pytest.TempPathFactory, redis_url: str
                  ) -> Iterator[dict[str, Any]]:
    """Engines with ``host_tier_redis`` (no Redis connection of their own) on a daemon that
    holds Redis (the first daemon through a loopback proxy): engine A stores PROMPT_B and
    the daemon writes it behind; engine F stores PROMPT_F while the proxy refuses the daemon,
    whose writes fail, and once it forwards again the daemon writes them from the host tier
    (backfill). The daemon is SIGKILLed; a new daemon (an empty segment, on Redis directly)
    and a new engine asking B2 and F2 restore both from Redis."""
    sock = tmp_path_factory.mktemp("host-tier-redis") / "run" / "host.sock"
    prefix = f"kvtier-test-{uuid.uuid4().hex[:12]}"
    # No Redis fault is injected here: deadlines only a hung Redis reaches (no_faults).
    extra = {"cpu_bytes": 16 << 20, "host_tier_socket": str(sock), "host_tier_redis": True,
             "max_probe_asks": no_faults.CONNECTOR["max_probe_asks"]}
    daemons = []
    proxy = TcpProxy("127.0.0.1", int(redis_py.Redis.from_url(redis_url).connection_pool
                                      .connection_kwargs["port"])).start()

    def start(url: str) -> HostTierDaemon:
        daemons.append(HostTierDaemon(sock, f"e2e-redis-{uuid.uuid4().hex[:12]}", slots=256,
                                      slot_bytes=64 << 10, redis_url=url,
                                      redis_prefix=prefix,
                                      redis_timeout_s=no_faults.DAEMON_REDIS_TIMEOUT_S).start())
        return daemons[-1]

    try:
        first_daemon = start(proxy.url)
        stored = run_in_subprocess({"model": "llama", "extra": extra,
                                    "steps": [["generate", "B1", PROMPT_B]]})
        written = stored["stats"]["redis_saves_via_daemon"]
        first_tier = first_daemon.wait_for(
            lambda s: s["host_tier"]["redis_writes"] >= written,
            what=f"the daemon writing engine A's {written} saves behind")["host_tier"]
        proxy.mode = "refuse"
        proxy.reset_all()
        refused = run_in_subprocess({"model": "llama", "extra": extra,
                                     "steps": [["generate", "F1", PROMPT_F]]})
        more = refused["stats"]["redis_saves_via_daemon"]
        down = first_daemon.wait_for(
            lambda s: s["host_tier"]["redis_write_failures"] >= more,
            what=f"the daemon failing to write engine F's {more} saves")["host_tier"]
        proxy.mode = "forward"
        backfilled = first_daemon.wait_for(
            lambda s: s["host_tier"]["redis_backfilled"]
            + s["host_tier"]["redis_backfill_failures"] >= more,
            what="the daemon's backfill of engine F's saves")["host_tier"]
        first_daemon.kill()
        second_daemon = start(redis_url)
        # its walk of the prefix's key names found A's keys: its summary is complete
        second_daemon.wait_for(lambda s: s["host_tier"]["presence_synced"] == 1,
                               what="the new daemon's walk of the key names")
        restored = run_in_subprocess({"model": "llama", "extra": extra, "steps": [
            ["generate", "B2", B2], ["generate", "C2", C2], ["generate", "F2", F2]]})
        yield {"stored": stored, "first_tier": first_tier, "restored": restored,
               "second_tier": second_daemon.tier(), "refused": refused, "down": down,
               "backfilled": backfilled}
    finally:
        for d in daemons:
            d.kill()
            d.remove_files()
        proxy.stop()
        keys = redis_py.Redis.from_url(redis_url)
        doomed = list(keys.scan_iter(match=f"{prefix}*", count=1000))
        if doomed:
            keys.delete(*doomed)


def test_engines_on_the_daemons_redis_store_through_it_and_restore_after_it_restarts(
        baseline: dict[str, dict[str, Any]], redis_daemons: dict[str, Any]) -> None:
    """The engines open no Redis connection: their saves reach Redis through the daemon's
    write-behind, and after the daemon restarts (its segment empty) a new engine's prefix
    comes back from Redis through the daemon, with vLLM's output; a prompt nobody stored is
    answered from the daemon's presence summary, without a probe."""
    blocks = PREFIX_TOKENS // 32
    stored = redis_daemons["stored"]["stats"]
    assert stored["redis_saves_via_daemon"] == blocks == stored["blocks_written_host"]
    assert redis_daemons["first_tier"]["redis_writes"] == blocks
    assert redis_daemons["first_tier"]["redis_write_failures"] == 0
    run = by_name(redis_daemons["restored"])["B2"]
    assert run["delta"].get("hit_tokens_redis", 0) == PREFIX_TOKENS
    assert run["num_cached_tokens"] == PREFIX_TOKENS
    assert run["token_ids"] == baseline["B2"]["token_ids"]
    assert redis_daemons["restored"]["stats"]["load_errors"] == 0
    fresh = by_name(redis_daemons["restored"])["C2"]
    assert fresh["delta"].get("presence_known_absent", 0) >= 1
    assert fresh["delta"].get("probe_waits", 0) == 0  # scheduled in the step it arrived
    assert fresh["num_cached_tokens"] == 0
    assert fresh["token_ids"] == baseline["C2"]["token_ids"]
    assert redis_daemons["restored"]["stats"]["presence_learned"] >= blocks
    tier = redis_daemons["second_tier"]
    # restored into the new daemon's segment: every engine on the host now finds them there
    # (B2's blocks, and F2's: the backfill test below)
    assert tier["redis_restored"] == 2 * blocks
    assert tier["entries"] >= 2 * blocks


def test_what_the_daemon_could_not_write_while_redis_refused_it_is_backfilled(
        baseline: dict[str, dict[str, Any]], redis_daemons: dict[str, Any]) -> None:
    """Engine F's saves reached the daemon while its Redis refused every connection: each
    write failed (counted) and none was written; once Redis answered, the daemon wrote each
    from the host tier, once; after the daemon restarted empty, a new engine restored F2's
    prefix from Redis with vLLM's output."""
    blocks = PREFIX_TOKENS // 32
    refused = redis_daemons["refused"]["stats"]
    assert by_name(redis_daemons["refused"])["F1"]["token_ids"] \
        == baseline["F1"]["token_ids"]  # served on while the daemon's Redis refused it
    assert refused["redis_saves_via_daemon"] == blocks
    down, after = redis_daemons["down"], redis_daemons["backfilled"]
    first = redis_daemons["first_tier"]
    assert down["redis_write_failures"] - first["redis_write_failures"] == blocks
    assert down["redis_writes"] == first["redis_writes"]  # nothing reached Redis
    assert (after["redis_backfills"], after["redis_backfilled"]) == (blocks, blocks)
    assert after["redis_backfill_failures"] == after["redis_backfill_skipped"] == 0
    run = by_name(redis_daemons["restored"])["F2"]
    assert run["delta"].get("hit_tokens_redis", 0) == PREFIX_TOKENS
    assert run["num_cached_tokens"] == PREFIX_TOKENS
    assert run["token_ids"] == baseline["F2"]["token_ids"]
