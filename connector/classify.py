"""Classify KV events into index updates: what each announced hash covers, and its kind.

Every announced hash becomes an entry carrying (publisher, medium, group, hash, parent,
num_tokens, kind). ``num_tokens`` is the cumulative prefix length the hash covers (vLLM's
``KVCacheBlock.block_hash_num_tokens``); ``kind`` is FULL, PARTIAL or PLACEHOLDER.

FULL vs PARTIAL is decided from the group's *physical block size* ``B`` (configured, or
learned from full announcements: a multi-hash store, or two different single-hash sizes),
never from the presence of a hash:

* ``num_tokens`` known  -> ``kind_for(num_tokens, ...)``: FULL iff it ends on a block boundary;
* ``num_tokens`` unknown (parent never seen) -> from the announcement's shape:
  ``block_size == B`` FULL, ``block_size < B`` PARTIAL;
* ``B`` unknown and a single-hash store -> PENDING (never counted) until ``B`` is learned;
* ``token_ids == []`` or ``block_size == 0`` -> PLACEHOLDER (never counted as a prefix).

To keep the hot path free of per-hash objects, :meth:`Classifier.classify` returns one
:class:`Run` per event (hashes + arithmetic progression of ``num_tokens``);
:meth:`Run.entries` expands it into :class:`Entry` tuples for callers who want them.
Facts about hashes (``num_tokens`` and kind, packed into one int) live in :class:`BlockFacts`,
which the index reads at look-up time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

from connector.events import normalize_medium, raw_array_len
from offload_tiers.keys import BlockKind

__all__ = [
    "CLEAR",
    "FULL",
    "PARTIAL",
    "PENDING",
    "PLACEHOLDER",
    "REMOVE",
    "STORE",
    "BlockFacts",
    "Classifier",
    "Entry",
    "Run",
    "kind_name",
]

# Kinds as small ints (BlockKind values) + PENDING for "not decidable yet".
PENDING = 0
FULL = int(BlockKind.FULL)
PARTIAL = int(BlockKind.PARTIAL)
PLACEHOLDER = int(BlockKind.PLACEHOLDER)
_KIND_NAMES = {PENDING: "PENDING", FULL: "FULL", PARTIAL: "PARTIAL", PLACEHOLDER: "PLACEHOLDER"}

STORE, REMOVE, CLEAR = 1, 2, 3

Publisher = str
ResidencyKey = tuple[Publisher, str, int, str | None]  # (publisher, medium, group, ownership)
PG = tuple[Publisher, int]  # (publisher, group)


def kind_name(kind: int) -> str:
    """``"FULL"``, ``"PARTIAL"``, ``"PLACEHOLDER"`` or ``"PENDING"``."""
    return _KIND_NAMES[kind]


def as_block_kind(kind: int) -> BlockKind | None:
    """The lead's :class:`BlockKind` for a kind int (``None`` for PENDING)."""
    return None if kind == PENDING else BlockKind(kind)


class Entry(NamedTuple):
    """One announced hash, with every fact about it."""

    publisher: Publisher
    medium: str
    group: int
    block_hash: Any
    parent: Any
    num_tokens: int | None  # None: unknown (parent not seen yet)
    kind: BlockKind | None  # None: PENDING (group block size not known yet)
    ownership: str | None


class Run(NamedTuple):
    """One event's effect on the index: ``op`` applied to ``hashes`` under ``key``.

    For STORE, hash ``i`` covers ``first_tokens + i * step`` tokens when ``first_tokens``
    is non-zero (0 = unknown). ``kind`` is the kind the classifier decided for this run;
    the authoritative per-hash fact is in :class:`BlockFacts`.
    """

    op: int
    key: ResidencyKey
    hashes: list[Any]
    parent: Any
    first_tokens: int
    step: int
    kind: int

    def entries(self) -> Iterator[Entry]:
        """Expand a STORE/REMOVE run into :class:`Entry` tuples."""
        pub, medium, group, own = self.key
        kind = as_block_kind(self.kind)
        parent = self.parent
        for i, h in enumerate(self.hashes):
            nt = self.first_tokens + i * self.step if self.first_tokens else None
            yield Entry(pub, medium, group, h, parent, nt, kind, own)
            parent = h


_OPS: dict[type, int] = {}


def _op_of(event: Any) -> int:
    """STORE/REMOVE/CLEAR from an event's tag (class name), cached per type; 0 if none."""
    name = type(event).__name__
    op = 0
    if name.endswith("BlockStored"):
        op = STORE
    elif name.endswith("BlockRemoved"):
        op = REMOVE
    elif name.endswith("AllBlocksCleared"):
        op = CLEAR
    if op:
        _OPS[type(event)] = op
    return op


class BlockFacts:
    """What each hash covers, per (publisher, group): ``num_tokens * 4 + kind`` in one int.

    Also holds each group's physical block size (configured or learned), the single-hash
    stores whose kind waits for that size (PENDING), and stores whose parent was not seen yet
    (orphans, resolved when the parent's ``num_tokens`` becomes known). Everything is
    bounded: ``max_pending`` caps pending and orphan records per (publisher, group).
    """

    __slots__ = ("by_pg", "sizes", "configured", "pending", "orphans", "single_sizes",
                 "max_pending", "dropped_pending")

    def __init__(self, block_sizes: Mapping[int, int] | None = None,
                 max_pending: int = 65536) -> None:
        self.by_pg: dict[PG, dict[Any, int]] = {}
        self.sizes: dict[PG, int] = {}
        self.configured: dict[int, int] = dict(block_sizes or {})
        for g, b in self.configured.items():
            if b <= 0:
                raise ValueError(f"block size of group {g} must be positive, got {b}")
        self.pending: dict[PG, dict[Any, int]] = {}
        self.orphans: dict[PG, dict[Any, list[tuple[list[Any], int, bool]]]] = {}
        self.single_sizes: dict[PG, int] = {}
        self.max_pending = max_pending
        self.dropped_pending = 0

    def facts(self, pg: PG) -> dict[Any, int]:
        """The (mutable) hash -> packed fact map of one (publisher, group)."""
        fd = self.by_pg.get(pg)
        if fd is None:
            fd = self.by_pg[pg] = {}
        return fd

    def block_size(self, pg: PG) -> int | None:
        """Physical block size of a (publisher, group), if configured or learned."""
        b = self.sizes.get(pg)
        return b if b is not None else self.configured.get(pg[1])

    def group_block_size(self, group: int, publisher: Publisher | None = None) -> int | None:
        """Block size of ``group`` for look-ups: configured, else learned by any publisher."""
        if group in self.configured:
            return self.configured[group]
        for (pub, g), b in self.sizes.items():
            if g == group and (publisher is None or pub == publisher):
                return b
        return None

    def lookup(self, pg: PG, block_hash: Any) -> tuple[int | None, int]:
        """``(num_tokens or None, kind)`` of a hash; ``(None, PENDING)`` if never announced."""
        f = self.by_pg.get(pg, {}).get(block_hash)
        if f is None:
            return None, PENDING
        return (f >> 2) or None, f & 3

    def forget_publisher(self, publisher: Publisher) -> None:
        """Drop facts of a publisher (its entries were cleared)."""
        for table in (self.by_pg, self.pending, self.orphans):
            for pg in [k for k in table if k[0] == publisher]:
                del table[pg]

    def prune(self, pg: PG, live: Iterable[Any]) -> int:
        """Keep only facts of hashes in ``live`` (plus pending/orphan parents); return dropped."""
        fd = self.by_pg.get(pg)
        if not fd:
            return 0
        keep = set(live)
        orph = self.orphans.get(pg)
        if orph:
            keep.update(orph)
        new = {h: f for h, f in fd.items() if h in keep}
        dropped = len(fd) - len(new)
        self.by_pg[pg] = new
        pend = self.pending.get(pg)
        if pend:
            self.pending[pg] = {h: x for h, x in pend.items() if h in keep}
        return dropped


class Classifier:
    """Turns decoded events into :class:`Run` updates and keeps :class:`BlockFacts` current.

    Accepts both the public structs (:mod:`connector.events`) and the hot-path ones.
    """

    __slots__ = ("facts", "invalid_events", "conflicts", "_medium_cache")

    def __init__(self, facts: BlockFacts | None = None) -> None:
        self.facts = facts if facts is not None else BlockFacts()
        self.invalid_events = 0
        self.conflicts = 0
        self._medium_cache: dict[str | None, str] = {}

    def _medium(self, raw: str | None) -> str:
        m = self._medium_cache.get(raw)
        if m is None:
            if len(self._medium_cache) > 64:
                return normalize_medium(raw)
            m = self._medium_cache[raw] = normalize_medium(raw)
        return m

    def classify(self, publisher: Publisher, event: Any) -> Run | None:
        """One event -> one run, or ``None`` (invalid: counted in ``invalid_events``)."""
        op = _OPS.get(type(event))
        if op is None:
            op = _op_of(event)
        if op == STORE:
            return self._stored(publisher, event)
        if op == REMOVE:
            hashes = event.block_hashes
            g = event.group_idx or 0
            if not hashes or g < 0:
                self.invalid_events += 1
                return None
            return Run(REMOVE, (publisher, self._medium(event.medium), g, event.ownership),
                       hashes, None, 0, 0, PENDING)
        if op == CLEAR:
            return Run(CLEAR, (publisher, "", 0, None), [], None, 0, 0, PENDING)
        self.invalid_events += 1
        return None

    def _stored(self, publisher: Publisher, ev: Any) -> Run | None:
        hashes = ev.block_hashes
        n = len(hashes)
        group = ev.group_idx or 0
        x = ev.block_size
        tok = ev.token_ids
        try:
            ntok = len(tok) if type(tok) is list else raw_array_len(tok)
        except ValueError:
            self.invalid_events += 1
            return None
        if n == 0 or x < 0 or group < 0:
            self.invalid_events += 1
            return None
        key = (publisher, self._medium(ev.medium), group, ev.ownership)
        parent = ev.parent_block_hash
        pg = (publisher, group)
        facts = self.facts
        fd = facts.by_pg.get(pg)
        if fd is None:
            fd = facts.facts(pg)

        if x == 0 or ntok == 0:
            _merge_unknown(fd, hashes, PLACEHOLDER)
            return Run(STORE, key, hashes, parent, 0, 0, PLACEHOLDER)
        if ntok < x * n:
            self.invalid_events += 1
            return None
        contiguous = ntok == x * n  # null/masked blocks skipped => positions unknown

        b = facts.sizes.get(pg)
        if b is None:
            b = self._learn(pg, x, n)

        if parent is None:
            parent_nt = 0
            known = True
        else:
            pf = fd.get(parent)
            parent_nt = pf >> 2 if pf is not None else 0
            known = parent_nt > 0

        if b is None:  # single hash, size not decidable yet
            nt = parent_nt + x if (known and contiguous) else 0
            h = hashes[0]
            old = fd.get(h)
            if old is None or old & 3 == PENDING:
                fd[h] = nt * 4 + PENDING
                self._add_pending(pg, h, x)
            if not known:
                self._add_orphan(pg, parent, hashes, x, contiguous)
            return Run(STORE, key, hashes, parent, nt, 0, PENDING)

        if x == b:
            if known and contiguous:
                first = parent_nt + b
                base = first * 4 + FULL
                fd.update(zip(hashes, range(base, base + n * b * 4, b * 4), strict=True))
                if facts.orphans.get(pg):
                    self._resolve_orphans(pg, hashes, first, b)
                return Run(STORE, key, hashes, parent, first, b, FULL)
            _merge_unknown(fd, hashes, FULL)
            if not known:
                self._add_orphan(pg, parent, hashes, x, contiguous)
            return Run(STORE, key, hashes, parent, 0, 0, FULL)

        if x < b and n == 1:
            h = hashes[0]
            if known and contiguous:
                nt = parent_nt + x
                kind = FULL if nt % b == 0 else PARTIAL
                fd[h] = nt * 4 + kind
                if facts.orphans.get(pg):
                    self._resolve_orphans(pg, hashes, nt, x)
                return Run(STORE, key, hashes, parent, nt, 0, kind)
            _merge_unknown(fd, hashes, PARTIAL)
            if not known:
                self._add_orphan(pg, parent, hashes, x, contiguous)
            return Run(STORE, key, hashes, parent, 0, 0, PARTIAL)

        # A size that contradicts the group's block size: never counted.
        self.conflicts += 1
        _merge_unknown(fd, hashes, PENDING)
        return Run(STORE, key, hashes, parent, 0, 0, PENDING)

    # -- learning the block size ---------------------------------------------------------

    def _learn(self, pg: PG, x: int, n: int) -> int | None:
        facts = self.facts
        b = facts.configured.get(pg[1])
        if b is None:
            if n >= 2:
                b = x
            else:
                seen = facts.single_sizes.get(pg)
                if seen is None:
                    facts.single_sizes[pg] = x
                    return None
                if seen == x:
                    return None
                b = max(seen, x)  # partial stores carry the hash unit, full ones the block size
        facts.sizes[pg] = b
        self._resolve_pending(pg, b)
        return b

    def _add_pending(self, pg: PG, h: Any, x: int) -> None:
        pend = self.facts.pending.get(pg)
        if pend is None:
            pend = self.facts.pending[pg] = {}
        if len(pend) >= self.facts.max_pending:
            self.facts.dropped_pending += 1
            return
        pend[h] = x

    def _resolve_pending(self, pg: PG, b: int) -> None:
        pend = self.facts.pending.pop(pg, None)
        if not pend:
            return
        fd = self.facts.facts(pg)
        for h, x in pend.items():
            f = fd.get(h)
            if f is None or f & 3 != PENDING:
                continue
            nt = f >> 2
            if nt:
                kind = FULL if nt % b == 0 else PARTIAL
            elif x == b:
                kind = FULL
            elif x < b:
                kind = PARTIAL
            else:
                self.conflicts += 1
                continue
            fd[h] = nt * 4 + kind

    # -- out-of-order arrival --------------------------------------------------------------

    def _add_orphan(self, pg: PG, parent: Any, hashes: list[Any], x: int,
                    contiguous: bool) -> None:
        if parent is None or not contiguous:
            return
        orph = self.facts.orphans.get(pg)
        if orph is None:
            orph = self.facts.orphans[pg] = {}
        if len(orph) >= self.facts.max_pending:
            self.facts.dropped_pending += 1
            return
        orph.setdefault(parent, []).append((hashes, x, contiguous))

    def _resolve_orphans(self, pg: PG, hashes: list[Any], first: int, step: int) -> None:
        """Hashes with known ``num_tokens`` arrived: give their waiting children positions."""
        orph = self.facts.orphans[pg]
        fd = self.facts.facts(pg)
        b = self.facts.block_size(pg)
        work = [(h, first + i * step) for i, h in enumerate(hashes) if h in orph]
        while work:
            parent, parent_nt = work.pop()
            for child_hashes, x, _ in orph.pop(parent, ()):
                for i, h in enumerate(child_hashes):
                    nt = parent_nt + (i + 1) * x
                    if b is None:
                        kind = PENDING
                    elif x == b or nt % b == 0:
                        kind = FULL if nt % b == 0 else PARTIAL
                    else:
                        kind = PARTIAL
                    old = fd.get(h)
                    if old is not None and old & 3 == PENDING and kind != PENDING:
                        self.facts.pending.get(pg, {}).pop(h, None)
                    fd[h] = nt * 4 + kind
                    if h in orph:
                        work.append((h, nt))


_RANK = {PENDING: 0, PLACEHOLDER: 1, PARTIAL: 2, FULL: 3}


def _merge_unknown(fd: dict[Any, int], hashes: list[Any], kind: int) -> None:
    """Record ``kind`` for hashes of unknown position, never erasing a known position.

    Among unknown-position facts the most specific shape wins: a FULL-shaped announcement
    (``block_size == B``) proves a block boundary; a partial-shaped one does not disprove it.
    """
    rank = _RANK[kind]
    for h in hashes:
        old = fd.get(h)
        if old is None or (old >> 2 == 0 and _RANK[old & 3] < rank):
            fd[h] = kind
