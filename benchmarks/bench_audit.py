"""kvtier audit vs ruff vs grep on the whole installed vLLM tree, side by side in one run.

    .venv/bin/python -m benchmarks.bench_audit [--json PATH] [--repeat 5]

Each tool runs as a subprocess (interpreter start included) on the same tree, ``--repeat``
times, interleaved so that machine noise hits all three alike; best and median are
reported. ruff (``--isolated --select E,F --no-cache``) is the speed anchor for a Python
linter; grep for block_hash presence tests is the naive baseline. "grep hits kvtier rightly
does not report" are grep lines without a kvtier warning/error: non-block objects,
membership bookkeeping, partial-aware code (each verified in tests/audit/test_vllm_tree.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import write_result

VENV_BIN = Path(sys.executable).parent
GREP_PATTERN = (r"block_hash[A-Za-z0-9_]*\)?\s*(is not|is|!=|==)\s*None"
                r"|(if|while|not|and|or|elif)\s+\(?[A-Za-z_][A-Za-z0-9_.\[\]]*block_hash\b"
                r"|getattr\([^)]*['\"]block_hash['\"]")


def vllm_tree() -> Path:
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vllm is not installed in this interpreter's environment")
    return Path(next(iter(spec.submodule_search_locations)))


def timed(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return time.perf_counter() - start, proc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=0, help="kvtier worker processes (0: CPUs)")
    args = parser.parse_args(argv)
    tree = vllm_tree()
    files = sum(1 for _ in tree.rglob("*.py"))
    kvtier_cmd = [str(VENV_BIN / "kvtier"), "audit", "--isolated", "--format", "json",
                  "--min-severity", "info", "--fail-on", "never", str(tree)]
    if args.jobs:
        kvtier_cmd[2:2] = ["--jobs", str(args.jobs)]
    ruff_cmd = [str(VENV_BIN / "ruff"), "check", "--no-cache", "--isolated", "--select",
                "E,F", "--output-format", "json", "--exit-zero", str(tree)]
    grep_cmd = ["grep", "-rnE", "--include=*.py", GREP_PATTERN, str(tree)]
    times: dict[str, list[float]] = {"kvtier": [], "ruff": [], "grep": []}
    last: dict[str, subprocess.CompletedProcess[str]] = {}
    for _ in range(args.repeat):
        for name, cmd in (("kvtier", kvtier_cmd), ("ruff", ruff_cmd), ("grep", grep_cmd)):
            seconds, proc = timed(cmd)
            if proc.returncode not in (0, 1):
                raise SystemExit(f"{name} failed ({proc.returncode}): {proc.stderr[-2000:]}")
            times[name].append(seconds)
            last[name] = proc

    report = json.loads(last["kvtier"].stdout)
    findings = report["findings"]
    flagged = {(f["path"], f["line"]) for f in findings if f["severity"] != "info"}
    membership = {(f["path"], f["line"]) for f in findings if f["severity"] == "info"}
    errors = sum(f["severity"] == "error" for f in findings)
    warnings_ = sum(f["severity"] == "warning" for f in findings)
    infos = sum(f["severity"] == "info" for f in findings)
    grep_hits = set()
    for line in last["grep"].stdout.splitlines():
        path, lineno, _ = line.split(":", 2)
        grep_hits.add((path, int(lineno)))
    not_reported = len(grep_hits - flagged)
    as_membership = len((grep_hits - flagged) & membership)
    missed_by_grep = len(flagged - grep_hits)
    ruff_findings = len(json.loads(last["ruff"].stdout or "[]"))

    best = {k: min(v) for k, v in times.items()}
    median = {k: statistics.median(v) for k, v in times.items()}
    rows = [
        ("kvtier audit", best["kvtier"], median["kvtier"], f"{errors}E/{warnings_}W/{infos}I"),
        ("ruff check E,F", best["ruff"], median["ruff"], str(ruff_findings)),
        ("grep presence", best["grep"], median["grep"], str(len(grep_hits))),
    ]
    print(f"vLLM tree: {tree}  ({files} .py files, {report['parsed']} mention block_hash; "
          f"{os.cpu_count()} CPUs, {args.repeat} runs each)")
    print(f"{'tool':<16}{'best s':>9}{'median s':>10}{'files/s':>10}{'x ruff':>8}  findings")
    for name, b, m, found in rows:
        print(f"{name:<16}{b:>9.3f}{m:>10.3f}{files / b:>10.0f}{b / best['ruff']:>8.2f}  {found}")
    print(f"grep hits kvtier rightly does not report as warning/error: {not_reported} of "
          f"{len(grep_hits)} ({as_membership} shown as info: cache membership; "
          f"{not_reported - as_membership} not blocks or partial-aware)")
    print(f"kvtier warnings/errors that grep misses (aliases, multi-line tests): "
          f"{missed_by_grep}")
    result = {
        "ratios": {"time_vs_ruff": best["kvtier"] / best["ruff"],
                   "time_vs_grep": best["kvtier"] / best["grep"],
                   "median_time_vs_ruff": median["kvtier"] / median["ruff"]},
        "seconds": best["kvtier"], "seconds_median": median["kvtier"], "files": files,
        "files_per_second": files / best["kvtier"], "parsed": report["parsed"],
        "kvtier": {"errors": errors, "warnings": warnings_, "info": infos,
                   "times": times["kvtier"]},
        "ruff": {"seconds": best["ruff"], "seconds_median": median["ruff"],
                 "findings": ruff_findings, "times": times["ruff"]},
        "grep": {"seconds": best["grep"], "hits": len(grep_hits),
                 "not_reported_by_kvtier": not_reported, "reported_as_info": as_membership,
                 "kvtier_only": missed_by_grep,
                 "times": times["grep"]},
        "cpus": os.cpu_count(), "repeat": args.repeat,
    }
    write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
