"""Test helpers around the event index: apply a run, expand it, recount entries by scan."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any, NamedTuple

from connector.events.index import (
    CLEAR,
    REMOVE,
    STORE,
    KVIndex,
    Publisher,
    ResidencyKey,
    Run,
    kind_name,
)
from offload_tiers.keys import BlockKind


class Entry(NamedTuple):
    """One announced hash of a run, with every fact about it."""

    publisher: Publisher
    medium: str
    group: int
    block_hash: Any
    parent: Any
    num_tokens: int | None  # None: unknown (parent not seen yet)
    kind: BlockKind | None  # None: PENDING (group block size not known yet)
    ownership: str | None


def entries(run: Run) -> Iterator[Entry]:
    """Expand a STORE/REMOVE run into one :class:`Entry` per hash."""
    pub, medium, group, own = run.key
    parent = run.parent
    for i, h in enumerate(run.hashes):
        nt = run.first_tokens + i * run.step if run.first_tokens else None
        yield Entry(pub, medium, group, h, parent, nt, run.kind, own)
        parent = h


def apply(index: KVIndex, run: Run, now: float = 0.0) -> None:
    """Apply one classified run as the daemon's ingest does (``now``: for TTLs)."""
    if run.op == STORE:
        index.store(run, now)
    elif run.op == REMOVE:
        index.remove(run.key, run.hashes)
    elif run.op == CLEAR:
        index.clear(run.key[0], (run.key[1],))


def facts(index: KVIndex, key: ResidencyKey, block_hash: Any) -> int | None:
    """Packed facts of a resident entry, or ``None``."""
    d = index.res.get(key)
    return d.get(block_hash) if d else None


def scan_entry_counts(index: KVIndex) -> dict[tuple[str, str], int]:
    """What :meth:`KVIndex.entry_counts` keeps incrementally, by a full scan of the entries."""
    counts: dict[tuple[str, str], int] = {}
    for (_pub, medium, _group, _own), d in index.res.items():
        for bits, c in Counter(f & 3 for f in d.values()).items():
            k = (medium, kind_name(bits))
            counts[k] = counts.get(k, 0) + c
    return counts
