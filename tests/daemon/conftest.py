"""Fixtures of the daemon's tests: the index's node table both ways, the C ``NodeTable`` and
the plain dict (:mod:`connector.events.node_table`), in process and in daemons started by a
test (they inherit the environment)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from connector.events import node_table

TABLES = ["c", "dict"]


def _use(mp: pytest.MonkeyPatch, kind: str) -> None:
    if kind == "c":
        if not node_table.C_TABLE:
            pytest.skip("the C node table is not built here (connector/events/_node_table.c)")
        if os.environ.get(node_table.ENV) == "1":
            pytest.skip(f"{node_table.ENV}=1: the dict only")
    mp.setattr(node_table, "use_c", kind == "c")
    if kind == "dict":
        mp.setenv(node_table.ENV, "1")


@pytest.fixture(params=TABLES)
def node_tables(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test runs once with each node table (``"c"``, ``"dict"``)."""
    _use(monkeypatch, request.param)
    return str(request.param)


@pytest.fixture(scope="module", params=TABLES)
def node_tables_module(request: pytest.FixtureRequest) -> Iterator[str]:
    """:func:`node_tables` for module-scoped fixtures (a daemon shared by a module's tests)."""
    with pytest.MonkeyPatch.context() as mp:
        _use(mp, request.param)
        yield str(request.param)
