"""Count the engines a test session starts (printed at the end of ``make test``).

``conftest.py`` points ``KVTIER_ENGINE_STARTS`` at one file for the whole session (xdist
workers inherit it); every helper that starts an engine appends one line to it.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

ENV = "KVTIER_ENGINE_STARTS"


def describe(spec: dict[str, Any]) -> str:
    """A spec's engine in a few words: model, parallel shape, with or without kvtier."""
    engine = spec.get("engine") or {}
    shape = f"tp{engine.get('tensor_parallel_size', 1)}"
    model = spec.get("model", "llama")
    mode = spec.get("mode")  # native_tier_engine's: none, cpu, fs, kvtier
    if spec.get("extra") is not None or mode == "kvtier":
        kind = "kvtier"
    elif mode in ("cpu", "fs"):
        kind = f"native {mode} tier"
    else:
        kind = "baseline"
    return f"{model} {shape} {kind}"


def record(kind: str, spec: dict[str, Any] | None = None, count: int = 1) -> None:
    """Note ``count`` engine starts of ``kind`` (no-op outside a test session)."""
    path = os.environ.get(ENV)
    if not path:
        return
    label = f"{kind}: {describe(spec)}" if spec is not None else kind
    test_file = os.environ.get("PYTEST_CURRENT_TEST", "?").split("::", 1)[0]
    with open(path, "a", encoding="utf-8") as fh:  # one short line per write: O_APPEND
        fh.write(f"{count}\t{label}\t{test_file}\n")


def summary(path: Path) -> tuple[int, Counter[str], Counter[str]]:
    """Total engine starts, starts by kind and starts by test file, from the session's file."""
    by_kind: Counter[str] = Counter()
    by_file: Counter[str] = Counter()
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            count, label, test_file = (line.split("\t") + ["?"])[:3]
            by_kind[label] += int(count)
            by_file[test_file] += int(count)
    return sum(by_kind.values()), by_kind, by_file
