"""pytest plugin: ``-p tests.mutants.apply`` with ``KVTIER_MUTANT=<name>`` applies that
mutant from :mod:`tests.mutants.table` before any test module is imported
(``KVTIER_MUTANT=none``: no patch, the control run).

Hypothesis runs without an example database and without shrinking (the harness pins
``--hypothesis-seed``), state machines at most :data:`MAX_EXAMPLES` examples, so the same
tests draw the same examples on every run and a failure ends the test at once.
``KVTIER_MUTANT_REPORT=<path>`` receives ``{node id: "passed" | "failed" | "skipped"}``.
"""

from __future__ import annotations

import json
import os

import hypothesis.stateful
import pytest
from hypothesis import Phase, settings
from hypothesis import settings as Settings

from tests.mutants.table import MUTANTS

settings.register_profile("kvtier-mutants", database=None,
                          phases=(Phase.explicit, Phase.generate), print_blob=False)
settings.load_profile("kvtier-mutants")

#: State machines run at most this many examples here (their own settings say more).
MAX_EXAMPLES = 15
_run_machine = hypothesis.stateful.run_state_machine_as_test


def _capped(machine: type, *, settings: Settings | None = None, **kw: object) -> None:
    own = settings if settings is not None else machine.TestCase.settings
    capped = Settings(own, max_examples=min(own.max_examples, MAX_EXAMPLES))
    _run_machine(machine, settings=capped, **kw)


hypothesis.stateful.run_state_machine_as_test = _capped

_NAME = os.environ.get("KVTIER_MUTANT", "")
if _NAME != "none":
    if _NAME not in MUTANTS:
        raise pytest.UsageError(f"KVTIER_MUTANT={_NAME!r}: not one of {sorted(MUTANTS)} or none")
    MUTANTS[_NAME].patch(pytest.MonkeyPatch())

_outcomes: dict[str, str] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.skipped:
        _outcomes.setdefault(report.nodeid, "skipped")
    elif report.when == "call":
        _outcomes.setdefault(report.nodeid, "passed")


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("KVTIER_MUTANT_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(_outcomes, f, indent=1)
