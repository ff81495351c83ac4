"""Every mutant RELIABILITY.md claims is caught, caught here: each one is applied in its own
pytest process (:mod:`tests.mutants.apply`, forked by :mod:`tests.mutants.run`) and every
test named in :mod:`tests.mutants.table` must fail under it; without a mutant the same tests
pass (one control run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rigs.redis_server import RedisServer
from tests.mutants.table import MUTANTS

REPO = Path(__file__).resolve().parents[2]
SEED = 0  # hypothesis tests draw the same examples on every run
CONTROL = "none"


def pytest_args(node_ids: list[str]) -> list[str]:
    return ["-q", "-p", "no:cacheprovider", "-p", "tests.mutants.apply",
            "-W", "ignore::pytest.PytestAssertRewriteWarning",  # hypothesis: imported by run
            f"--hypothesis-seed={SEED}", "--timeout=120", *node_ids]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Each mutant's run and the control run: exit code, outcome per test, output."""
    tmp = tmp_path_factory.mktemp("mutants")
    # A redis-server of the harness's own: other tests' keys never share its SCANs.
    server = RedisServer(tmp / "redis").start()
    env = {**os.environ, "KVTIER_TEST_REDIS_URL": server.url}
    every = sorted({n for m in MUTANTS.values() for n in m.kills})
    plan = {name: list(m.kills) for name, m in MUTANTS.items()} | {CONTROL: every}
    jobs = [{"mutant": name, "args": pytest_args(ids), "report": str(tmp / f"{name}.json"),
             "log": str(tmp / f"{name}.log")} for name, ids in plan.items()]
    path = tmp / "jobs.json"
    path.write_text(json.dumps(jobs))
    start = time.monotonic()
    try:
        subprocess.run([sys.executable, "-m", "tests.mutants.run", str(path)], cwd=REPO,
                       env=env, check=True, timeout=240)
    finally:
        server.stop()
    done = json.loads((tmp / "jobs.json.rc").read_text())
    print(f"\nmutants: {len(jobs)} runs in {time.monotonic() - start:.1f} s: "
          + ", ".join(f"{n} {d['seconds']:.1f} s ({d['cpu_seconds']:.1f} s CPU)"
                     for n, d in done.items()))
    out = {}
    for job in jobs:
        report = Path(job["report"])
        out[job["mutant"]] = {
            "rc": done[job["mutant"]]["rc"],
            "outcomes": json.loads(report.read_text()) if report.exists() else {},
            "log": Path(job["log"]).read_text()[-4000:]}
    return out


def selected(outcomes: dict[str, str], node_id: str) -> dict[str, str]:
    """The tests ``node_id`` selected (itself, or its parametrized cases)."""
    return {n: o for n, o in outcomes.items() if n == node_id or n.startswith(node_id + "[")}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_killed_by_each_of_its_tests(name: str, runs: dict[str, Any]) -> None:
    run = runs[name]
    assert run["rc"] == 1, f"pytest exit {run['rc']} under {name}:\n{run['log']}"
    for node_id in MUTANTS[name].kills:
        got = selected(run["outcomes"], node_id)
        assert got, f"{node_id} ran no test under {name}:\n{run['log']}"
        survived = {n: o for n, o in got.items() if o != "failed"}
        assert not survived, f"mutant {name} survived {survived}:\n{run['log']}"


def test_the_same_tests_pass_without_a_mutant(runs: dict[str, Any]) -> None:
    run = runs[CONTROL]
    assert run["rc"] == 0, f"pytest exit {run['rc']} without a mutant:\n{run['log']}"
    for node_id in sorted({n for m in MUTANTS.values() for n in m.kills}):
        got = selected(run["outcomes"], node_id)
        assert got and set(got.values()) == {"passed"}, (node_id, got, run["log"])
