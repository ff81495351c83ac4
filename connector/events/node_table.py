"""The index's node table (block hash -> node, :mod:`connector.events.index`): C or a dict.

Rules it keeps:

* With the C extension built (``connector.events._node_table``, an optional extension of the
  package build), :func:`new_table` makes a ``NodeTable``: a dict for every key, with the ints
  in ``[0, 2**64)`` (vLLM's block hashes) kept inline in an open-addressing table, so a
  look-up costs one cache line instead of a Python dict's three (slot, key object, value
  object). Every other key (bytes digests, negatives, ...) lives in a dict inside it.
* Without it (no compiler where kvtier was installed), or with ``KVTIER_PURE_PYTHON_INDEX=1``
  in the environment, a plain ``dict``: same answers, the walks in Python.
* :func:`walk_groups` is ``index.lane_groups``' walk in C, for a ``NodeTable`` only; ``None``
  tells the caller to walk in Python (a dict, or a node that is not an int below ``2**127``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

__all__ = ["C_PACKING", "C_TABLE", "ENV", "NodeTable", "new_table", "use_c", "walk_groups"]

ENV = "KVTIER_PURE_PYTHON_INDEX"
"""Set to ``1``: index with a plain dict and walk in Python, even where the C table is built."""

NodeTable: type[MutableMapping[Any, Any]] | None
_c_walk: Callable[[Any, Sequence[Any], int], list[tuple[int, int]] | None] | None
C_PACKING: tuple[int, int] | None = None
"""(SHIFT, FULL kind bits) the C walk reads nodes with (``index`` checks they are its own)."""
try:
    from connector.events import _node_table
except ImportError:  # not built (no compiler at install time): the dict
    NodeTable = _c_walk = None
else:
    NodeTable, _c_walk = _node_table.NodeTable, _node_table.lane_groups
    C_PACKING = (_node_table.SHIFT, _node_table.FULL_BITS)
    MutableMapping.register(NodeTable)

C_TABLE: bool = NodeTable is not None
"""The C extension imports here."""

use_c: bool = C_TABLE and os.environ.get(ENV, "") != "1"
"""Whether :func:`new_table` makes C tables (tests flip it to run both)."""


def new_table() -> MutableMapping[Any, Any]:
    """An empty node table: a ``NodeTable`` when :data:`use_c`, else a ``dict``."""
    if use_c and NodeTable is not None:
        return NodeTable()
    return {}


def walk_groups(nodes: Mapping[Any, Any], ends: Sequence[Any],
                b: int) -> list[tuple[int, int]] | None:
    """``index.lane_groups`` over the block ends ``ends`` in one C pass, for a ``NodeTable``;
    ``None`` for a dict, or where a node is not an int below ``2**127`` (walk in Python)."""
    if _c_walk is None or type(nodes) is not NodeTable:
        return None
    return _c_walk(nodes, ends, b)
