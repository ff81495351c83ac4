"""``kvtier bench NAME [args]``: run one of the side-by-side benchmarks in ``benchmarks/``
(as ``python -m benchmarks.bench_NAME [args]`` from the checkout's root would).

The benchmarks live in the source checkout (they compare kvtier with peers that are not
kvtier's dependencies). They are looked for in ``$KVTIER_BENCHMARKS``, then ``./benchmarks``,
then beside the installed packages (an editable install of a clone).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = ("events", "tiers", "audit", "e2e")


def benchmarks_dir() -> Path | None:
    """The first of ``$KVTIER_BENCHMARKS``, ``./benchmarks``, ``<checkout>/benchmarks``."""
    candidates = [Path(os.environ["KVTIER_BENCHMARKS"])] if os.environ.get(
        "KVTIER_BENCHMARKS") else []
    candidates += [Path.cwd() / "benchmarks", Path(__file__).resolve().parents[2] / "benchmarks"]
    return next((c for c in candidates if (c / "bench_e2e.py").is_file()), None)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvtier bench", description=__doc__)
    parser.add_argument("name", choices=BENCHMARKS, help="which benchmark to run")
    parser.add_argument("args", nargs=argparse.REMAINDER,
                        help="passed to the benchmark (e.g. --quick --json out.json)")
    ns = parser.parse_args(argv)
    folder = benchmarks_dir()
    if folder is None:
        print("kvtier bench: no benchmarks/ folder found; run from a clone of kvtier or set "
              "KVTIER_BENCHMARKS to its benchmarks/ folder", file=sys.stderr)
        return 2
    # A benchmark runs as a module of its checkout (``python -m benchmarks.bench_NAME``): the
    # checkout goes on the child's path, the caller's working directory stays (``--json out``).
    path = os.pathsep.join(p for p in (str(folder.parent), os.environ.get("PYTHONPATH")) if p)
    return subprocess.call([sys.executable, "-m", f"benchmarks.bench_{ns.name}", *ns.args],
                           env={**os.environ, "PYTHONPATH": path})
