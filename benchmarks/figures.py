"""The figures README.md and docs quote, rendered from the benchmarks' JSON (no hand copy).

``make bench`` runs every benchmark with ``--json benchmarks/results/NAME.json``, stamps each
file with when and how it was measured (``stamp``), then ``render`` rewrites every span

    <!-- figures:NAME -->...<!-- /figures:NAME -->

in README.md, docs/*.md and RELIABILITY.md from those files. ``check`` (run by the test
suite) fails when a span differs from what the committed JSON renders to: a figure cannot
drift from its run; and when a JSON's stamp lacks a field of ``STAMP_FIELDS`` (the date,
the command, the load and the commit it measured). A span rendered from several JSON files
names each run's stamp where they differ (``when_runs``): runs are never mixed silently.

    python -m benchmarks.figures stamp benchmarks/results/events.json -- CMD...
    python -m benchmarks.figures render          # rewrite the spans
    python -m benchmarks.figures check           # exit 1 and name the stale spans
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.paired import paired_ratio

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DOCUMENTS = ("README.md", "docs/benchmarks.md", "docs/connector.md", "docs/daemon.md",
             "docs/tiers.md", "docs/benchmarks-e2e.md", "docs/native-tier.md", "docs/audit.md",
             "docs/limits.md", "RELIABILITY.md", "docs/lmcache.md")
#: what every JSON under benchmarks/results records in ``_measured`` (``stamp`` writes them)
STAMP_FIELDS = ("date", "command", "load_avg", "commit")
SPAN = re.compile(r"<!-- figures:(?P<name>[\w-]+) -->(?P<body>.*?)<!-- /figures:(?P=name) -->",
                  re.S)


def x(value: float | None) -> str:
    """A ratio as the README writes it."""
    return "n/a" if value is None else f"{value:.2f}×"


def pct(value: float | None) -> str:
    """``0.064`` -> ``+6.4 %``."""
    return "n/a" if value is None else f"{value * 100:+.1f} %"


def when(data: dict[str, Any]) -> str:
    meta = data.get("_measured", {})
    return f"{meta.get('date', 'undated')}, load {meta.get('load_avg', '?')}"


def when_runs(*runs: tuple[str, dict[str, Any]]) -> str:
    """``when`` for a figure made of several runs: once when they share a date, load and
    commit; else each group of runs with its own stamp (the figure mixes runs, and says so)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for label, data in runs:
        commit = str(data.get("_measured", {}).get("commit", "?"))
        groups.setdefault((when(data), commit), []).append(label)
    if len(groups) == 1:
        return when(runs[0][1])
    return "separate runs: " + "; ".join(
        f"{', '.join(labels)} {stamp_}, commit {_short_commit(commit)}"
        for (stamp_, commit), labels in groups.items())


def _short_commit(commit: str) -> str:
    """A stamp's commit as a reader needs it: the hash, or where an old result came in."""
    if commit.startswith("unrecorded"):
        return "unrecorded (results committed in " + commit.rsplit(" ", 1)[-1].rstrip(")") + ")"
    return commit


def events(d: dict[str, Any]) -> str:
    r = d["ratios"]
    return (f"decode+classify+index {d['hashes_per_s'] / 1e6:.2f} M hash updates/s; "
            f"{x(r['ingest_vs_decode_floor'])} the msgspec decode floor; "
            f"{x(r['ingest_vs_naive'])} a naive dict/set consumer; "
            f"{d['bytes_per_entry']:.0f} bytes per index entry ({when(d)})")


def index_memory(d: dict[str, Any]) -> str:
    bpe = d["bytes_per_entry"]
    shared = d.get("bytes_per_entry_8_engines_same_blocks")
    also = "" if shared is None else (f"; {shared:.0f} bytes when 8 engines hold the same "
                                      f"blocks (one node per block)")
    return (f"{bpe:.0f} bytes per resident index entry (tracemalloc, "
            f"`benchmarks/bench_events.py`, {when(d)}): 10 M entries ≈ {bpe * 1e7 / 1e9:.1f} GB"
            f"{also}")


def events_table(d: dict[str, Any]) -> str:
    rates, floor = d["rates"], d["rates"]["decode_floor"]
    rows = [("msgspec decode into vLLM's schema (the floor)", "decode_floor"),
            ("kvtier's hot-path decoder alone", "kvtier_decoder_only"),
            ("**kvtier ingest (decode + classify + refcounted index)**", "kvtier_ingest"),
            ("naive (untyped decode to dicts + a `set`)", "naive")]
    lines = [f"\n`python -m benchmarks.bench_events` ({d['batches']:,} batches, "
             f"{d['updates']:,} hash updates, best of {d['reps']}, one core; {when(d)}):\n",
             "| consumer | hash updates/s | vs decode floor |", "|---|---|---|"]
    lines += [f"| {label} | {rates[key] / 1e6:.2f} M | {rates[key] / floor:.2f} |"
              for label, key in rows]
    return "\n".join(lines) + "\n"


def tiers_table(d: dict[str, Any]) -> str:
    lines = [f"\n`python -m benchmarks.bench_tiers` ({when(d)}):\n",
             "| shape | kvtier | GB/s | vs | GB/s | ratio |",
             "| --- | --- | ---: | --- | ---: | ---: |"]
    for shape, r in d["shapes"].items():
        c, t, rb = r["cpu"], r["redis"], r["redis_benchmark"]
        rows = [("CPU put", c["tier_put_gbps"], "numpy.copyto", c["memcpy_put_gbps"]),
                ("CPU get (read_into)", c["tier_get_gbps"], "numpy.copyto",
                 c["memcpy_get_gbps"]),
                ("Redis put_many", t["tier_put_gbps"], "redis-py pipelined SET",
                 t["raw_put_gbps"]),
                ("Redis get_many", t["tier_get_gbps"], "redis-py pipelined GET",
                 t["raw_get_gbps"]),
                ("Redis get_many_into", t["tier_get_into_gbps"], "redis-py pipelined GET",
                 t["raw_get_gbps"])]
        if "set_gbps" in rb:
            rows += [("Redis put_many", t["tier_put_gbps"], "redis-benchmark SET",
                      rb["set_gbps"]),
                     ("Redis get_many_into", t["tier_get_into_gbps"], "redis-benchmark GET",
                      rb["get_gbps"])]
        lines += [f"| {shape} | {name} | {mine:.2f} | {peer} | {other:.2f} | "
                  f"{mine / other:.2f} |" for name, mine, peer, other in rows]
    return "\n".join(lines) + "\n"


def tiers(d: dict[str, Any]) -> str:
    by_shape = d["ratios_by_shape"]
    big, small = by_shape["block_2MiB"], min(
        (v for k, v in by_shape.items() if k != "block_2MiB"),
        key=lambda v: v.get("redis_get_vs_server_limit", 1.0))
    parts = [f"CPU tier put/get {x(big['cpu_put_vs_memcpy'])} / "
             f"{x(big['cpu_get_vs_memcpy'])} memcpy (2 MiB blocks)"]
    if "redis_put_vs_server_limit" in d["ratios"]:
        parts.append(f"Redis tier vs `redis-benchmark` on the same server, worst shape: "
                     f"put_many {x(d['ratios']['redis_put_vs_server_limit'])}, "
                     f"get_many_into {x(d['ratios']['redis_get_vs_server_limit'])}")
    parts.append(f"vs raw redis-py pipelines (2 MiB / worst shape): put "
                 f"{x(big['redis_put_vs_raw'])} / {x(small['redis_put_vs_raw'])}, get "
                 f"{x(big['redis_get_vs_raw'])} / {x(small['redis_get_vs_raw'])}")
    if "redis_put_vs_lmcache" in big:
        parts.append(f"LMCache's Redis backend: put {x(big['redis_put_vs_lmcache'])}, get "
                     f"{x(big['redis_get_vs_lmcache'])} (2 MiB)")
    return "; ".join(parts) + f" ({when(d)})"


def audit(d: dict[str, Any]) -> str:
    k = d["kvtier"]
    return (f"{d['files']:,} files in {d['seconds']:.2f} s best / {d['seconds_median']:.2f} s "
            f"median; {x(d['ratios']['time_vs_ruff'])} ruff's time on the same tree; "
            f"{k['errors']} errors, {k['warnings']} warnings, {k['info']} info ({when(d)})")


def audit_tree(d: dict[str, Any]) -> str:
    """RELIABILITY's row for the whole vLLM tree: counts and times of one bench_audit run."""
    k, r = d["kvtier"], d["ruff"]
    return (f"{d['files']:,} files, {d['parsed']} parsed, {k['errors']} errors, "
            f"{k['warnings']} warnings, {k['info']} info; {d['seconds']:.2f} s best / "
            f"{d['seconds_median']:.2f} s median on {d['cpus']} shared CPUs against ruff E,F's "
            f"{r['seconds']:.2f} / {r['seconds_median']:.2f} s "
            f"({x(d['ratios']['time_vs_ruff'])} ruff's best time, "
            f"{x(d['ratios']['median_time_vs_ruff'])} its median; `{d['_measured']['command']}`, "
            f"{d['repeat']} runs, {when(d)})")


def audit_parsed(d: dict[str, Any]) -> str:
    return f"{d['parsed']} of {d['files']:,} files are parsed"


def audit_findings(d: dict[str, Any]) -> str:
    k = d["kvtier"]
    return (f"{d['files']:,} files, {d['parsed']} mention `block_hash`, **{k['errors']} errors, "
            f"{k['warnings']} warnings, {k['info']} info** (`benchmarks/results/audit.json`, "
            f"{when(d)})")


def audit_table(d: dict[str, Any]) -> str:
    """docs/audit.md's benchmark table and what grep's lines were."""
    k, r, g = d["kvtier"], d["ruff"], d["grep"]
    ruff_best = r["seconds"]
    rows = [("kvtier audit", d["seconds"], d["seconds_median"],
             f"{k['errors']} E / {k['warnings']} W / {k['info']} I"),
            ("ruff check E,F", ruff_best, r["seconds_median"], f"{r['findings']:,}"),
            ("grep presence", g["seconds"], None, f"{g['hits']} lines")]
    lines = [f"\n`{d['_measured']['command']}` ({d['repeat']} runs, {d['cpus']} CPUs, "
             f"{when(d)}):\n", "| tool | best s | median s | files/s (best) | × ruff (best) | "
             "findings |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {name} | {best:.2f} | {'–' if med is None else f'{med:.2f}'} | "
              f"{d['files'] / best:,.0f} | {best / ruff_best:.2f} | {found} |"
              for name, best, med, found in rows]
    return "\n".join(lines) + (
        f"\n\nOf grep's {g['hits']} lines, {g['not_reported_by_kvtier']} are not reported as "
        f"warning or error ({g['reported_as_info']} shown as info: membership; the rest not "
        f"blocks or partial-aware, listed above); kvtier reports {g['kvtier_only']} error grep "
        f"cannot see (the alias `bhash = node.block_hash`).\n")


def janitor(small: dict[str, Any], big: dict[str, Any]) -> str:
    return (f"{small['keys_per_s']['janitor'] / 1e3:.0f}k keys/s vs "
            f"{small['keys_per_s']['naive'] / 1e3:.0f}k for a naive SCAN + GET pass "
            f"({small['value_bytes'] >> 10} KiB values, {small['ratio_keys_per_s']:.1f}×); "
            f"{big['ratio_keys_per_s']:.0f}× on {big['value_bytes'] >> 20} MiB values "
            f"(it reads headers only) ({_janitor_when(small, big)})")


def _janitor_when(small: dict[str, Any], big: dict[str, Any]) -> str:
    return when_runs((f"{small['value_bytes'] >> 10} KiB", small),
                     (f"{big['value_bytes'] >> 20} MiB", big))


def janitor_row(small: dict[str, Any], big: dict[str, Any]) -> str:
    """RELIABILITY J15: both value sizes and the paced pass, with the commands that ran."""
    def rate(d: dict[str, Any]) -> str:
        k = d["keys_per_s"]
        b = d["value_bytes"]
        size = f"{b >> 10} KiB" if b < 1 << 20 else f"{b >> 20} MiB"
        return (f"{size} values ({d['keys']:,} keys): {k['janitor']:,.0f} keys/s vs "
                f"{k['naive']:,.0f} ({d['ratio_keys_per_s']:.1f}×)")
    paced = small["paced"]
    return (f"{rate(small)}; {rate(big)}; paced at {paced['max_keys_per_s']:,.0f}/s: "
            f"{paced['seconds']:.2f} s for a {paced['floor_s']:.2f} s floor "
            f"(`{small['_measured']['command']}` and `{big['_measured']['command']}`; "
            f"{_janitor_when(small, big)})")


def e2e(d: dict[str, Any]) -> str:
    r = d["ratios"]
    models = [m for m in ("llama", "hybrid") if f"overhead_no_hit_{m}" in r]
    over = " / ".join(f"{pct(r[f'overhead_no_hit_{m}'])} ({m})" for m in models)
    native = " / ".join(pct(r.get(f"native_overhead_no_hit_{m}")) for m in models)
    restart = " / ".join(x(r.get(f"restart_recomputed_vs_native_{m}")) for m in models)
    reset = " / ".join(x(r.get(f"recomputed_vs_native_{m}")) for m in models)
    cpu_only = ""
    if any(f"cpu_only_overhead_no_hit_{m}" in r for m in models):
        cpu_only = "; kvtier with its CPU tier only " + " / ".join(
            pct(r.get(f"cpu_only_overhead_no_hit_{m}")) for m in models)
    direct = ""
    if r.get("kvtier_vs_native_no_hit") is not None:
        direct = (f"; kvtier's no-hit pass vs native's, paired: "
                  f"{pct(r['kvtier_vs_native_no_hit'])} pooled")
    null = ""
    if r.get("null_overhead_no_hit") is not None:
        null = f"; a connector that does nothing {pct(r['null_overhead_no_hit'])} pooled"
    pooled = "; pooled over both models: kvtier " + pct(r.get("overhead_no_hit")) + \
        ", native " + pct(r.get("native_overhead_no_hit"))
    if r.get("cpu_only_overhead_no_hit") is not None:
        pooled += ", kvtier-cpu " + pct(r["cpu_only_overhead_no_hit"])
    return (f"recomputed prefill tokens after vLLM's cache is emptied, kvtier vs vLLM's native "
            f"OffloadingConnector: {reset}; after an engine restart (kvtier from Redis): "
            f"{restart}. No-hit overhead (wall, kvtier as deployed, Redis configured): "
            f"{over}; native {native}{cpu_only}{pooled}{direct}{null}{_e2e_instances(d)} "
            f"in the same run ({when(d)})")


def _e2e_instances(d: dict[str, Any]) -> str:
    """kvtier against native per pair of engines, where the passes ran on several."""
    n = d.get("nohit_instances", 1)
    if n < 2:
        return ""
    pairs = [f"{pct(v - 1)} ({m})" for m, md in d["detail"].items()
             for v in md.get("nohit_paired_by_instance", {}).get("kvtier_vs_native", [])
             if v is not None]
    return (f"; passes over {n} engines per config, kvtier vs native per pair of engines: "
            + ", ".join(pairs))


def stall(d: dict[str, Any]) -> str:
    r = d["ratios"]
    return (f"ITL p99 (vLLM's histogram, engine timestamps) vs no connector: kvtier "
            f"{x(r.get('itl_p99_vs_no_connector'))}, "
            f"native {x(r.get('native_itl_p99_vs_no_connector'))} (p50 "
            f"{x(r.get('itl_p50_vs_no_connector'))} / "
            f"{x(r.get('native_itl_p50_vs_no_connector'))}); restoring TTFT p50 "
            f"{x(r.get('restore_ttft_p50_vs_no_connector'))} / "
            f"{x(r.get('native_restore_ttft_p50_vs_no_connector'))}; storing TTFT p50 "
            f"{x(r.get('store_ttft_p50_vs_no_connector'))} / "
            f"{x(r.get('native_store_ttft_p50_vs_no_connector'))}"
            f"{_stall_rounds(d)}{_stall_aims(d)} ({when(d)})")


def _stall_aims(d: dict[str, Any]) -> str:
    """kvtier's ITL p99 against native's and vLLM alone's, pooled and median of rounds,
    where the run recorded them (``itl_aims``)."""
    aims = d.get("itl_aims")
    if not aims:
        return ""
    parts = [f"{label} {a['pooled']:.2f}× pooled, {a['median_of_rounds']:.2f}× median of rounds"
             for label, key in (("vs native", "itl_p99_vs_native"),
                                ("vs vLLM alone", "itl_p99_vs_no_connector"))
             for a in [aims.get(key)] if a]
    verdict = "" if aims.get("valid") else " (not judged: a round failed or lost its stream)"
    return "; kvtier's ITL p99 " + ", ".join(parts) + verdict


def _stall_rounds(d: dict[str, Any]) -> str:
    """kvtier's per-round ratios (median [range]), where the run recorded them."""
    rr = d.get("connectors", {}).get("kvtier", {}).get("round_ratios") or {}
    parts = [f"{label} {v['median']:.2f}× [{v['min']:.2f}–{v['max']:.2f}]"
             for label, key in (("ITL p99", "itl_p99_vs_no_connector"),
                                ("storing TTFT", "store_ttft_p50_vs_no_connector"))
             for v in [rr.get(key)] if v]
    return ("; kvtier round by round, median [range]: " + ", ".join(parts)) if parts else ""


#: bench_stall's CPU roles shown in the figure (the rest of the machine stays in the JSON).
STALL_CPU_ROLES = ("engine core", "worker main", "worker compute", "kvtier threads",
                   "api server", "proxy", "redis-server")


def stall_cpu(d: dict[str, Any]) -> str:
    """CPU milliseconds per engine step by role, per config, where the run recorded them."""
    rows = {c: v["summary"] for c, v in d["connectors"].items()
            if "cpu_ms_per_step_by_role" in v["summary"]}
    if not rows:
        return "not recorded by this run"
    parts = [f"{role}: " + " / ".join(f"{s['cpu_ms_per_step_by_role'][role]:.3f}"
                                      for s in rows.values())
             for role in STALL_CPU_ROLES]
    steps = " / ".join(f"{s['engine_steps']:.0f}" for s in rows.values())
    return (f"CPU ms per engine step, {' / '.join(rows)}: " + "; ".join(parts)
            + f" (engine steps {steps}; commit {_short_commit(d['_measured']['commit'])}, "
            f"{when(d)})")


def stall_runs(*runs: dict[str, Any]) -> str:
    """Several bench_stall runs in a row: kvtier's ITL p99 against its aims, TTFTs, and
    the Redis link's timeouts, one row per run."""
    lines = ["", "| run | kvtier ITL p99 vs vLLM alone, pooled / median of rounds (aim ≤ 1.2) "
             "| vs native (aim ≤ 1.0) | native vs alone | storing / restoring TTFT p50 vs "
             "alone: kvtier; native | Redis timeouts | judged |",
             "|---|---|---|---|---|---|---|"]
    for n, d in enumerate(runs, 1):
        a, r = d["itl_aims"], d["ratios"]
        alone, native = a["itl_p99_vs_no_connector"], a["itl_p99_vs_native"]
        timeouts = d.get("kvtier_counters", {}).get("vllm:kvtier_redis_unavailable_events", 0)
        lines.append(
            f"| {n} | {x(alone['pooled'])} / {x(alone['median_of_rounds'])} | "
            f"{x(native['pooled'])} / {x(native['median_of_rounds'])} | "
            f"{x(r.get('native_itl_p99_vs_no_connector'))} | "
            f"{x(r.get('store_ttft_p50_vs_no_connector'))} / "
            f"{x(r.get('restore_ttft_p50_vs_no_connector'))}; "
            f"{x(r.get('native_store_ttft_p50_vs_no_connector'))} / "
            f"{x(r.get('native_restore_ttft_p50_vs_no_connector'))} | {timeouts:.0f} | "
            f"{'yes' if a['valid'] else 'no: a request failed'} |")
    stamps = when_runs(*((f"run {n}", d) for n, d in enumerate(runs, 1)))
    return "\n".join(lines) + f"\n\n({stamps})\n"


def stall_aa(*runs: dict[str, Any]) -> str:
    """Runs with A/A controls: kvtier's ITL p99 over native's beside two identical servers'
    (``native-again`` over ``native``, ``none-again`` over ``none``), pooled / median of
    rounds [rounds' range], and whether kvtier's pooled distance from native's is within
    the larger A/A distance of the same run."""
    lines = ["", "| run | kvtier over native | native-again over native | none-again over none "
             "| kvtier over vLLM alone | kvtier within the run's A/A distance (pooled) |",
             "|---|---|---|---|---|---|"]
    for n, d in enumerate(runs, 1):
        a, aa = d["itl_aims"], d["aa_controls"]
        vs_native = a["itl_p99_vs_native"]
        kv_rr = d["connectors"]["kvtier"]["round_ratios"]["itl_p99_vs_no_connector"]
        per_native = [k / v for k, v in zip(
            d["connectors"]["kvtier"]["summary"]["itl_p99_ms_per_round"],
            d["connectors"]["native"]["summary"]["itl_p99_ms_per_round"], strict=True)]
        distance = max(abs(c["pooled"] - 1.0) for c in aa.values())
        inside = abs(vs_native["pooled"] - 1.0) <= distance
        cells = [f"{vs_native['pooled']:.2f} / {vs_native['median_of_rounds']:.2f} "
                 f"[{min(per_native):.2f}–{max(per_native):.2f}]"]
        cells += [f"{c['pooled']:.2f} / {c['median_of_rounds']:.2f} "
                  f"[{c['min']:.2f}–{c['max']:.2f}]" if c else "not run"
                  for c in (aa.get("native-again"), aa.get("none-again"))]
        cells.append(f"{a['itl_p99_vs_no_connector']['pooled']:.2f} / "
                     f"{kv_rr['median']:.2f} [{kv_rr['min']:.2f}–{kv_rr['max']:.2f}]")
        cells.append(f"{'yes' if inside else 'no'} ({abs(vs_native['pooled'] - 1) * 100:.1f} "
                     f"vs {distance * 100:.1f} points)"
                     + ("" if a["valid"] else "; not judged: a request failed"))
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    stamps = when_runs(*((f"run {n}", d) for n, d in enumerate(runs, 1)))
    return "\n".join(lines) + f"\n\n(ITL p99 ratios, pooled / median of rounds [range]; {stamps})\n"


#: Pairs of bench_stall configs read round by round (config, over this one).
STALL_PAIRS = (("kvtier", "native"), ("kvtier", "none"), ("native", "none"),
               ("native-again", "native"), ("none-again", "none"))


def _interval(p: dict[str, Any]) -> str:
    """A paired ratio (``benchmarks/paired.py``) as the docs write it: ``0.97× [0.90–1.05]``."""
    lo, hi = p["ci95"]
    return f"{p['geo_mean']:.2f}× [{lo:.2f}–{hi:.2f}]"


def stall_paired(*runs: dict[str, Any]) -> str:
    """Every round of ``runs`` pooled, for each pair of configs they all ran: the geometric
    mean of the per-round ITL p99 ratios and its 95 % interval (``benchmarks/paired.py``)."""
    parts = []
    for mine, ref in STALL_PAIRS:
        if not all(mine in d["connectors"] and ref in d["connectors"] for d in runs):
            continue
        p = paired_ratio(
            [v for d in runs for v in d["connectors"][mine]["summary"]["itl_p99_ms_per_round"]],
            [v for d in runs for v in d["connectors"][ref]["summary"]["itl_p99_ms_per_round"]])
        parts.append(f"{mine} over {ref} {_interval(p)}")
    rounds = sum(len(d["connectors"]["kvtier"]["summary"]["itl_p99_ms_per_round"])
                 for d in runs)
    stamps = when_runs(*((f"run {n}", d) for n, d in enumerate(runs, 1)))
    return (f"ITL p99, geometric mean of the per-round ratios [95 % interval], {rounds} rounds "
            f"of {len(runs)} runs: " + "; ".join(parts) + f" ({stamps})")


def stall_p50(d: dict[str, Any]) -> str:
    """One run's ITL p50 paired over its rounds (``p50_paired``): kvtier over native and
    over vLLM alone, and each A/A control over the server it repeats."""
    pairs = [("kvtier over native", d["itl_aims"]["itl_p99_vs_native"]["p50_paired"]),
             ("kvtier over vLLM alone", d["itl_aims"]["itl_p99_vs_no_connector"]["p50_paired"])]
    pairs += [(f"{c} over {a['against']}", a["p50_paired"])
              for c, a in d.get("aa_controls", {}).items()]
    parts = [f"{label} {_interval(p)}" for label, p in pairs]
    rounds = pairs[0][1]["rounds"]
    return (f"ITL p50, geometric mean of the per-round ratios [95 % interval], {rounds} "
            f"rounds: " + "; ".join(parts) + f" (commit "
            f"{_short_commit(d['_measured']['commit'])}, {when(d)})")


def stall_local(d: dict[str, Any]) -> str:
    """A run with ``kvtier-local`` (kvtier's CPU tier serves the restores, native's workload)
    beside ``kvtier`` (from Redis) and an A/A control: each over native, ITL p99 and p50
    paired over the rounds, and each config's restoring TTFT p50 over vLLM alone's."""
    against_native = [("kvtier-local", d["itl_aims_local"]["itl_p99_vs_native"]),
                      ("kvtier", d["itl_aims"]["itl_p99_vs_native"]),
                      *d["aa_controls"].items()]
    parts = [f"{label} p99 {_interval(a['paired'])}, p50 {_interval(a['p50_paired'])}"
             for label, a in against_native]
    ttft = ", ".join(f"{c} {x(v['ratios']['restore_ttft_p50_vs_no_connector'])}"
                     for c, v in d["connectors"].items() if v.get("ratios"))
    rounds = d["itl_aims"]["itl_p99_vs_native"]["paired"]["rounds"]
    return (f"ITL over native's, paired over {rounds} rounds [95 % interval]: "
            + "; ".join(parts) + f"; restoring TTFT p50 over vLLM alone's: {ttft} (commit "
            f"{_short_commit(d['_measured']['commit'])}, {when(d)})")


def stall_steps(d: dict[str, Any]) -> str:
    """Per config, its worker steps in the windows (``--hook-calls``): the slowest 1 %
    split into hooks, forward and the forward's time off the CPU; the scheduler's hooks."""
    rows = {c: v["summary"]["hook_steps"] for c, v in d["connectors"].items()
            if v["summary"].get("hook_steps")}
    if not rows:
        return "not recorded by this run (bench_stall --hook-calls)"
    parts = []
    for config, h in rows.items():
        w, slow = h["worker"], h["worker"]["slowest_1pct"]
        sched = h.get("scheduler", {}).get("hooks_ms", {})
        parts.append(
            f"{config}: worker step p50 {w['step_ms']['p50']:.2f} / p99 {w['step_ms']['p99']:.2f}"
            f" ms; its slowest 1 % ({slow['steps']} steps) {slow['step_ms']:.1f} ms = hooks "
            f"before {slow['pre_ms']:.2f} + forward {slow['forward_ms']:.1f} (off the CPU "
            f"{slow['forward_off_cpu_ms']:.2f}) + hooks after {slow['post_ms']:.2f}; scheduler "
            f"hooks per step p99 {sched.get('p99', float('nan')):.2f} ms, max "
            f"{sched.get('max', float('nan')):.1f}")
    return "; ".join(parts) + f" (commit {_short_commit(d['_measured']['commit'])}, {when(d)})"


def stall_kinds(d: dict[str, Any]) -> str:
    """Engine steps compared at the same work (``--hook-calls``): per kind, native's and
    kvtier's p50 / p99 and step counts, kvtier's ratios, and the run's pooled ITL p99 ratio."""
    rows = {c: v["summary"]["hook_steps"]["engine_steps"] for c, v in d["connectors"].items()
            if (v["summary"].get("hook_steps") or {}).get("engine_steps")}
    ratios = d.get("engine_step_ratios", {}).get("kvtier", {})
    if "native" not in rows or "kvtier" not in rows:
        return "not recorded by this run (bench_stall --hook-calls)"
    parts = []
    for kind, r in ratios.items():
        n, k = rows["native"][kind], rows["kvtier"][kind]
        parts.append(f"{kind} steps: native p50 {n['p50']:.2f} / p99 {n['p99']:.2f} ms "
                     f"({n['steps']}), kvtier {k['p50']:.2f} / {k['p99']:.2f} ms "
                     f"({k['steps']}): {x(r['p50'])} / {x(r['p99'])}")
    pooled = d["itl_aims"]["itl_p99_vs_native"]["pooled"]
    return ("; ".join(parts) + f"; in the same run kvtier's pooled ITL p99 was {x(pooled)} "
            f"native's (commit {_short_commit(d['_measured']['commit'])}, {when(d)})")


def stall_ttft_spread(*runs: dict[str, Any]) -> str:
    """Per run: the spread of its rounds' restoring TTFT p50 over every config (min, median,
    max) and the share of those rounds over one second."""
    parts = []
    for n, d in enumerate(runs, 1):
        ttft = [t for v in d["connectors"].values()
                for t in v["summary"]["restore_ttft_p50_ms_per_round"]]
        slow = sum(t > 1000 for t in ttft)
        parts.append(f"run {n} ({_short_commit(d['_measured']['commit'])}): "
                     f"{min(ttft):,.0f} / {statistics.median(ttft):,.0f} / {max(ttft):,.0f} ms, "
                     f"{slow} of {len(ttft)} rounds over 1 s")
    return "restoring TTFT p50 per config-round, min / median / max: " + "; ".join(parts)


def stall_ttft_itl(*runs: dict[str, Any]) -> str:
    """Over every config's rounds in ``runs``: how a round's ITL p99 moves with its TTFT
    (the mean of its storing and restoring TTFT p50): Pearson's r of their logarithms, and
    the ITL p99 of the rounds with the slowest and the fastest third of TTFTs."""
    itl, ttft = [], []
    for d in runs:
        for v in d["connectors"].values():
            s = v["summary"]
            for i, r, st in zip(s["itl_p99_ms_per_round"], s["restore_ttft_p50_ms_per_round"],
                                s["store_ttft_p50_ms_per_round"], strict=True):
                if i > 0 and r > 0 and st > 0:
                    itl.append(i)
                    ttft.append((r + st) / 2)
    by_ttft = [i for _, i in sorted(zip(ttft, itl, strict=True))]
    third = len(by_ttft) // 3
    r = statistics.correlation([math.log(t) for t in ttft], [math.log(i) for i in itl])
    return (f"{len(itl)} config-rounds of {len(runs)} runs: r = {r:.2f} between log TTFT and "
            f"log ITL p99; median ITL p99 {statistics.median(by_ttft[:third]):.1f} ms in the "
            f"third with the fastest TTFTs, {statistics.median(by_ttft[-third:]):.1f} ms in "
            f"the slowest third")


def step_gil(d: dict[str, Any]) -> str:
    """bench_step_gil: what each background burst costs a thread of small torch calls."""
    c = d["cases"]
    parts = [f"{name} p99 {x(v['p99_vs_alone'])}, {v['extra_ms_per_burst']:.2f} ms per burst"
             for name, v in c.items() if name != "alone"]
    return (f"steps alone p50 {c['alone']['p50_ms']:.2f} / p99 {c['alone']['p99_ms']:.2f} ms; "
            + "; ".join(parts) + f" ({when(d)})")


def nohit_ttft(*runs: dict[str, Any]) -> str:
    def cell(d: dict[str, Any], config: str) -> str:
        ms = f"{config} {d['rows'][config]['median_ms']:.1f} ms"
        ratio = d["ratios"].get(f"ttft_nohit_{config.replace('-', '_')}_vs_none")
        return ms if ratio is None else f"{ms} ({x(ratio)})"

    def engines(d: dict[str, Any]) -> str:
        by = d.get("median_ms_by_instance") or {}
        if d.get("instances", 1) < 2 or not by:
            return ""
        return "; per engine " + ", ".join(
            f"{c} " + "/".join(f"{v:.1f}" for v in vs) for c, vs in by.items())

    def sample(d: dict[str, Any]) -> str:
        spread = d.get("instances", 1)
        over = f" over {spread} engines" if spread > 1 else ""
        return f"{d['rows']['none']['requests']} requests per config{over}"

    per_model = "; ".join(f"{d['model']} ({sample(d)}): "
                          + ", ".join(cell(d, c) for c in d["rows"]) + engines(d) for d in runs)
    return (f"median TTFT of the no-hit requests; {per_model} "
            f"({when_runs(*((d['model'], d) for d in runs))})")


def thread_cpu(d: dict[str, Any]) -> str:
    """kvtier's own threads and redis-server per no-hit pass, beside the pass's TTFT."""
    def ms(row: dict[str, Any], thread: str) -> float:
        return sum(v for k, v in row["threads_ms"].items() if f" / {thread}" in k)

    rows = d["summary"]
    kv = rows["kvtier"]
    idle = rows.get("none", {}).get("redis", {}).get("cpu_s", 0.0)
    ttfts = ", ".join(f"{c} {1e3 * r['ttft_median_s']:.1f} ms" for c, r in rows.items())
    return (f"CPU per {d['model']} no-hit pass of 16 requests (medians of {d['passes']}): "
            f"kvtier's Redis writer {ms(kv, 'kvtier-redis-wr'):.1f} ms, its presence feed "
            f"{ms(kv, 'kvtier-presence'):.1f} ms, its saver {ms(kv, 'kvtier-saver'):.1f} ms; "
            f"redis-server {1e3 * kv['redis']['cpu_s']:.1f} ms ({1e3 * idle:.1f} ms with no "
            f"engine writing) for {kv['redis']['sets']:.0f} SETs; TTFT median {ttfts} "
            f"({when(d)})")


def hooks(*runs: dict[str, Any]) -> str:
    """Per engine step, the connector hooks' thread CPU in the engine core plus the worker."""
    def per_step(d: dict[str, Any]) -> float:
        return sum(p["cpu_us_per_step"] or 0.0 for p in d["processes"].values())

    by_model: dict[str, list[str]] = {}
    for d in runs:
        by_model.setdefault(d["model"], []).append(f"{d['config']} {per_step(d):.0f} µs")
    return ("connector hooks' thread CPU per engine step (engine core + worker): " + "; ".join(
        f"{model}: " + ", ".join(cells) for model, cells in by_model.items())
        + f" ({when_runs(*((d['model'] + ' ' + d['config'], d) for d in runs))})")


def native(d: dict[str, Any]) -> str:
    rows = {(row["config"], row["phase"]): row for row in d["rows"]}
    k, f, n = (rows[(c, "restart")] for c in ("kvtier", "fs", "none"))
    same = all(row["same_as_none"] for row in d["rows"])
    return (f"across an engine restart: recomputed {k['recomputed_tokens']:,} tokens with "
            f"kvtier's tier, {f['recomputed_tokens']:,} with the fs tier "
            f"({x(d['ratios']['restart_recomputed_vs_fs'])}), {n['recomputed_tokens']:,} "
            f"without ({x(d['ratios']['restart_recomputed_vs_none'])}); outputs "
            f"{'identical' if same else 'NOT identical'} ({when(d)})")


def ttft(d: dict[str, Any]) -> str:
    r, table = d["ratios"], d["table"]
    size = "4096" if "4096" in table["recompute"] else str(max(d["sizes"]))
    ms = {name: 1000 * row[size]["ttft_s"] for name, row in table.items()}
    redis = r.get("restore_gbps_vs_tier_limit_redis")
    return (f"TTFT at {int(size) // 1024}k prompt tokens after vLLM's prefix cache is reset: "
            f"recompute {ms['recompute']:,.0f} ms; kvtier CPU-tier hit "
            f"{ms['kvtier CPU']:,.0f} ms ({x(r['ttft_cpu_hit_vs_recompute_4k'])}), Redis hit "
            f"{ms['kvtier Redis']:,.0f} ms ({x(r['ttft_redis_hit_vs_recompute_4k'])}), new "
            f"engine from Redis {ms['kvtier Redis, new engine']:,.0f} ms "
            f"({x(r['ttft_redis_new_engine_vs_recompute_4k'])}); vLLM's native CPU offloading "
            f"{ms['native CPU']:,.0f} ms ({x(r['ttft_native_cpu_hit_vs_recompute_4k'])}). "
            f"Restore at {max(d['sizes']) // 1024}k tokens vs the tier's raw limit: CPU "
            f"{x(r['restore_gbps_vs_tier_limit_cpu'])} of memcpy, Redis {x(redis)} of "
            f"redis-benchmark GET{_restore_rates(d)}{_restore_cpu(d)} ({when(d)})")


def _ttft_ms(d: dict[str, Any]) -> tuple[str, dict[str, float]]:
    table = d["table"]
    size = "4096" if "4096" in table["recompute"] else str(max(d["sizes"]))
    return size, {name: 1000 * row[size]["ttft_s"] for name, row in table.items()}


def ttft_headline(d: dict[str, Any]) -> str:
    """The front page's short form of ``ttft``: the time to first token per tier."""
    r = d["ratios"]
    size, ms = _ttft_ms(d)
    return (f"TTFT at {int(size) // 1024}k prompt tokens: recompute {ms['recompute']:,.0f} ms; "
            f"CPU-tier hit {ms['kvtier CPU']:,.0f} ms "
            f"({x(r['ttft_cpu_hit_vs_recompute_4k'])}); Redis hit "
            f"{ms['kvtier Redis']:,.0f} ms ({x(r['ttft_redis_hit_vs_recompute_4k'])}); new "
            f"engine from Redis {ms['kvtier Redis, new engine']:,.0f} ms "
            f"({x(r['ttft_redis_new_engine_vs_recompute_4k'])}) ({when(d)})")


def e2e_headline(d: dict[str, Any]) -> str:
    """The front page's short form of ``e2e``: restart hits and the no-hit cost, pooled."""
    r = d["ratios"]
    models = [m for m in ("llama", "hybrid") if f"overhead_no_hit_{m}" in r]
    restart = " / ".join(x(r.get(f"restart_recomputed_vs_native_{m}")) for m in models)
    return (f"after an engine restart, kvtier (from Redis) recomputes {restart} of the prefill "
            f"tokens vLLM's native OffloadingConnector does ({' / '.join(models)}); no-hit "
            f"overhead, both models pooled: kvtier {pct(r.get('overhead_no_hit'))}, native "
            f"{pct(r.get('native_overhead_no_hit'))} ({when(d)})")


def _restore_cpu(d: dict[str, Any]) -> str:
    """Who ran during the same engine's Redis hit, when the run recorded it."""
    m = d["table"]["kvtier Redis"][str(max(d["sizes"]))]
    if not m.get("cpu_ms") or not m.get("cpu_window_s"):
        return ""
    window = m["cpu_window_s"]
    return (f"; CPU around that {1e3 * m['wall_s']:.0f} ms request (readings spanning "
            f"{1e3 * window:.0f} ms): " + ", ".join(
        f"{group} {ms:.0f} ms" for group, ms in m["cpu_ms"].items()))


def _restore_rates(d: dict[str, Any]) -> str:
    """The measured rates, when the run timed the move itself (kvtier's timers)."""
    rates, limits = d.get("restore_gbps", {}), d.get("tier_limits", {})
    if "restore_gbps_per_ttft" not in d:
        return ""
    get = (limits.get("redis_benchmark") or {}).get("get_gbps")
    return (f" ({rates['cpu']:.1f} vs {limits['cpu_memcpy_gbps']:.1f} GB/s; "
            f"{rates['redis']:.2f} vs {get or 0:.2f} GB/s, kvtier's own timers)")


def index(d: dict[str, Any]) -> str:
    r, k, dyn, http = d["ratios"], d["kvtier"]["query"], d["dynamo"]["query"], d["http"]
    agree = d["dynamo"].get("full_block_agreement", {})
    return (f"ingest {x(r['ingest_vs_dynamo'])} Dynamo's RadixTree per CPU-second "
            f"({d['dynamo'].get('package', 'ai-dynamo-runtime')}); /score of a 4k-token request "
            f"against a 1M-block index{_engines(d)} p50 {k['p50_us']:.0f} µs / p99 "
            f"{k['p99_us']:.0f} µs vs "
            f"Dynamo's {dyn['p50_us']:.0f} / {dyn['p99_us']:.0f} µs "
            f"(p99 {x(r['query_p99_vs_dynamo'])}); HTTP /score "
            f"{r['score_http_requests_per_s']:,.0f} requests/s, p99 "
            f"{r['score_http_p99_ms']:.1f} ms while "
            f"{http['applied_updates_per_s'] / 1e3:,.0f}k hash updates/s are ingested; full "
            f"blocks: {agree.get('agree', '?')} of {agree.get('compared', '?')} answers equal "
            f"Dynamo's{_index_runs(d)} ({when(d)})")


def index_headline(d: dict[str, Any]) -> str:
    """The routing index against Dynamo's, in one line (README)."""
    r, k, dyn = d["ratios"], d["kvtier"]["query"], d["dynamo"]["query"]
    return (f"/score of a 4k-token request against a 1M-block index{_engines(d)}: p99 "
            f"{k['p99_us']:.0f} µs vs Dynamo's RadixTree {dyn['p99_us']:.0f} µs "
            f"({x(r['query_p99_vs_dynamo'])}); ingest {x(r['ingest_vs_dynamo'])} Dynamo's per "
            f"CPU-second; HTTP p99 {r['score_http_p99_ms']:.1f} ms while "
            f"{d['http']['applied_updates_per_s'] / 1e3:,.0f}k hash updates/s are ingested "
            f"({when(d)})")


def _engines(d: dict[str, Any]) -> str:
    """How many engines the first query run had, where the JSON says."""
    q = d["kvtier"]["query"]
    return f" over {q['engines']} engines" if "engines" in q else ""


def _index_runs(d: dict[str, Any]) -> str:
    """The query runs past the first (more engines, the trace-shaped workload), if any."""
    runs = list(d["kvtier"].get("queries", {}).items())[1:]
    theirs = d["dynamo"].get("queries", {})
    return "".join(
        f"; {run.replace('/', ' workload, ')} engines: p50 {q['p50_us']:.0f} / p99 "
        f"{q['p99_us']:.0f} µs vs {theirs[run]['p50_us']:.0f} / {theirs[run]['p99_us']:.0f} "
        f"(p99 {x(q['p99_us'] / theirs[run]['p99_us'])})" for run, q in runs if run in theirs)


def route(d: dict[str, Any]) -> str:
    pol = d["policies"]
    rr, sc = pol["round_robin"], pol["score"]
    return (f"{d['workload']['conversations']} conversations × {d['workload']['turns']} turns "
            f"on two OpenAI servers: round robin {rr['cached_tokens']:,} of "
            f"{rr['prompt_tokens']:,} prompt tokens cached ({rr['hit_rate'] * 100:.1f} %), "
            f"routed by /score {sc['cached_tokens']:,} ({sc['hit_rate'] * 100:.1f} %): "
            f"{x(d['ratios']['cached_tokens_score_vs_round_robin'])}; /score's cached tokens for "
            f"the chosen engine equalled vLLM's in {sc['predicted_exact']} of "
            f"{sc['predicted_of']} requests ({when(d)})")


def host_tier(d: dict[str, Any]) -> str:
    r = d["restore"]
    big, page = r["block_2MiB"], r["page_64KiB"]
    out = (f"checked restores out of the shared segment (every shard copied out, its checksum "
           f"computed over the copy while it is still in cache) at "
           f"{big['gbps']['checked']:.1f} GB/s for 2 MiB slots ({x(big['checked_vs_memcpy'])} "
           f"memcpy's {big['gbps']['memcpy']:.1f} GB/s in the same run) and "
           f"{page['gbps']['checked']:.1f} GB/s for 64 KiB slots "
           f"({x(page['checked_vs_memcpy'])} of {page['gbps']['memcpy']:.1f}); into KV tensors "
           f"as an x86-64 worker loads them (checked in place, then loaded from the segment) "
           f"{big['gbps']['verified']:.1f} GB/s ({x(big['restore_gbps_vs_memcpy'])}) and "
           f"{page['gbps']['verified']:.1f} GB/s ({x(page['restore_gbps_vs_memcpy'])}), as a "
           f"weakly ordered CPU's worker does (copied and checked, then loaded from the copy) "
           f"{big['gbps']['copied']:.1f} GB/s ({x(big['copied_vs_memcpy'])}) and "
           f"{page['gbps']['copied']:.1f} GB/s ({x(page['copied_vs_memcpy'])})")
    dp = d.get("dp2")
    if dp:
        out += (f"; the OpenAI server at DP=2 recomputed {dp['host']['recomputed_tokens']:,} of "
                f"{dp['host']['prompt_tokens']:,} prompt tokens with the host tier against "
                f"{dp['per_engine']['recomputed_tokens']:,} with each engine's own CPU tier "
                f"({x(d['ratios']['recomputed_host_vs_per_engine'])})")
    return out + f" ({when(d)})"


def gpu(d: dict[str, Any]) -> str:
    g, r, t = d["throughput"]["gbps"], d["ratios"], d["throughput"]
    exact = "byte-exact" if d["byte_exact"] else "NOT byte-exact"
    staged = (f"; {g['segment_scatter_staged']:.1f} GB/s unregistered, staged"
              if "segment_scatter_staged" in g else "")
    return (f"on an {d['device']} (torch {d['torch']}): all {len(d['cases'])} layouts {exact} "
            f"both ways and through the shared segment; {t['blocks']} blocks of "
            f"{t['block_bytes'] / 2**20:.0f} MiB gathered at {g['gather']:.1f} GB/s "
            f"({x(r['gather_vs_copy'])} a plain device-to-host copy's {g['d2h']:.1f}), "
            f"scattered at {g['scatter']:.1f} GB/s ({x(r['scatter_vs_copy'])} host-to-device's "
            f"{g['h2d']:.1f}), scattered from the page-locked shared segment at "
            f"{g['segment_scatter']:.1f} GB/s ({x(r['segment_scatter_vs_copy'])}{staged}) and "
            f"gathered straight into it at {g['segment_gather']:.1f} GB/s "
            f"({x(r['segment_gather_vs_copy'])}) ({d['_measured']['date']}, commit "
            f"{d['_measured']['commit']})")


def gil(d: dict[str, Any]) -> str:
    g = d["gbps"]
    loops = ", ".join(f"{g[k]:.2f} GB/s at {k.split(', ')[1]}" for k in g
                      if k.startswith("python loop"))
    return (f"{d['values']} Redis reads of {d['value_bytes'] // 1024} KiB on one thread: "
            f"{g['alone']:.2f} GB/s alone; beside a thread holding the GIL in a Python loop "
            f"{loops} switch interval; beside a loop that yields each turn "
            f"{g['sched_yield loop, 5 ms']:.2f} GB/s ({when(d)})")


def backfill(d: dict[str, Any]) -> str:
    rows = d["rows"]
    link = next(r for r in rows if r["path"] == "pipelined SET")
    fills = ", ".join(f"{r['mb_per_s']:.0f} MB/s at {r['step_ms']:g} ms steps "
                      f"({r['steps']} steps, {x(r['vs_pipelined_set'])})"
                      for r in rows if r["path"] == "backfill")
    ups = ", ".join(f"{r['mb_per_s']:.0f} MB/s at {r['step_ms']:g} ms"
                    + (f" ({r['saved'] - r['blocks']:,} of {r['saved']:,} dropped: the "
                       f"writer's queue was full)" if r["blocks"] < r["saved"] else "")
                    for r in rows if r["path"] == "saves, Redis up")
    return (f"{d['blocks']:,} blocks of {d['block_kib']} KiB saved during an outage reach "
            f"Redis once it answers at {fills} the pipelined-SET rate of the same bytes "
            f"({link['mb_per_s']:.0f} MB/s); the same saves written while Redis was up: "
            f"{ups} ({when(d)})")


def checkpoint(d: dict[str, Any]) -> str:
    """The sampled checkpoint identity beside reading the weight files whole."""
    def share(ratio: float) -> str:
        return f"{ratio * 100:.3f} %"

    r = d["ratios"]
    return (f"a Llama-3-8B-shaped {d['gib']:.1f} GiB checkpoint ({d['shards']} safetensors "
            f"shards, {d['tensors']} tensors): the identity samples {d['sample_windows']} "
            f"windows ({d['sample_bytes'] / 2**20:.1f} MiB) in "
            f"{d['identity_cold_s'] * 1e3:.1f} ms with the page cache cold and "
            f"{d['identity_warm_s'] * 1e3:.1f} ms warm (medians of {d['runs']}), against "
            f"{d['full_read_cold_s']:.1f} s / {d['full_read_warm_s']:.1f} s to read the files "
            f"whole: {share(r['identity_cold_vs_full_read'])} / "
            f"{share(r['identity_warm_vs_full_read'])} of that time ({when(d)})")


def lmcache_l2(d: dict[str, Any]) -> str:
    """kvtier's LMCache L2 adapter beside LMCache's resp and valkey (bench_lmcache_l2.py)."""
    a = d["adapters"]
    kv, resp, vk = a["kvtier"], a["lmcache_resp"], a["lmcache_valkey"]
    return (f"{d['geometry']['chunk_bytes'] >> 20} MiB chunks (256 tokens, Llama-3.1-8B), one "
            f"Redis: kvtier stores {kv['store_gb_s']:.2f} GB/s, loads {kv['load_gb_s']:.2f} "
            f"GB/s; LMCache's resp {resp['store_gb_s']:.2f} / {resp['load_gb_s']:.2f}, valkey "
            f"{vk['store_gb_s']:.2f} / {vk['load_gb_s']:.2f}; kvtier vs resp: store "
            f"{x(d['kvtier_store_vs_lmcache_resp'])}, load {x(d['kvtier_load_vs_lmcache_resp'])}"
            f" ({when(d)})")


#: span name -> (JSON files under benchmarks/results, renderer)
RENDERERS: dict[str, tuple[tuple[str, ...], Callable[..., str]]] = {
    "events": (("events.json",), events),
    "index-memory": (("events.json",), index_memory),
    "events-table": (("events.json",), events_table),
    "tiers-table": (("tiers.json",), tiers_table),
    "tiers": (("tiers.json",), tiers),
    "audit": (("audit.json",), audit),
    "audit-tree": (("audit.json",), audit_tree),
    "audit-parsed": (("audit.json",), audit_parsed),
    "audit-findings": (("audit.json",), audit_findings),
    "audit-table": (("audit.json",), audit_table),
    "janitor": (("janitor-64k.json", "janitor-2m.json"), janitor),
    "janitor-row": (("janitor-64k.json", "janitor-2m.json"), janitor_row),
    "e2e": (("e2e.json",), e2e),
    "stall": (("stall.json",), stall),
    "stall-cpu": (("stall.json",), stall_cpu),
    "stall-runs": (("stall_run1.json", "stall_run2.json", "stall.json"), stall_runs),
    "stall-runs-nice0": (("stall_nice0_run1.json", "stall_nice0_run2.json",
                          "stall_nice0_run3.json"), stall_runs),
    "stall-runs-setsid": (("stall_setsid_run1.json", "stall_setsid_run2.json",
                           "stall_setsid_run3.json"), stall_runs),
    "stall-aa": (("stall_aa_run1.json", "stall_aa_run2.json", "stall_aa_run3.json"),
                 stall_aa),
    "stall-paired": (("stall_aa_run1.json", "stall_aa_run2.json", "stall_aa_run3.json"),
                     stall_paired),
    "stall-aa-long": (("stall_aa_long.json", "stall_aa_long2.json"), stall_aa),
    "stall-paired-aa": (("stall_aa_run1.json", "stall_aa_run2.json", "stall_aa_run3.json",
                         "stall_aa_long.json", "stall_aa_long2.json"), stall_paired),
    "stall-p50": (("stall_aa_long2.json",), stall_p50),
    "stall-local": (("stall_local.json",), stall_local),
    "stall-paired-six": (("stall_run1.json", "stall_run2.json", "stall.json",
                          "stall_aa_run1.json", "stall_aa_run2.json", "stall_aa_run3.json"),
                         stall_paired),
    "stall-steps": (("stall_hooks.json",), stall_steps),
    "stall-kinds": (("stall_kinds.json",), stall_kinds),
    "stall-ttft-itl": (("stall_nice0_run1.json", "stall_nice0_run2.json",
                        "stall_nice0_run3.json", "stall_setsid_run1.json",
                        "stall_setsid_run2.json", "stall_setsid_run3.json"), stall_ttft_itl),
    "stall-ttft-spread": (("stall_setsid_run1.json", "stall_setsid_run2.json",
                           "stall_setsid_run3.json", "stall_shared_run1.json",
                           "stall_shared_run2.json", "stall_shared_run3.json"),
                          stall_ttft_spread),
    "stall-runs-shared": (("stall_shared_run1.json", "stall_shared_run2.json",
                           "stall_shared_run3.json"), stall_runs),
    "step-gil": (("step_gil.json",), step_gil),
    "nohit-ttft": (("nohit_ttft_llama.json", "nohit_ttft_hybrid.json"), nohit_ttft),
    "native": (("native.json",), native),
    "thread-cpu": (("thread_cpu_hybrid.json",), thread_cpu),
    "hooks": (tuple(f"hooks_{m}_{c}.json" for m in ("llama", "hybrid")
                    for c in ("kvtier-cpu", "kvtier", "native")), hooks),
    "ttft": (("ttft.json",), ttft),
    "ttft-headline": (("ttft.json",), ttft_headline),
    "e2e-headline": (("e2e.json",), e2e_headline),
    "index": (("index.json",), index),
    "index-headline": (("index.json",), index_headline),
    "route": (("route.json",), route),
    "host-tier": (("host_tier.json",), host_tier),
    "gpu": (("gpu_check.json",), gpu),
    "gil": (("gil.json",), gil),
    "backfill": (("backfill.json",), backfill),
    "checkpoint-identity": (("checkpoint_identity.json",), checkpoint),
    "lmcache-l2": (("lmcache_l2.json",), lmcache_l2),
}


def render_span(name: str, results: Path = RESULTS) -> str:
    """The text of span ``name`` from its JSON files (KeyError / OSError name what lacks)."""
    if name not in RENDERERS:
        raise KeyError(f"no renderer for figures span {name!r}; known: {', '.join(RENDERERS)}")
    files, renderer = RENDERERS[name]
    data = [json.loads((results / f).read_text()) for f in files]
    return renderer(*data)


def rewrite(text: str, results: Path = RESULTS) -> str:
    """``text`` with every figures span rendered afresh."""
    def sub(match: re.Match[str]) -> str:
        name = match["name"]
        return f"<!-- figures:{name} -->{render_span(name, results)}<!-- /figures:{name} -->"
    return SPAN.sub(sub, text)


def stale_spans(results: Path = RESULTS, root: Path = REPO) -> list[str]:
    """``doc:span`` for every span whose text is not what its JSON renders to."""
    stale = []
    for doc in DOCUMENTS:
        path = root / doc
        if not path.exists():
            continue
        text = path.read_text()
        for match in SPAN.finditer(text):
            if match["body"] != render_span(match["name"], results):
                stale.append(f"{doc}:{match['name']}")
    return stale


def unstamped(results: Path = RESULTS) -> list[str]:
    """``file: field`` for every JSON under ``results`` whose stamp lacks a field."""
    missing = []
    for path in sorted(results.glob("*.json")):
        meta = json.loads(path.read_text()).get("_measured")
        meta = meta if isinstance(meta, dict) else {}
        missing += [f"{path.name}: {field}" for field in STAMP_FIELDS
                    if meta.get(field) in (None, "")]
    return missing


def commit_measured(root: Path = REPO) -> str:
    """The checkout's commit, ``+dirty`` when tracked files differ from it."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown (not a git checkout)"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def stamp(path: Path, command: list[str]) -> None:
    """Record in ``path`` when, on what, at which commit and by which command it was
    measured."""
    data = json.loads(path.read_text())
    data["_measured"] = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(command),
                         "load_avg": f"{os.getloadavg()[0]:.1f}", "cpus": os.cpu_count(),
                         "commit": commit_measured()}
    path.write_text(json.dumps(data, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("stamp", help="record when and how a JSON file was measured")
    st.add_argument("path", type=Path)
    st.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("render", help="rewrite every figures span from benchmarks/results")
    sub.add_parser("check", help="exit 1 when a span differs from its JSON")
    args = ap.parse_args(argv)
    if args.cmd == "stamp":
        stamp(args.path, [c for c in args.command if c != "--"])
        return 0
    if args.cmd == "render":
        for doc in DOCUMENTS:
            path = REPO / doc
            if path.exists():
                path.write_text(rewrite(path.read_text()))
        return 0
    stale = stale_spans()
    for span in stale:
        print(f"stale figures: {span} (run `make bench`, or "
              "`python -m benchmarks.figures render` after editing a JSON)", file=sys.stderr)
    missing = unstamped()
    for field in missing:
        print(f"unstamped result: {field} (run `python -m benchmarks.figures stamp`)",
              file=sys.stderr)
    return 1 if stale or missing else 0


if __name__ == "__main__":
    sys.exit(main())
