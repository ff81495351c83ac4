"""``kvtier demo``: a real vLLM CPU engine with kvtier, a multi-turn workload, a hit table.

Steps (each engine lifetime is its own child process, see ``connector.demo.engine``):
1. build the tiny local model if absent (cached outside the repository);
2. vLLM without kvtier: the workload on a fresh engine, then again after resetting the GPU
   prefix cache — the reference outputs and the baseline recompute cost;
3. vLLM with kvtier (``kv_connector="TieredOffloadingConnector"``): the same two passes —
   after the reset the prefix comes back from kvtier's CPU tier;
4. with Redis (or ``--host-tier``): a new engine process runs the workload once more — the
   prefix now comes from the Redis tier, or from the host tier (the engine restart is real);
5. a table: requests, prompt tokens, tokens from the GPU prefix cache / CPU tier / host tier
   / Redis tier / recomputed, TTFT p50, outputs identical to vLLM without kvtier (yes/no).

``--host-tier``: the demo also starts ``kvtier daemon --cpu-bytes`` (the host's shared CPU
tier, :mod:`connector.demo.host_daemon`) and the kvtier engines attach to it; the restarted
engine restores from it, Redis or not. The daemon and its shared memory are removed at the
end.

Redis: ``--redis-url``, else ``$KVTIER_REDIS_URL``, else a probe of redis://127.0.0.1:6379.
Unreachable → the CPU tier alone, stated in the output. Each run uses its own key prefix
and deletes its keys at the end. Exit status 0 only when every output is identical.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from connector.demo.host_daemon import DemoHostTier, HostTierStartError
from connector.demo.presets import kvtier_transfer_config
from connector.demo.reference import LABEL as REFERENCE_LABEL
from connector.demo.reference import fingerprinted, load_reference
from connector.demo.report import Row, outputs_of, render_table, summarize
from connector.demo.workload import Workload

DEFAULT_REDIS = "redis://127.0.0.1:6379"
# The variable the child engines read the Redis URL from (redis_url_env): never a file.
REDIS_URL_ENV = "KVTIER_DEMO_REDIS_URL"
FULL = Workload(conversations=4, turns=3, system_words=320, user_words=40, max_tokens=8)
QUICK = Workload(conversations=3, turns=2, system_words=200, user_words=40, max_tokens=8)
CPU_TIER_BYTES = 256 << 20
HOST_TIER_BYTES = 256 << 20
HOST_SLOT_BYTES = 1 << 20  # one rank's block of either tiny model fits


@dataclass
class RedisChoice:
    """Which Redis the demo uses, or why none."""

    url: str | None
    shown: str
    source: str
    reachable: bool
    reason: str


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _redact(url: str) -> str:
    from offload_tiers.redis.url import redact_url

    return redact_url(url)


def choose_redis(cli_url: str | None) -> RedisChoice:
    """``--redis-url`` > ``$KVTIER_REDIS_URL`` > probe of the default; ping to decide."""
    if cli_url:
        url, source = cli_url, "--redis-url"
    elif os.environ.get("KVTIER_REDIS_URL"):
        url, source = os.environ["KVTIER_REDIS_URL"], "KVTIER_REDIS_URL"
    else:
        url, source = DEFAULT_REDIS, "default probe"
    shown = _redact(url)
    try:
        import redis

        client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:  # any failure means "no Redis": the demo runs CPU-only
        reason = f"{type(exc).__name__}: {_redact(str(exc))}"
        return RedisChoice(None, shown, source, False, reason)
    return RedisChoice(url, shown, source, True, "ping ok")


def delete_redis_prefix(url: str, prefix: str) -> int:
    """Delete every key under ``{prefix}:``; returns how many (the demo cleans up after itself)."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5.0)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i:i + 500])
        return len(keys)
    finally:
        client.close()


def model_path(model: str) -> Path:
    """The tiny model's checkpoint, built first if absent (without importing torch if not)."""
    from connector.demo import tiny_models

    name = "tiny-llama" if model == "llama" else "tiny-hybrid"
    path = tiny_models.cache_root() / name
    marker = path / "kvtier-build.json"
    try:
        if json.loads(marker.read_text()).get("version") == tiny_models.BUILD_VERSION:
            return path
    except (OSError, ValueError):
        pass
    _say(f"[demo] building the tiny {model} model in {tiny_models.cache_root()} "
         "(first run only)...")
    return tiny_models.tiny_llama() if model == "llama" else tiny_models.tiny_hybrid()


def _spec(label: str, model: str, model_dir: Path, workload: Workload,
          ktc: dict[str, Any] | None, phases: list[dict[str, Any]]) -> dict[str, Any]:
    return {"label": label, "model": model, "model_dir": str(model_dir),
            "workload": asdict(workload), "kv_transfer_config": ktc, "phases": phases}


@dataclass
class Engines:
    """The engine runs of one demo: reference, kvtier's first engine, its restart."""

    base: dict[str, Any]
    reference: str
    first: dict[str, Any]
    restart: dict[str, Any] | None
    redis_prefix: str
    keys_cleaned: int
    host_tier: dict[str, Any] | None  # the daemon's statistics after the last engine


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    """Run every engine phase; return the JSON-ready result (table rows included)."""
    t_start = time.monotonic()
    workload = QUICK if args.quick else FULL
    choice = choose_redis(args.redis_url)
    if choice.reachable:
        _say(f"[demo] Redis tier: {choice.shown} (from {choice.source}), reachable")
    else:
        _say(f"[demo] Redis tier: none — {choice.shown} (from {choice.source}) is not "
             f"reachable ({choice.reason}). Running the CPU tier alone."
             + (" (and the host tier)" if args.host_tier else ""))
    model_dir = model_path(args.model)
    run_id = uuid.uuid4().hex[:10]
    host = None
    if args.host_tier:
        # with Redis the daemon holds the one Redis connection (host_tier_redis engines)
        host = DemoHostTier(run_id, HOST_TIER_BYTES, HOST_SLOT_BYTES,
                            redis_url_env=REDIS_URL_ENV if choice.url else None,
                            redis_prefix=redis_prefix(run_id), secrets=_secrets(choice))
    try:
        if host is not None:
            host.start()
            _say(f"[demo] host tier: kvtier daemon (pid {host.pid}), "
                 f"{HOST_TIER_BYTES >> 20} MiB of shared memory, socket {host.socket}"
                 + ("; it holds the Redis connection (the engines open none)"
                    if choice.url else ""))
        engines = _run_engines(args, choice, model_dir, workload, run_id, host)
    finally:
        if host is not None:
            host.stop()
    return _result(args, choice, workload, engines, time.monotonic() - t_start)


def redis_prefix(run_id: str) -> str:
    """The demo run's own Redis key prefix (its keys are deleted at the end)."""
    return f"kvtier-demo-{run_id}"


def _secrets(choice: RedisChoice) -> dict[str, str]:
    """The Redis URL (password included) for child processes' environments only: spec
    files, logs and outputs in --log-dir never hold it (vLLM prints its config)."""
    return {REDIS_URL_ENV: choice.url} if choice.url else {}


def _run_engines(args: argparse.Namespace, choice: RedisChoice, model_dir: Path,
                 workload: Workload, run_id: str, host: DemoHostTier | None) -> Engines:
    from connector.demo.engine import run_engine

    log_dir = Path(args.log_dir) if args.log_dir else None
    prefix = redis_prefix(run_id)
    secrets = _secrets(choice)
    extra: dict[str, Any] = {"cpu_bytes": CPU_TIER_BYTES, "redis_prefix": prefix}
    if host is not None:
        extra["host_tier_socket"] = host.socket
        if choice.url:
            extra["host_tier_redis"] = True  # Redis through the daemon
    elif choice.url:
        extra["redis_url_env"] = REDIS_URL_ENV
    if args.debug_corrupt_loads:  # negative control for the "identical" column (tests)
        extra["debug_corrupt_loads"] = True
    ktc = kvtier_transfer_config(extra)
    two = [{"name": "cold"}, {"name": "reset", "reset_before": True}]

    _say("[demo] 1/3 vLLM without kvtier (reference outputs)")
    ref_spec = fingerprinted(_spec(REFERENCE_LABEL, args.model, model_dir, workload, None, two))
    base, reference = None, "computed"
    if args.reference:
        base, reference = load_reference(Path(args.reference), ref_spec)
        _say(f"[demo] reference outputs: {reference}")
    if base is None:
        base = run_engine(ref_spec, log_dir=log_dir)
        reference = "computed"
    _say("[demo] 2/3 vLLM with kvtier: first run, then GPU prefix cache reset")
    first = run_engine(_spec("kvtier", args.model, model_dir, workload, ktc, two),
                       log_dir=log_dir, secrets=secrets)
    restart = None
    cleaned = 0
    try:
        if choice.reachable or host is not None:
            where = " and ".join(t for t, on in (("host tier", host is not None),
                                                 ("Redis", choice.reachable)) if on)
            _say(f"[demo] 3/3 vLLM with kvtier: engine restarted (new process), same {where}")
            restart = run_engine(
                _spec("kvtier-restart", args.model, model_dir, workload, ktc,
                      [{"name": "restart"}]), log_dir=log_dir, secrets=secrets)
        else:
            _say("[demo] 3/3 skipped: without Redis or the host tier nothing outlives the "
                 "engine process")
    finally:
        host_stats = None
        if host is not None:  # stopped first: it writes what it queued for Redis
            with contextlib.suppress(OSError):  # a daemon gone: no stats, the error stands
                host_stats = host.stats()
            host.stop()
        if choice.reachable and choice.url:
            cleaned = delete_redis_prefix(choice.url, prefix)
    return Engines(base, reference, first, restart, prefix, cleaned, host_stats)


def _result(args: argparse.Namespace, choice: RedisChoice, workload: Workload,
            engines: Engines, elapsed_s: float) -> dict[str, Any]:
    base, first, restart = engines.base, engines.first, engines.restart
    ref_cold, ref_reset = base["phases"]
    rows: list[Row] = [
        summarize("vLLM alone: fresh engine", ref_cold),
        summarize("vLLM alone: GPU prefix cache reset", ref_reset, ref_reset),
        summarize("kvtier: fresh engine", first["phases"][0], ref_cold),
        summarize("kvtier: GPU prefix cache reset", first["phases"][1], ref_reset),
    ]
    rows[0].identical = True
    rows[1].identical = outputs_of(ref_reset) == outputs_of(ref_cold)
    if restart is not None:
        # A restarted engine without kvtier is a fresh engine: compare with that.
        rows.append(summarize("kvtier: engine restarted (new process)", restart["phases"][0],
                              ref_cold))
    kvtier_rows = rows[2:]
    kvtier_counters = {
        phase["name"]: {k.removeprefix("vllm:kvtier_"): v for k, v in phase["counters"].items()
                        if k.startswith("vllm:kvtier_")}
        for phase in first["phases"] + (restart["phases"] if restart else [])
    }
    identical = all(r.identical for r in rows)
    served = {r.label: r.cpu_tokens + r.host_tokens + r.redis_tokens for r in kvtier_rows}
    mode = "+".join(t for t, on in (("cpu", True), ("host", engines.host_tier is not None),
                                    ("redis", choice.reachable)) if on)
    mode = "cpu-only" if mode == "cpu" else mode
    notes = []
    if not choice.reachable and engines.host_tier is None:
        notes.append(f"CPU tier only: no Redis reachable at {choice.shown} ({choice.reason}); "
                     "the engine-restart phase needs Redis (or --host-tier) and was skipped.")
    elif not choice.reachable:
        notes.append(f"CPU tier and host tier, no Redis: none reachable at {choice.shown} "
                     f"({choice.reason}); the restarted engine restores from the host tier.")
    return {
        "model": args.model,
        "quick": bool(args.quick),
        "mode": mode,
        "redis": {"used": choice.reachable, "url": choice.shown, "source": choice.source,
                  "detail": choice.reason,
                  "key_prefix": engines.redis_prefix if choice.reachable else None,
                  "keys_cleaned": engines.keys_cleaned},
        "host_tier": {"used": engines.host_tier is not None, "stats": engines.host_tier},
        "workload": asdict(workload),
        "rows": [r.as_dict() for r in rows],
        "outputs_identical": identical,
        "kvtier_tier_tokens": served,
        "kvtier_counters": kvtier_counters,
        "startup_s": {"vllm-alone": base["startup_s"] if engines.reference == "computed"
                      else None,
                      "kvtier": first["startup_s"],
                      "kvtier-restart": restart["startup_s"] if restart else None},
        "reference": engines.reference,
        "elapsed_s": elapsed_s,
        "notes": notes,
    }


def _print_result(result: dict[str, Any]) -> None:
    rows = [Row(**r) for r in result["rows"]]
    w = result["workload"]
    print()
    print(f"kvtier demo — tiny {result['model']} on vLLM (CPU), {w['conversations']} "
          f"conversations x {w['turns']} turns, {w['system_words']}-token shared system "
          f"prompt, greedy, {w['max_tokens']} new tokens per turn")
    host = result.get("host_tier") or {}
    if result["redis"]["used"]:
        print(f"tiers: CPU + {'host tier + ' if host.get('used') else ''}Redis "
              f"({result['redis']['url']}, key prefix {result['redis']['key_prefix']}, "
              f"{result['redis']['keys_cleaned']} keys deleted afterwards)")
    elif host.get("used"):
        print("tiers: CPU + host tier — " + result["notes"][0])
    else:
        print("tiers: CPU ONLY — " + result["notes"][0])
    if host.get("used"):
        st = host["stats"]
        print(f"host tier (kvtier daemon, shared memory, removed afterwards): {st['entries']} "
              f"entries in {st['num_slots']} slots, {st['bytes_used'] / (1 << 20):.1f} MiB, "
              f"{st['commits']} saves committed, {st['duplicates_dropped']} duplicates "
              "dropped" + (f"; it wrote {st['redis_writes']} of them to Redis (the engines "
                           "hold no Redis connection)" if st.get("redis") else ""))
    print()
    print(render_table(rows, host_column=bool(host.get("used"))))
    print()
    for phase, counters in result.get("kvtier_counters", {}).items():
        if phase != "cold" and counters:
            shown = ", ".join(f"{k}={int(v)}" for k, v in counters.items()
                              if not k.startswith(("bytes_", "events_")))
            print(f"kvtier counters, {phase} pass: {shown}")
    starts = result.get("startup_s", {})
    shown = ", ".join(f"{name} {secs:.0f} s" for name, secs in starts.items() if secs)
    print(f"engine start (vLLM's default executors: engine core and worker in their own "
          f"processes): {shown}")
    print("identical = greedy outputs equal vLLM's without kvtier: "
          + ("yes, all" if result["outputs_identical"] else "NO — see the rows marked NO"))
    print(f"total {result['elapsed_s']:.0f} s")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier demo",
        description="Run a real vLLM CPU engine with kvtier on a multi-turn shared-prefix "
                    "workload, across a GPU prefix-cache reset and an engine restart.")
    parser.add_argument("--model", choices=("llama", "hybrid"), default="llama",
                        help="tiny Llama (one KV group) or tiny Mamba+attention hybrid "
                             "(partial prefix entries)")
    parser.add_argument("--quick", action="store_true", help="a smaller workload")
    parser.add_argument("--redis-url", default=None,
                        help=f"Redis for the shared tier (default: $KVTIER_REDIS_URL, else "
                             f"probe {DEFAULT_REDIS}); unreachable → CPU tier only")
    parser.add_argument("--host-tier", action="store_true",
                        help="also start kvtier daemon --cpu-bytes (the host's shared CPU "
                             "tier); the restarted engine restores from it, Redis or not")
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                        help="also write the table and details as JSON")
    parser.add_argument("--log-dir", default=None,
                        help="keep engine logs here (default: a temporary directory)")
    parser.add_argument("--reference", default=None, metavar="DIR",
                        help="reuse the vLLM-alone outputs kept in an earlier run's --log-dir "
                             "when its model files, vLLM release and workload are this run's "
                             "(else they are recomputed)")
    parser.add_argument("--debug-corrupt-loads", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from connector.demo.engine import EngineRunError

    try:
        result = run_demo(args)
    except (EngineRunError, HostTierStartError) as exc:
        _say(f"[demo] failed: {exc}")
        return 1
    _print_result(result)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    return 0 if result["outputs_identical"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
