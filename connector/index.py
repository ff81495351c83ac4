"""The partial-aware, reference-counted residency index.

Residency is reference-counted per (publisher incl. DP rank, medium, group, ownership): a
hash stays resident until its last announcement there is removed; a removal of an unknown
hash is harmless (counted); ``AllBlocksCleared`` drops everything of that publisher.

Look-up answers the longest cached prefix of a chain of block hashes (as vLLM computes
them), per medium and over all media: FULL entries count whole; a PARTIAL entry can only
end a prefix and counts only its own ``num_tokens``; nothing extends past a partial;
PLACEHOLDER and PENDING entries never count.

Memory is bounded by ``max_entries`` (distinct resident (residency key, hash) pairs); stores
beyond it are dropped and counted, which can only make look-ups answer *less*, never a
wrong block. Facts of hashes no longer resident anywhere are pruned on an amortised sweep.
"""

from __future__ import annotations

from collections import _count_elements  # type: ignore[attr-defined]  # C fast path
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from connector.classify import (
    CLEAR,
    FULL,
    PARTIAL,
    PENDING,
    REMOVE,
    STORE,
    BlockFacts,
    Publisher,
    ResidencyKey,
    Run,
    kind_name,
)
from connector.events import MEDIUMS

__all__ = ["ANY", "KVIndex", "PrefixMatch"]

ANY = "any"
_FACTS_SWEEP_FLOOR = 4096


class PrefixMatch(NamedTuple):
    """Longest cached prefix on one medium: ``tokens`` cached, of which ``full_blocks``
    whole blocks; ``partial`` when the prefix ends with a partial entry."""

    tokens: int
    full_blocks: int
    partial: bool

    def as_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "full_blocks": self.full_blocks, "partial": self.partial}


_EMPTY = PrefixMatch(0, 0, False)


class KVIndex:
    """Refcounted residency + longest-prefix look-up. Not thread-safe: one writer."""

    __slots__ = ("facts", "max_entries", "res", "n_entries", "dropped_capacity",
                 "unknown_removals", "stores", "removals", "clears", "_sweep_at")

    def __init__(self, facts: BlockFacts, max_entries: int = 10_000_000) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self.facts = facts
        self.max_entries = max_entries
        self.res: dict[ResidencyKey, dict[Any, int]] = {}
        self.n_entries = 0
        self.dropped_capacity = 0
        self.unknown_removals = 0
        self.stores = 0  # hash announcements applied
        self.removals = 0  # hash removals applied (known)
        self.clears = 0
        self._sweep_at: dict[tuple[Publisher, int], int] = {}

    # -- updates -------------------------------------------------------------------------

    def apply(self, run: Run) -> None:
        """Apply one classified run."""
        op = run.op
        if op == STORE:
            self.store(run.key, run.hashes)
        elif op == REMOVE:
            self.remove(run.key, run.hashes)
        elif op == CLEAR:
            self.clear(run.key[0])

    def apply_all(self, runs: Iterable[Run | None]) -> None:
        for run in runs:
            if run is not None:
                self.apply(run)

    def store(self, key: ResidencyKey, hashes: Sequence[Any]) -> None:
        """One more announcement of each hash under ``key``."""
        d = self.res.get(key)
        if d is None:
            d = self.res[key] = {}
        n = len(hashes)
        before = len(d)
        if self.n_entries + n <= self.max_entries:
            _count_elements(d, hashes)
            self.n_entries += len(d) - before
        else:
            for h in hashes:
                c = d.get(h)
                if c is not None:
                    d[h] = c + 1
                elif self.n_entries < self.max_entries:
                    d[h] = 1
                    self.n_entries += 1
                else:
                    self.dropped_capacity += 1
        self.stores += n
        pg = (key[0], key[2])
        fd = self.facts.by_pg.get(pg)
        if fd is not None and len(fd) > self._sweep_at.get(pg, _FACTS_SWEEP_FLOOR):
            self._sweep(pg)

    def remove(self, key: ResidencyKey, hashes: Iterable[Any]) -> None:
        """Drop one announcement of each hash under ``key``; unknown hashes are counted."""
        d = self.res.get(key)
        if d is None:
            n = len(hashes) if isinstance(hashes, Sequence) else sum(1 for _ in hashes)
            self.unknown_removals += n
            return
        unknown = 0
        gone = 0
        get = d.get
        for h in hashes:
            c = get(h)
            if c is None:
                unknown += 1
            elif c == 1:
                del d[h]
                gone += 1
            else:
                d[h] = c - 1
        self.unknown_removals += unknown
        self.n_entries -= gone
        if isinstance(hashes, Sequence):
            self.removals += len(hashes) - unknown

    def clear(self, publisher: Publisher, mediums: Iterable[str] | None = None) -> int:
        """Drop every entry of ``publisher`` (optionally only on ``mediums``); return count."""
        wanted = None if mediums is None else set(mediums)
        dropped = 0
        for key in [k for k in self.res if k[0] == publisher]:
            if wanted is None or key[1] in wanted:
                dropped += len(self.res.pop(key))
        self.n_entries -= dropped
        self.clears += 1
        if wanted is None:
            self.facts.forget_publisher(publisher)
        return dropped

    def _sweep(self, pg: tuple[Publisher, int]) -> None:
        live: set[Any] = set()
        for key, d in self.res.items():
            if key[0] == pg[0] and key[2] == pg[1]:
                live.update(d)
        self.facts.prune(pg, live)
        self._sweep_at[pg] = max(_FACTS_SWEEP_FLOOR, 2 * len(self.facts.by_pg.get(pg, ())))

    # -- queries -------------------------------------------------------------------------

    def refcount(self, key: ResidencyKey, block_hash: Any) -> int:
        d = self.res.get(key)
        return d.get(block_hash, 0) if d else 0

    def _sources(self, medium: str | None, group: int,
                 publisher: Publisher | None) -> list[tuple[dict[Any, int], dict[Any, int]]]:
        out = []
        for key, d in self.res.items():
            if key[2] != group or not d:
                continue
            if medium is not None and key[1] != medium:
                continue
            if publisher is not None and key[0] != publisher:
                continue
            out.append((d, self.facts.by_pg.get((key[0], group), {})))
        return out

    def lookup(self, block_hashes: Sequence[Any], group: int = 0, unit: int | None = None,
               publisher: Publisher | None = None,
               mediums: Sequence[str] = MEDIUMS) -> dict[str, PrefixMatch]:
        """Longest cached prefix of ``block_hashes`` per medium and over all (``"any"``).

        ``block_hashes`` is the request's chain, one hash per ``unit`` tokens (default: the
        group's block size). Pass ``unit`` = vLLM's hash block size (``prefix_match_unit``)
        with the request's fine-grained ``block_hashes`` to let partial entries end a prefix.
        """
        b = self.facts.group_block_size(group, publisher)
        result = {m: _EMPTY for m in mediums}
        result[ANY] = _EMPTY
        if b is None or not block_hashes:
            return result
        u = unit or b
        if u <= 0 or b % u:
            raise ValueError(f"unit {u} must divide the group's block size {b}")
        for medium in (*mediums, ANY):
            sources = self._sources(None if medium == ANY else medium, group, publisher)
            if sources:
                result[medium] = _walk(block_hashes, sources, u, b)
        return result

    def describe(self, block_hashes: Sequence[Any], group: int = 0) -> list[dict[str, Any]]:
        """Every resident entry of ``block_hashes`` in ``group``, with its facts (for /entries)."""
        wanted = list(block_hashes)
        out = []
        for (pub, medium, g, own), d in self.res.items():
            if g != group:
                continue
            for h in wanted:
                c = d.get(h)
                if c:
                    nt, kind = self.facts.lookup((pub, g), h)
                    out.append({"block_hash": h, "publisher": pub, "medium": medium,
                                "ownership": own, "refcount": c, "num_tokens": nt,
                                "kind": kind_name(kind)})
        return out

    def entry_counts(self) -> dict[tuple[str, str], int]:
        """Resident entries by (medium, kind name) — an O(entries) scan, for /metrics."""
        counts: dict[tuple[str, str], int] = {}
        for (pub, medium, group, _own), d in self.res.items():
            fd = self.facts.by_pg.get((pub, group), {})
            per_kind = [0, 0, 0, 0]
            for h in d:
                f = fd.get(h)
                per_kind[PENDING if f is None else f & 3] += 1
            for kind, c in enumerate(per_kind):
                if c:
                    k = (medium, kind_name(kind))
                    counts[k] = counts.get(k, 0) + c
        return counts


def _walk(chain: Sequence[Any], sources: list[tuple[dict[Any, int], dict[Any, int]]],
          u: int, b: int) -> PrefixMatch:
    prefix = 0
    full = 0
    best_partial = 0
    end = 0
    for h in chain:
        end += u
        limit = prefix + b
        if end > limit:
            break
        kind = PENDING
        for d, fd in sources:
            if h in d:
                f = fd.get(h)
                if f is None:
                    continue
                nt = f >> 2
                if nt and nt != end:  # recorded position disagrees with the chain: ignore
                    continue
                k = f & 3
                if k == FULL:
                    kind = FULL
                    break
                if k == PARTIAL:
                    kind = PARTIAL
        if kind == FULL and end == limit:
            prefix = end
            full += 1
            best_partial = 0
        elif kind == PARTIAL and end < limit:
            best_partial = end
    if best_partial > prefix:
        return PrefixMatch(best_partial, full, True)
    return PrefixMatch(prefix, full, False)
