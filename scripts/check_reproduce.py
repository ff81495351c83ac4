#!/usr/bin/env python3
"""Every pytest command RELIABILITY.md gives to reproduce a row selects at least one test.

Each backticked ``pytest ...`` command in a table row is run with ``--collect-only -q``
(nothing executes: no engine starts, no Redis is touched); a command that selects no test, or
that pytest cannot collect, is printed with its row and the exit status is 1. Not part of the
test suite: with ~250 commands it takes minutes on 2 cores (``make`` does not run it).

    .venv/bin/python scripts/check_reproduce.py [--rows 29,39] [--jobs 2]
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"`((?:[A-Z_]+=\S+ )*pytest [^`]+|\.\.\. [^`]+)`")
SELECTED = re.compile(r"(?:(\d+)/\d+|(\d+)) tests? collected")


def commands(text: str) -> list[tuple[str, str]]:
    """``(row, command)`` for each pytest command in a table row of ``text``."""
    out = []
    for line in text.splitlines():
        if not line.startswith("| "):
            continue
        row = line.split("|")[1].strip()
        out += [(row, m.group(1)) for m in COMMAND.finditer(line)]
    return out


def selected(command: str) -> tuple[int, str]:
    """How many tests ``command`` selects, and pytest's last line (its error when none)."""
    if command.startswith("... "):
        return 0, "an elided command (`...`): name the test file"
    words = shlex.split(command)
    env = dict(w.split("=", 1) for w in words if re.match(r"[A-Z_]+=", w))
    args = [w for w in words[words.index("pytest") + 1:] if w != "-s"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**_env(), **env})
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if "collected" in ln or "error" in ln), "")
    m = SELECTED.search(summary)
    count = int(m.group(1) or m.group(2)) if m and proc.returncode == 0 else 0
    return count, summary or (proc.stderr.strip().splitlines() or ["no output"])[-1]


def _env() -> dict[str, str]:
    import os
    return dict(os.environ)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", help="comma-separated row ids to check (default: all)")
    ap.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args(argv)
    todo = commands((REPO / "RELIABILITY.md").read_text(encoding="utf-8"))
    if args.rows:
        wanted = set(args.rows.split(","))
        todo = [(r, c) for r, c in todo if r in wanted]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(lambda rc: selected(rc[1]), todo))
    bad = 0
    for (row, command), (count, summary) in zip(todo, results, strict=True):
        if count < 1:
            bad += 1
            print(f"row {row}: selects nothing: {command}\n    {summary}")
    print(f"{len(todo) - bad} of {len(todo)} commands select at least one test")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
