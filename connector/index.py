"""The partial-aware, reference-counted residency index.

Residency is reference-counted per (publisher incl. DP rank, medium, group, ownership): a
hash stays resident until its last announcement there is removed; a removal of an unknown
hash is harmless (counted); ``AllBlocksCleared`` drops everything of that publisher.

Each residency key maps hash -> packed facts (``num_tokens * 4 + kind``, see
:func:`connector.classify.pack`); counts above one live in a small side table, so the common
case (announced once, removed once) costs one dict entry and the bulk paths stay in C.
Facts live exactly as long as the entry: memory is bounded by ``max_entries``; stores
beyond it are dropped and counted, which can only make look-ups answer *less*.

Look-up answers the longest cached prefix of a chain of block hashes (as vLLM computes
them), per medium and over all media: FULL entries count whole; a PARTIAL entry can only
end a prefix and counts only its own ``num_tokens``; nothing extends past a partial;
PLACEHOLDER and PENDING entries never count.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import repeat
from operator import and_
from typing import Any, NamedTuple

from connector.classify import (
    CLEAR,
    FULL,
    PARTIAL,
    PENDING,
    PG,
    REMOVE,
    STORE,
    GroupSizes,
    Publisher,
    ResidencyKey,
    Run,
    kind_name,
    merge,
)
from connector.events import MEDIUMS

__all__ = ["ANY", "KVIndex", "PrefixMatch"]

ANY = "any"
_MISS = -4  # dict.pop default in bulk removals: never a packed value, and -4 & 3 == 0


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

    __slots__ = ("sizes", "max_entries", "res", "extra", "by_pg", "kinds", "n_entries",
                 "dropped_capacity", "unknown_removals", "stores", "removals", "clears")

    def __init__(self, sizes: GroupSizes | None = None, max_entries: int = 10_000_000) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self.sizes = sizes if sizes is not None else GroupSizes()
        self.max_entries = max_entries
        self.res: dict[ResidencyKey, dict[Any, int]] = {}
        self.extra: dict[ResidencyKey, dict[Any, int]] = {}  # refcount - 1, when > 0
        self.by_pg: dict[PG, list[ResidencyKey]] = {}
        self.kinds: dict[ResidencyKey, list[int]] = {}  # resident entries per kind, per key
        self.n_entries = 0
        self.dropped_capacity = 0
        self.unknown_removals = 0
        self.stores = 0  # hash announcements applied
        self.removals = 0  # hash removals applied (known)
        self.clears = 0

    # -- updates -------------------------------------------------------------------------

    def apply(self, run: Run) -> None:
        """Apply one classified run."""
        op = run.op
        if op == STORE:
            self.store(run)
        elif op == REMOVE:
            self.remove(run.key, run.hashes)
        elif op == CLEAR:
            self.clear(run.key[0])

    def _dict(self, key: ResidencyKey) -> dict[Any, int]:
        d = self.res.get(key)
        if d is None:
            d = self.res[key] = {}
            self.kinds[key] = [0, 0, 0, 0]
            self.by_pg.setdefault((key[0], key[2]), []).append(key)
        return d

    def store(self, run: Run) -> None:
        """One more announcement of each hash of a STORE run, with its facts."""
        key, hashes = run.key, run.hashes
        d = self.res.get(key)
        if d is None:
            d = self._dict(key)
        n = len(hashes)
        self.stores += n
        first = run.first_tokens
        if n == 1:
            h = hashes[0]
            packed = first * 4 + run.kind
            old = d.get(h)
            if old is None:
                if self.n_entries < self.max_entries:
                    d[h] = packed
                    self.n_entries += 1
                    self.kinds[key][packed & 3] += 1
                else:
                    self.dropped_capacity += 1
            else:
                self._again(key, h, old, packed, d)
            return
        if first:
            step4 = run.step * 4
            base = first * 4 + run.kind
            values: Iterable[int] = range(base, base + n * step4, step4)
        else:
            values = repeat(run.kind, n)
        if self.n_entries + n <= self.max_entries and d.keys().isdisjoint(hashes):
            before = len(d)
            d.update(zip(hashes, values, strict=True))
            added = len(d) - before
            self.n_entries += added
            self.kinds[key][run.kind] += added
            if added != n:  # the same hash twice in one event: count it twice
                ex = self.extra.setdefault(key, {})
                for h, c in Counter(hashes).items():
                    if c > 1:
                        ex[h] = ex.get(h, 0) + c - 1
            return
        kc = self.kinds[key]
        for h, packed in zip(hashes, values, strict=True):
            old = d.get(h)
            if old is None:
                if self.n_entries < self.max_entries:
                    d[h] = packed
                    self.n_entries += 1
                    kc[packed & 3] += 1
                else:
                    self.dropped_capacity += 1
            else:
                self._again(key, h, old, packed, d)

    def _again(self, key: ResidencyKey, h: Any, old: int, packed: int,
               d: dict[Any, int]) -> None:
        ex = self.extra.get(key)
        if ex is None:
            ex = self.extra[key] = {}
        ex[h] = ex.get(h, 0) + 1
        if old != packed:
            self._set(key, d, h, old, merge(old, packed))

    def _set(self, key: ResidencyKey, d: dict[Any, int], h: Any, old: int, new: int) -> None:
        """Replace the facts of a resident entry, keeping the per-kind counts right."""
        d[h] = new
        if (old ^ new) & 3:
            kc = self.kinds[key]
            kc[old & 3] -= 1
            kc[new & 3] += 1

    def remove(self, key: ResidencyKey, hashes: Sequence[Any]) -> None:
        """Drop one announcement of each hash under ``key``; unknown hashes are counted."""
        n = len(hashes)
        d = self.res.get(key)
        if d is None:
            self.unknown_removals += n
            return
        ex = self.extra.get(key)
        kc = self.kinds[key]
        if not ex or ex.keys().isdisjoint(hashes):
            # C-speed bulk path: pop each; misses return the sentinel (facts are >= 0).
            popped = list(map(d.pop, hashes, repeat(_MISS, n)))
            missing = popped.count(_MISS)
            gone = n - missing
            if gone:
                per_kind = Counter(map(and_, popped, repeat(3, n)))
                per_kind[_MISS & 3] -= missing
                for kind, c in per_kind.items():
                    kc[kind] -= c
        else:
            missing = gone = 0
            for h in hashes:
                c = ex.get(h)
                if c:
                    if c == 1:
                        del ex[h]
                    else:
                        ex[h] = c - 1
                    continue
                f = d.pop(h, None)
                if f is None:
                    missing += 1
                else:
                    gone += 1
                    kc[f & 3] -= 1
            if not ex:
                del self.extra[key]
        self.unknown_removals += missing
        self.removals += n - missing
        self.n_entries -= gone

    def clear(self, publisher: Publisher, mediums: Iterable[str] | None = None) -> int:
        """Drop every entry of ``publisher`` (optionally only on ``mediums``); return count."""
        wanted = None if mediums is None else set(mediums)
        dropped = 0
        for key in [k for k in self.res if k[0] == publisher]:
            if wanted is None or key[1] in wanted:
                dropped += len(self.res.pop(key))
                self.extra.pop(key, None)
                del self.kinds[key]
                pg = (key[0], key[2])
                self.by_pg[pg].remove(key)
                if not self.by_pg[pg]:
                    del self.by_pg[pg]
        self.n_entries -= dropped
        self.clears += 1
        return dropped

    # -- PositionSource (what the classifier asks) ----------------------------------------

    def position_of(self, pg: PG, block_hash: Any) -> int:
        """``num_tokens`` of a resident hash of (publisher, group); 0 when unknown."""
        for key in self.by_pg.get(pg, ()):
            f = self.res[key].get(block_hash)
            if f is not None and f >> 2:
                return f >> 2
        return 0

    def rewrite(self, pg: PG, fn: Callable[[Any, int], int | None]) -> None:
        """Replace facts of resident entries of (publisher, group) where ``fn`` says so."""
        for key in self.by_pg.get(pg, ()):
            d = self.res[key]
            for h, f in list(d.items()):
                new = fn(h, f)
                if new is not None:
                    self._set(key, d, h, f, new)

    def rewrite_hashes(self, pg: PG, updates: Mapping[Any, int]) -> None:
        """Merge known facts into resident entries of (publisher, group)."""
        for key in self.by_pg.get(pg, ()):
            d = self.res[key]
            for h, f in updates.items():
                old = d.get(h)
                if old is not None:
                    self._set(key, d, h, old, merge(old, f))

    # -- queries -------------------------------------------------------------------------

    def refcount(self, key: ResidencyKey, block_hash: Any) -> int:
        d = self.res.get(key)
        if not d or block_hash not in d:
            return 0
        return 1 + self.extra.get(key, {}).get(block_hash, 0)

    def facts(self, key: ResidencyKey, block_hash: Any) -> int | None:
        """Packed facts of a resident entry, or ``None``."""
        d = self.res.get(key)
        return d.get(block_hash) if d else None

    def _sources(self, medium: str | None, group: int,
                 publisher: Publisher | None) -> list[dict[Any, int]]:
        return [d for key, d in self.res.items()
                if key[2] == group and d
                and (medium is None or key[1] == medium)
                and (publisher is None or key[0] == publisher)]

    def lookup(self, block_hashes: Sequence[Any], group: int = 0, unit: int | None = None,
               publisher: Publisher | None = None,
               mediums: Sequence[str] = MEDIUMS) -> dict[str, PrefixMatch]:
        """Longest cached prefix of ``block_hashes`` per medium and over all (``"any"``).

        ``block_hashes`` is the request's chain, one hash per ``unit`` tokens (default: the
        group's block size). Pass ``unit`` = vLLM's hash block size (``prefix_match_unit``)
        with the request's fine-grained ``block_hashes`` to let partial entries end a prefix.
        """
        b = self.sizes.group_block_size(group, publisher)
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
        """Every resident entry of ``block_hashes`` in ``group``, with its facts (/entries)."""
        out = []
        for key, d in self.res.items():
            if key[2] != group:
                continue
            for h in block_hashes:
                f = d.get(h)
                if f is not None:
                    out.append({"block_hash": h, "publisher": key[0], "medium": key[1],
                                "ownership": key[3], "refcount": self.refcount(key, h),
                                "num_tokens": (f >> 2) or None, "kind": kind_name(f & 3)})
        return out

    def entry_counts(self) -> dict[tuple[str, str], int]:
        """Resident entries by (medium, kind name), kept incrementally: O(residency keys)."""
        counts: dict[tuple[str, str], int] = {}
        for (_pub, medium, _group, _own), kc in self.kinds.items():
            for kind, c in enumerate(kc):
                if c:
                    k = (medium, kind_name(kind))
                    counts[k] = counts.get(k, 0) + c
        return counts

    def scan_entry_counts(self) -> dict[tuple[str, str], int]:
        """The same as :meth:`entry_counts` by a full O(entries) scan (for tests)."""
        counts: dict[tuple[str, str], int] = {}
        for (_pub, medium, _group, _own), d in self.res.items():
            per_kind = Counter(f & 3 for f in d.values())
            for kind, c in per_kind.items():
                k = (medium, kind_name(kind))
                counts[k] = counts.get(k, 0) + c
        return counts


def _walk(chain: Sequence[Any], sources: list[dict[Any, int]], u: int, b: int) -> PrefixMatch:
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
        for d in sources:
            f = d.get(h)
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
