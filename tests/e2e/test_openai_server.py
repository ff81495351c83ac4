"""kvtier inside vLLM's OpenAI-compatible server (a subprocess), driven over HTTP by the
``openai`` client. Two servers, each started once and reused by every test, and what they
are compared with:

* ``baseline``: vLLM alone, every prompt below (the outputs to compare with): ``LLM(...)``
  with the servers' engine settings, vLLM's default executors, greedy like the servers'
  requests (a server of its own cost a third server start and computed the same);
* ``A``: kvtier, the Redis URL from ``redis_url_env`` (a loopback proxy to the Redis).
  Streamed and non-streamed completions identical to the baseline; after
  ``/reset_prefix_cache`` the prefix comes from kvtier's CPU tier
  (``prompt_tokens_details.cached_tokens`` and ``vllm:kvtier_*``). Then the proxy refuses A
  while it computes OUTAGE (saved to its CPU tier only); once the proxy forwards again, A
  writes OUTAGE's blocks to Redis from its CPU tier (backfill);
* ``B``: kvtier at ``--data-parallel-size 2`` (two engine cores, each with its own kvtier
  scheduler and worker), started after A stored its prompts and running beside A; its
  credentials in a plain ``redis_url`` + ``redis_username`` + ``redis_password_file``.
  As a restarted server would, it restores A's prompts from Redis (its start walk found
  them); it restores a prefix A stored while both ran (learned from A's announcement, issue
  19); it restores OUTAGE, which reached Redis only by A's backfill; a prompt nobody
  stored is answered without a Redis probe; after a reset its own
  prompts come back from its CPU tiers. B also uses a host tier (``kvtier daemon
  --cpu-bytes``, issue 22): a prompt one engine core computed is restored by the other
  from the daemon's segment.

The Redis requires a password (an ACL user): the servers get it as users should give it,
outside vLLM's printed config, and it never appears in a server's log or ``/metrics``."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from connector.demo.presets import kvtier_transfer_config
from connector.demo.tiny_models import prompt_words
from rigs.daemon_proc import HostTierDaemon
from rigs.openai_server import OpenAIServer, complete
from rigs.redis_keys import scratch_prefix, wait_for_keys
from rigs.redis_server import SecretRedis
from rigs.tcp_proxy import TcpProxy
from tests.support import no_faults
from tests.support.connector_runner import run_in_subprocess

pytestmark = pytest.mark.e2e

PROMPT = prompt_words(31, 200)  # 200 tokens: 6 full blocks of 32 and a partial tail
STREAMED = prompt_words(32, 170)
PROMPT_BLOCKS, STREAMED_BLOCKS = 6, 5  # what the new server restores from Redis
SHARED = prompt_words(41, 200)  # stored by A while B runs: 6 full blocks
NOVEL = prompt_words(42, 150)  # stored by nobody
OUTAGE = prompt_words(43, 150)  # computed by A while its Redis refuses it: 4 full blocks
DP_PROMPTS = [prompt_words(90 + i, 150) for i in range(4)]
HOST_PROMPTS = [prompt_words(70 + i, 150) for i in range(2)]  # 4 full blocks each
DEADLINE_S = 300.0  # ends a hang only; every wait below is for an event


def session(server: OpenAIServer, reset_first: bool) -> dict[str, Any]:
    """Both prompts, then vLLM's prefix cache emptied and both prompts again."""
    out: dict[str, Any] = {}
    if reset_first:
        assert server.post("/reset_prefix_cache")["success"] is not False
    out["P1"] = complete(server, PROMPT)
    out["S1"] = complete(server, STREAMED, stream=True)
    assert server.post("/reset_prefix_cache")["success"] is not False
    out["P2"] = complete(server, PROMPT)
    out["S2"] = complete(server, STREAMED, stream=True)
    out["metrics"] = server.metrics()
    out["metrics_text"] = server.metrics_text()
    return out


URL_ENV = "KVTIER_TEST_SECRET_REDIS_URL"


def until(server: OpenAIServer, done: Callable[[dict[str, float]], bool]) -> dict[str, float]:
    """Step every engine core of the server (each gets a prompt shorter than a block, which
    kvtier neither looks up nor stores; reports and metrics flow) until its
    ``vllm:kvtier_*`` metrics satisfy ``done``; those metrics. Each core is named
    (``X-data-parallel-rank``): an engine core that gets no request does not step, and
    vLLM's load balancer may send every one of them to the same core."""
    cores = server.data_parallel_size
    deadline = time.monotonic() + DEADLINE_S
    while True:
        for rank in range(cores):
            complete(server, "hi", rank=rank if cores > 1 else None)
        metrics = server.metrics()
        if done(metrics):
            return metrics
        assert time.monotonic() < deadline, f"never reached; last metrics {metrics}"


def count(metrics: dict[str, float], name: str) -> float:
    return metrics.get(f"vllm:kvtier_{name}", 0)


@pytest.fixture(scope="module")
def prefix(secret_redis: SecretRedis) -> Iterator[str]:
    with scratch_prefix(secret_redis.admin_url) as name:
        yield name


def _start(name: str, logs: Path, model_dir: Path, config: dict[str, Any] | None,
           env: dict[str, str | None], extra_args: list[str] | None = None) -> OpenAIServer:
    return OpenAIServer(model_dir, logs / f"{name}.log", kv_transfer_config=config, env=env,
                        extra_args=extra_args).start(timeout_s=600)


def _baseline() -> dict[str, Any]:
    """vLLM alone: ``LLM(...)`` with the servers' engine settings
    (:func:`connector.demo.presets.engine_kwargs` is what ``OpenAIServer`` passes as flags),
    greedy, 8 tokens, every prompt below; PROMPT and STREAMED again after a reset of its
    prefix cache. The text and cached tokens of each, by the names the servers' runs use."""
    prompts = {"SHARED": SHARED, "NOVEL": NOVEL, "OUTAGE": OUTAGE,
               **{f"DP/{i}": p for i, p in enumerate(DP_PROMPTS)},
               **{f"HOST/{i}": p for i, p in enumerate(HOST_PROMPTS)}}
    steps = [["generate", "P1", PROMPT], ["generate", "S1", STREAMED], ["reset"],
             ["generate", "P2", PROMPT], ["generate", "S2", STREAMED],
             *(["generate", name, prompt] for name, prompt in prompts.items())]
    runs = {o["name"]: {"text": o["text"], "cached": o["num_cached_tokens"]}
            for o in run_in_subprocess({"model": "llama", "extra": None,
                                        "steps": steps})["outputs"]}
    out = {name: runs[name] for name in ("P1", "S1", "P2", "S2", "SHARED", "NOVEL", "OUTAGE")}
    out["DP"] = [runs[f"DP/{i}"] for i in range(len(DP_PROMPTS))]
    out["HOST"] = [runs[f"HOST/{i}"] for i in range(len(HOST_PROMPTS))]
    return out


def _a_first_request(a: OpenAIServer) -> dict[str, Any]:
    """A's very first request, once its summary of the empty prefix is synced: answered
    from the summary, without a probe."""
    until(a, lambda m: count(m, "presence_synced") == 1)
    first = complete(a, PROMPT)
    return {"P1": first, "metrics": until(a, lambda m: count(m, "lookups") >= 1)}


def _a_backfills(a: OpenAIServer, proxy: TcpProxy) -> dict[str, Any]:
    """A's Redis link reset and every new connection refused while A computes OUTAGE: each
    of its saves ends CPU-only or with a failed write (none written). The link forwards
    again: A writes them from its CPU tier (backfill), and its presence feed walks again."""
    def outcomes(m: dict[str, float]) -> float:
        return sum(count(m, k) for k in ("blocks_written_redis", "redis_write_failures",
                                         "redis_unavailable_saves"))

    # The session's writes (write-behind) have landed first: a write still in flight when
    # the link is reset fails and is backfilled too, which is not what this step counts.
    out: dict[str, Any] = {"before": until(a, lambda m: count(m, "blocks_written_redis")
                                         >= PROMPT_BLOCKS + STREAMED_BLOCKS)}
    proxy.mode = "refuse"
    proxy.reset_all()
    out["first"] = complete(a, OUTAGE)
    saved = count(out["before"], "blocks_saved") + 4
    out["down"] = until(a, lambda m: count(m, "blocks_saved") >= saved
                        and outcomes(m) - outcomes(out["before"]) >= 4)
    proxy.mode = "forward"
    planned = count(out["before"], "redis_backfills") + 4
    out["backfilled"] = until(a, lambda m: count(m, "redis_backfills") >= planned
                              and count(m, "blocks_backfilled_redis")
                              + count(m, "redis_backfill_failures")
                              >= count(m, "redis_backfills")
                              and count(m, "presence_synced") == 1)
    return out


def _b_learns_and_restores(a: OpenAIServer, b: OpenAIServer) -> dict[str, Any]:
    """Both servers up; B's summaries synced. A stores SHARED; B learns it from A's
    announcement (both engine cores) and restores it; then NOVEL, stored by nobody."""
    synced = until(b, lambda m: count(m, "presence_synced") == 2)
    out: dict[str, Any] = {"synced": synced}
    out["A-SHARED"] = complete(a, SHARED)
    out["A-written"] = until(a, lambda m: count(m, "blocks_written_redis")
                             >= PROMPT_BLOCKS + STREAMED_BLOCKS + 6)
    learned = count(synced, "presence_learned")
    out["learned"] = until(b, lambda m: count(m, "presence_learned") >= learned + 2 * 6)
    out["B-SHARED"] = complete(b, SHARED)
    out["after-shared"] = until(b, lambda m: count(m, "hit_tokens_redis")
                                > count(out["learned"], "hit_tokens_redis"))
    out["B-NOVEL"] = complete(b, NOVEL)
    out["after-novel"] = until(b, lambda m: count(m, "lookups")
                               > count(out["after-shared"], "lookups"))
    return out


def _b_restores_a_prompts(b: OpenAIServer, before: dict[str, float]) -> dict[str, Any]:
    """The restart case: PROMPT and STREAMED, which A stored before B started."""
    out = {"P1": complete(b, PROMPT), "S1": complete(b, STREAMED, stream=True)}
    out["metrics"] = until(b, lambda m: count(m, "lookups") >= count(before, "lookups") + 2)
    return out


def _b_restores_the_backfill(b: OpenAIServer, before: dict[str, float]) -> dict[str, Any]:
    """OUTAGE, whose blocks reached Redis only by A's backfill."""
    out = {"first": complete(b, OUTAGE)}
    out["metrics"] = until(b, lambda m: count(m, "lookups") >= count(before, "lookups") + 1)
    return out


def _b_data_parallel(b: OpenAIServer) -> dict[str, Any]:
    """Four new prompts, two on each engine core (pinned, as a router pins them), vLLM's
    prefix caches emptied, the four again on the same cores."""
    cores = [i % 2 for i in range(len(DP_PROMPTS))]
    out: dict[str, Any] = {"first": [complete(b, p, rank=r)
                                     for p, r in zip(DP_PROMPTS, cores, strict=True)]}
    assert b.post("/reset_prefix_cache")["success"] is not False
    before = b.metrics()  # the first pass hit nothing: the hit counters read here are final
    out["second"] = [complete(b, p, rank=r) for p, r in zip(DP_PROMPTS, cores, strict=True)]

    def restored(m: dict[str, float]) -> float:
        return count(m, "hit_tokens_cpu") + count(m, "hit_tokens_redis")

    out["metrics"] = (before, until(b, lambda m: restored(m) >= restored(before) + 4 * 128))
    return out


def _b_host_tier(b: OpenAIServer, daemon: HostTierDaemon) -> dict[str, Any]:
    """Issue 22: each HOST prompt computed by one DP rank, then asked again of the other
    rank once the first rank's blocks are in the host tier: the other rank restores it from
    there (before Redis, which has it too)."""
    def settled(m: dict[str, float]) -> bool:  # every host write so far has reached it
        t = daemon.tier()
        return t["commits"] + t["duplicates_dropped"] + t["commits_rejected"] \
            >= count(m, "blocks_written_host")

    before = until(b, settled)
    out: dict[str, Any] = {"first": [], "second": []}
    for i, prompt in enumerate(HOST_PROMPTS):
        commits = daemon.tier()["commits"]
        out["first"].append(complete(b, prompt, rank=i % 2))
        daemon.wait_for(lambda s, c=commits: s["host_tier"]["commits"] >= c + 4,
                        timeout=DEADLINE_S, what="the prompt's 4 blocks in the host tier")
        out["second"].append(complete(b, prompt, rank=(i + 1) % 2))
    out["metrics"] = (before, until(b, lambda m: count(m, "hit_tokens_host")
                                    >= count(before, "hit_tokens_host") + 2 * 128))
    out["tier"] = daemon.tier()
    return out


def _run_servers(model_dir: Path, logs: Path, secret_redis: SecretRedis, prefix: str,
                 started: list[OpenAIServer], daemon: HostTierDaemon,
                 proxy: TcpProxy) -> dict[str, Any]:
    password_file = logs / "redis-password"
    password_file.write_text(secret_redis.user_password + "\n")
    password_file.chmod(0o600)
    # No test here injects a fault: deadlines only a hung Redis reaches (no_faults; 2 s let
    # one loaded CI run time a probe out: B then computed SHARED instead of restoring it).
    common = {"cpu_bytes": 64 << 20, "redis_prefix": prefix, **no_faults.CONNECTOR}
    by_env = kvtier_transfer_config({**common, "redis_url_env": URL_ENV})
    plain_url = f"redis://127.0.0.1:{secret_redis.server.port}/0"  # no credentials in it
    by_file = kvtier_transfer_config({**common, "redis_url": plain_url,
                                      "redis_username": "kvtier",
                                      "redis_password_file": str(password_file),
                                      "host_tier_socket": str(daemon.sock)})
    out: dict[str, Any] = {"baseline": _baseline()}
    a_url = secret_redis.user_url.replace(f":{secret_redis.server.port}/", f":{proxy.port}/")
    a = _start("A", logs, model_dir, by_env, {URL_ENV: a_url})
    started.append(a)
    out["A-first"] = _a_first_request(a)
    out["A"] = session(a, reset_first=True)
    out["A-backfill"] = _a_backfills(a, proxy)
    # A's Redis writes land in the background: B starts once they are there.
    wait_for_keys(secret_redis.admin_url, prefix, PROMPT_BLOCKS + STREAMED_BLOCKS + 4)
    b = _start("B", logs, model_dir, by_file, {URL_ENV: None}, ["--data-parallel-size", "2"])
    started.append(b)
    out["presence"] = _b_learns_and_restores(a, b)
    out["B"] = _b_restores_a_prompts(b, out["presence"]["after-novel"])
    out["B-OUTAGE"] = _b_restores_the_backfill(b, out["B"]["metrics"])
    out["DP"] = _b_data_parallel(b)
    out["HOST"] = _b_host_tier(b, daemon)
    out["B"]["metrics_text"] = b.metrics_text()
    return out


@pytest.fixture(scope="module")
def runs(tiny_llama_dir: Path, secret_redis: SecretRedis, prefix: str,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    logs = tmp_path_factory.mktemp("servers")
    started: list[OpenAIServer] = []
    daemon = HostTierDaemon(logs / "run" / "host.sock", f"openai-{uuid.uuid4().hex[:12]}",
                            slots=512, slot_bytes=64 << 10).start()
    proxy = TcpProxy("127.0.0.1", secret_redis.server.port).start()
    try:
        out = _run_servers(tiny_llama_dir, logs, secret_redis, prefix, started, daemon,
                           proxy)
    except Exception:
        for server in started:
            print(server.log_tail())
        raise
    finally:
        for server in started:
            server.stop()
        daemon.kill()
        daemon.remove_files()
        proxy.stop()
    out["logs"] = {s.log_path.stem: s.log_path.read_text(errors="replace") for s in started}
    return out


def test_outputs_identical_to_vllm_without_kvtier(runs: dict[str, Any]) -> None:
    base = runs["baseline"]
    for request in ("P1", "S1", "P2", "S2"):
        assert runs["A"][request]["text"] == base[request]["text"], request
    for request in ("P1", "S1"):
        assert runs["B"][request]["text"] == base[request]["text"], request
    assert runs["A-first"]["P1"]["text"] == base["P1"]["text"]
    assert base["P2"]["cached"] == 0 and base["S2"]["cached"] == 0  # the reset emptied vLLM


def test_cpu_tier_serves_the_prefix_after_vllm_forgets_it(runs: dict[str, Any]) -> None:
    kv = runs["A"]
    assert runs["A-first"]["P1"]["cached"] == 0
    # After each reset: PROMPT (stored by A's first request), then PROMPT and STREAMED.
    assert kv["P1"]["cached"] == 192 and kv["S1"]["cached"] == 0
    assert kv["P2"]["cached"] == 192 and kv["S2"]["cached"] == 160
    metrics = kv["metrics"]
    assert metrics["vllm:kvtier_hit_tokens_cpu"] == 192 + 192 + 160
    assert metrics["vllm:kvtier_load_errors"] == 0


def test_new_server_restores_from_redis(runs: dict[str, Any]) -> None:
    """B started after A stored PROMPT and STREAMED (the restart case: a new server, an
    empty CPU tier): both restored from Redis."""
    again = runs["B"]
    assert again["P1"]["cached"] == 192 and again["S1"]["cached"] == 160
    metrics = again["metrics"]
    before = runs["presence"]["after-novel"]
    assert count(metrics, "hit_tokens_redis") - count(before, "hit_tokens_redis") == 192 + 160
    assert count(metrics, "hit_tokens_cpu") == 0
    assert count(metrics, "redis_available") == 2  # both engine cores' workers
    assert count(metrics, "failed_restores") == 0


def test_b_restores_what_a_stored_and_a_novel_prompt_waits_for_no_probe(
        runs: dict[str, Any]) -> None:
    """Issue 19: B learned of A's SHARED blocks from A's announcement (its summaries were
    synced before A stored them) and restored them; NOVEL was answered in the lookup it
    arrived with, without a Redis probe (counters, not time)."""
    first = runs["A-first"]["metrics"]
    # A's very first request came before any feed learned a key: answered at once.
    assert count(first, "presence_known_absent") == 1 and count(first, "probe_waits") == 0
    p = runs["presence"]
    assert count(p["A-written"], "probe_waits") \
        == count(runs["A-backfill"]["backfilled"], "probe_waits")
    assert p["B-SHARED"]["cached"] == 192 and p["B-SHARED"]["text"] == p["A-SHARED"]["text"]
    assert count(p["after-shared"], "hit_tokens_redis") \
        - count(p["learned"], "hit_tokens_redis") == 192
    assert count(p["after-shared"], "failed_restores") == 0
    assert p["B-NOVEL"]["cached"] == 0
    assert p["B-NOVEL"]["text"] == runs["baseline"]["NOVEL"]["text"]
    delta = {k: count(p["after-novel"], k) - count(p["after-shared"], k)
             for k in ("presence_known_absent", "probe_waits", "lookups")}
    assert delta == {"presence_known_absent": 1, "probe_waits": 0, "lookups": 1}


def test_data_parallel_engines_each_restore_from_their_cpu_tier(runs: dict[str, Any]) -> None:
    """``--data-parallel-size 2``, two prompts pinned to each engine core: after
    ``/reset_prefix_cache`` every one of them is restored by kvtier, from the CPU tier of
    the engine core that computed it, with the output of the pass that computed it."""
    first, second = runs["DP"]["first"], runs["DP"]["second"]
    before, after = runs["DP"]["metrics"]
    print("KVTIER-DP", {"cpu": count(after, "hit_tokens_cpu") - count(before, "hit_tokens_cpu"),
                        "redis": count(after, "hit_tokens_redis")
                        - count(before, "hit_tokens_redis")})
    assert [r["cached"] for r in first] == [0, 0, 0, 0]
    assert [r["cached"] for r in second] == [128, 128, 128, 128]
    assert [r["text"] for r in second] == [r["text"] for r in first]
    assert [r["text"] for r in first] == [r["text"] for r in runs["baseline"]["DP"]]
    assert count(after, "hit_tokens_cpu") - count(before, "hit_tokens_cpu") == 4 * 128
    assert count(after, "load_errors") == 0


def test_dp_ranks_restore_each_others_prefixes_from_the_host_tier(
        runs: dict[str, Any]) -> None:
    """Issue 22 at DP=2 (B also has Redis; tests/e2e/test_host_tier.py runs without): a
    prompt one engine core computed is restored by the other from the daemon's segment,
    with vLLM alone's text, and stored there once."""
    host, base = runs["HOST"], runs["baseline"]["HOST"]
    for first, second, alone in zip(host["first"], host["second"], base, strict=True):
        assert first["cached"] == 0 and second["cached"] == 128
        assert first["text"] == second["text"] == alone["text"]
    before, after = host["metrics"]
    assert count(after, "hit_tokens_host") - count(before, "hit_tokens_host") == 2 * 128
    for name in ("hit_tokens_cpu", "hit_tokens_redis", "load_errors", "host_misses_at_fetch"):
        assert count(after, name) == count(before, name), name
    assert host["tier"]["duplicates_dropped"] == 0
    assert count(after, "host_tier_available") == 2  # attached in both engine cores


def test_the_password_is_in_no_log_and_no_metric(runs: dict[str, Any],
                                                secret_redis: SecretRedis) -> None:
    """The servers stored to and restored from the password-protected Redis (above), and
    neither password appears in a server's log or ``/metrics``."""
    assert count(runs["B"]["metrics"], "hit_tokens_redis") > 0
    for name in ("A", "B"):
        assert runs["logs"][name], name
        assert secret_redis.found_in(runs["logs"][name]) == [], name
        assert secret_redis.found_in(runs[name]["metrics_text"]) == [], name
    assert URL_ENV in runs["logs"]["A"]  # vLLM printed the config: it names the variable


def test_what_a_saved_while_redis_refused_it_reaches_redis_and_b_restores_it(
        runs: dict[str, Any]) -> None:
    """A computed OUTAGE while its Redis link refused it: its 4 blocks went to the CPU tier
    and none to Redis; once the link forwarded again A wrote them from there (backfill,
    each once), and B, which never computed OUTAGE, restored them from Redis."""
    fill, base = runs["A-backfill"], runs["baseline"]["OUTAGE"]
    before, down, after = fill["before"], fill["down"], fill["backfilled"]

    def delta(m: dict[str, float], name: str, since: dict[str, float] = before) -> float:
        return count(m, name) - count(since, name)

    print("KVTIER-OPENAI-BACKFILL", {k: delta(after, k) for k in (
        "blocks_saved", "redis_write_failures", "redis_unavailable_saves",
        "blocks_written_redis", "redis_backfills", "blocks_backfilled_redis")})
    assert fill["first"]["text"] == base["text"] and fill["first"]["cached"] == 0
    assert delta(down, "blocks_saved") == 4
    assert delta(down, "blocks_written_redis") == 0
    assert delta(down, "redis_write_failures") + delta(down, "redis_unavailable_saves") == 4
    assert delta(after, "redis_backfills") == 4
    assert delta(after, "blocks_backfilled_redis") == 4
    assert delta(after, "redis_backfill_failures") == 0
    assert delta(after, "blocks_written_redis", down) == 0  # counted apart from saves
    b = runs["B-OUTAGE"]
    assert b["first"]["cached"] == 128 and b["first"]["text"] == base["text"]
    assert delta(b["metrics"], "hit_tokens_redis", runs["B"]["metrics"]) == 128
    assert count(b["metrics"], "failed_restores") == 0


def test_every_kvtier_metric_the_server_exports_has_its_help(runs: dict[str, Any]) -> None:
    """``/metrics`` of a real server: each ``vllm:kvtier_*`` family carries the HELP and the
    type kvtier documents for it (no generated placeholder), and every documented name is
    there."""
    from prometheus_client.parser import text_string_to_metric_families

    from connector.vllm_connector.stats import COUNTERS, GAUGES

    families = {f.name.removeprefix("vllm:kvtier_"): f
                for f in text_string_to_metric_families(runs["A"]["metrics_text"])
                if f.name.startswith("vllm:kvtier_")}
    # vLLM writes each counter's creation time as a gauge family of its own
    created = {f"{name}_created" for name in COUNTERS}
    assert {n: f.type for n, f in families.items() if n in created} == dict.fromkeys(created,
                                                                                  "gauge")
    families = {n: f for n, f in families.items() if n not in created}
    assert set(families) == set(COUNTERS) | set(GAUGES)
    for name, fam in families.items():
        kind, help_text = ("counter", COUNTERS[name]) if name in COUNTERS \
            else ("gauge", GAUGES[name])
        assert (fam.type, fam.documentation) == (kind, help_text), name
