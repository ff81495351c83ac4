"""Where kvtier can build its C node table, it did: else the C table's tests skip and the
daemon's index runs on the dict, and nothing would say so."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest

from connector.events import node_table


def _can_compile() -> bool:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = Path(sysconfig.get_paths()["include"], "Python.h")
    return shutil.which(cc) is not None and headers.exists()


def test_the_extension_is_built_where_a_compiler_and_python_headers_are() -> None:
    if not _can_compile():
        pytest.skip("no C compiler or no Python.h here: the index uses the dict")
    assert node_table.C_TABLE, (
        "connector/events/_node_table.c is not built although a compiler and Python.h are "
        "here: run `pip install -e .` (scripts/bootstrap.sh does) and read its build output")
