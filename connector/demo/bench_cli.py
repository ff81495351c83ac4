"""``kvtier bench NAME [args]``: run one of the side-by-side benchmarks in ``benchmarks/``.

The benchmarks live in the source checkout (they compare kvtier with peers that are not
kvtier's dependencies), so this only works from a clone, with an editable install.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

BENCHMARKS = ("events", "tiers", "audit", "e2e")


def benchmarks_dir() -> Path:
    """``benchmarks/`` next to the installed ``connector`` package (an editable install)."""
    return Path(__file__).resolve().parent.parent / "benchmarks"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvtier bench", description=__doc__)
    parser.add_argument("name", choices=BENCHMARKS, help="which benchmark to run")
    parser.add_argument("args", nargs=argparse.REMAINDER,
                        help="passed to the benchmark (e.g. --quick --json out.json)")
    ns = parser.parse_args(argv)
    script = benchmarks_dir() / f"bench_{ns.name}.py"
    if not script.is_file():
        print(f"kvtier bench: {script} not found; run from a source checkout "
              "(pip install -e .)", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(script), *ns.args])
