"""Classify KV events into index updates: what each announced hash covers, and its kind.

Every announced hash becomes an entry carrying (publisher, medium, group, hash, parent,
num_tokens, kind). ``num_tokens`` is the cumulative prefix length the hash covers (vLLM's
``KVCacheBlock.block_hash_num_tokens``); ``kind`` is FULL, PARTIAL or PLACEHOLDER.

FULL vs PARTIAL is decided from the group's *physical block size* ``B`` (configured, or
learned from full announcements: a multi-hash store, or two different single-hash sizes),
never from the presence of a hash:

* ``num_tokens`` known  -> FULL iff it ends on a block boundary (``offload_tiers.keys.kind_for``);
* ``num_tokens`` unknown (parent not seen) -> from the announcement's shape:
  ``block_size == B`` FULL, ``block_size < B`` (one hash) PARTIAL;
* ``B`` unknown and a single-hash store -> PENDING (never counted) until ``B`` is learned;
* ``token_ids == []`` or ``block_size == 0`` -> PLACEHOLDER (never counted as a prefix);
* any other size (contradicts ``B``) -> PENDING for good, counted in ``conflicts``.

``num_tokens`` of a store is its parent's plus ``block_size`` per hash; the parent's comes
from the index (:class:`PositionSource`). A store whose parent is unknown is remembered
(bounded) and gets its positions when the parent shows up (out-of-order arrival).

To keep the hot path free of per-hash objects, :meth:`Classifier.classify` returns one
:class:`Run` per event (hashes + an arithmetic progression of ``num_tokens``);
:meth:`Run.entries` expands it into :class:`Entry` tuples for callers who want them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, Protocol

from connector.events.wire import MEDIUM_GPU, normalize_medium, raw_array_len
from offload_tiers.keys import BlockKind, kind_for

__all__ = [
    "CLEAR",
    "FULL",
    "PARTIAL",
    "PENDING",
    "PLACEHOLDER",
    "REMOVE",
    "STORE",
    "Classifier",
    "Entry",
    "GroupSizes",
    "PositionSource",
    "Run",
    "kind_name",
    "pack",
    "unpack",
]

# Kinds as small ints (BlockKind values) + PENDING for "not decidable yet".
PENDING = 0
FULL = int(BlockKind.FULL)
PARTIAL = int(BlockKind.PARTIAL)
PLACEHOLDER = int(BlockKind.PLACEHOLDER)
_KIND_NAMES = {PENDING: "PENDING", FULL: "FULL", PARTIAL: "PARTIAL", PLACEHOLDER: "PLACEHOLDER"}
_RANK = {PENDING: 0, PLACEHOLDER: 1, PARTIAL: 2, FULL: 3}

STORE, REMOVE, CLEAR = 1, 2, 3

Publisher = str
ResidencyKey = tuple[Publisher, str, int, str | None]  # (publisher, medium, group, ownership)
PG = tuple[Publisher, int]  # (publisher, group)


def kind_name(kind: int) -> str:
    """``"FULL"``, ``"PARTIAL"``, ``"PLACEHOLDER"`` or ``"PENDING"``."""
    return _KIND_NAMES[kind]


def pack(num_tokens: int, kind: int) -> int:
    """One int per entry: ``num_tokens * 4 + kind`` (``num_tokens`` 0 = unknown)."""
    return num_tokens * 4 + kind


def unpack(packed: int) -> tuple[int | None, int]:
    """``(num_tokens or None, kind)``."""
    return (packed >> 2) or None, packed & 3


def merge(old: int, new: int) -> int:
    """Facts of a hash announced again: a known position wins (it decides the kind);
    between unknown positions the most specific shape wins (FULL > PARTIAL > PLACEHOLDER)."""
    if new >> 2:
        return new
    if old >> 2:
        return old
    return new if _RANK[new & 3] > _RANK[old & 3] else old


def kind_at(num_tokens: int, block_size: int) -> int:
    """FULL/PARTIAL of the block a known ``num_tokens`` ends in (the lead's ``kind_for``)."""
    return int(kind_for(num_tokens, (num_tokens - 1) // block_size, block_size))


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
    is non-zero (0 = unknown), and every hash has kind ``kind``.
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


class PositionSource(Protocol):
    """What the classifier asks the index: positions of resident hashes, and rewrites."""

    def position_of(self, pg: PG, block_hash: Any) -> int:
        """``num_tokens`` of a resident hash of (publisher, group), 0 when unknown."""
        ...

    def rewrite(self, pg: PG, fn: Callable[[Any, int], int | None]) -> None:
        """Replace the packed facts of resident entries of (publisher, group) by ``fn``."""
        ...

    def rewrite_hashes(self, pg: PG, updates: Mapping[Any, int]) -> None:
        """Set the packed facts of these resident hashes (merging with what is known)."""
        ...


class GroupSizes:
    """Physical block size per (publisher, group): configured per group, or learned."""

    __slots__ = ("configured", "learned")

    def __init__(self, configured: Mapping[int, int] | None = None) -> None:
        self.configured: dict[int, int] = dict(configured or {})
        for g, b in self.configured.items():
            if b <= 0:
                raise ValueError(f"block size of group {g} must be positive, got {b}")
        self.learned: dict[PG, int] = {}

    def block_size(self, pg: PG) -> int | None:
        b = self.configured.get(pg[1])
        return b if b is not None else self.learned.get(pg)

    @staticmethod
    def are_siblings(a: PG, b: PG) -> bool:
        """Two DP ranks (``"{source}#dp{rank}"``) of one source, same group, not the same."""
        return (a != b and a[1] == b[1]
                and a[0].rsplit("#dp", 1)[0] == b[0].rsplit("#dp", 1)[0])

    def sibling(self, pg: PG) -> int | None:
        """Size learned by another DP rank of the same source (``"{source}#dp{rank}"``)."""
        source = pg[0].rsplit("#dp", 1)[0]
        for (pub, g), b in self.learned.items():
            if g == pg[1] and pub.rsplit("#dp", 1)[0] == source:
                return b
        return None

    def group_block_size(self, group: int, publisher: Publisher | None = None) -> int | None:
        """Block size of ``group`` for look-ups: configured, else learned by a publisher
        (preferring ``publisher`` and its DP siblings)."""
        if group in self.configured:
            return self.configured[group]
        if publisher is not None:
            b = self.learned.get((publisher, group))
            return b if b is not None else self.sibling((publisher, group))
        for (_pub, g), b in self.learned.items():
            if g == group:
                return b
        return None


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


class Classifier:
    """Turns decoded events into :class:`Run` updates.

    Accepts both the public structs (:mod:`connector.events.wire`) and the hot-path ones. Holds
    the bounded bookkeeping for undecidable entries: single-hash stores waiting for their
    group's block size (``pending``) and stores waiting for their parent (``orphans``).
    """

    __slots__ = ("sizes", "positions", "max_pending", "pending", "orphans", "single_sizes",
                 "invalid_events", "conflicts", "dropped_pending", "_medium_cache")

    def __init__(self, sizes: GroupSizes | None = None, positions: PositionSource | None = None,
                 max_pending: int = 65536) -> None:
        self.sizes = sizes if sizes is not None else GroupSizes()
        self.positions = positions
        self.max_pending = max_pending
        self.pending: dict[PG, dict[Any, int]] = {}
        self.orphans: dict[PG, dict[Any, list[tuple[list[Any], int]]]] = {}
        self.single_sizes: dict[PG, int] = {}
        self.invalid_events = 0
        self.conflicts = 0
        self.dropped_pending = 0
        self._medium_cache: dict[str | None, str] = {}

    def _medium(self, raw: str | None) -> str:
        m = self._medium_cache.get(raw)
        if m is None:
            m = normalize_medium(raw)
            if len(self._medium_cache) < 64:
                self._medium_cache[raw] = m
        return m

    def forget_publisher(self, publisher: Publisher) -> None:
        """Drop pending/orphan bookkeeping of a publisher (sizes are kept). Not done on
        ``AllBlocksCleared``: that clears GPU entries only, and the publisher's CPU/STORAGE
        entries still wait on it (the bookkeeping is bounded by ``max_pending``)."""
        for table in (self.pending, self.orphans):
            for pg in [k for k in table if k[0] == publisher]:
                del table[pg]

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
        if op == CLEAR:  # the GPU block pool's reset: the publisher's offloaded copies stay
            return Run(CLEAR, (publisher, MEDIUM_GPU, 0, None), [], None, 0, 0, PENDING)
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
        if x == 0 or ntok == 0:
            return Run(STORE, key, hashes, parent, 0, 0, PLACEHOLDER)
        if ntok < x * n:
            self.invalid_events += 1
            return None
        contiguous = ntok == x * n  # null/masked blocks skipped => positions unknown
        pg = (publisher, group)
        b = self.sizes.block_size(pg)
        if b is None:
            b = self._learn(pg, x, n)

        if parent is None:
            parent_nt = 0
            known = contiguous
        else:
            parent_nt = self.positions.position_of(pg, parent) if self.positions else 0
            known = contiguous and parent_nt > 0

        if b is None:  # single hash, size not decidable yet
            self._add_pending(pg, hashes[0], x)
            if not known:
                self._add_orphan(pg, parent, hashes, x, contiguous)
            return Run(STORE, key, hashes, parent, parent_nt + x if known else 0, 0, PENDING)

        if x == b:
            if known:
                first = parent_nt + b
                if self.orphans.get(pg):
                    self._resolve_orphans(pg, hashes, first, b)
                return Run(STORE, key, hashes, parent, first, b, FULL)
            self._add_orphan(pg, parent, hashes, x, contiguous)
            return Run(STORE, key, hashes, parent, 0, 0, FULL)

        if x < b and n == 1:
            if known:
                nt = parent_nt + x
                if self.orphans.get(pg):
                    self._resolve_orphans(pg, hashes, nt, x)
                return Run(STORE, key, hashes, parent, nt, 0, kind_at(nt, b))
            self._add_orphan(pg, parent, hashes, x, contiguous)
            return Run(STORE, key, hashes, parent, 0, 0, PARTIAL)

        self.conflicts += 1  # a size that contradicts the group's block size: never counted
        return Run(STORE, key, hashes, parent, 0, 0, PENDING)

    # -- learning the block size ---------------------------------------------------------

    def _learn(self, pg: PG, x: int, n: int) -> int | None:
        sib = self.sizes.sibling(pg)
        if sib is not None:  # DP ranks of one engine share its layout
            self.sizes.learned[pg] = sib
            self._resolve_pending(pg, sib)
            return sib
        if n >= 2:
            b = x
        else:
            seen = self.single_sizes.get(pg)
            if seen is None:
                self.single_sizes[pg] = x
                return None
            if seen == x:
                return None
            b = max(seen, x)  # partial stores carry the hash unit, full ones the block size
        self.sizes.learned[pg] = b
        self._resolve_pending(pg, b)
        for other in [q for q in self.pending if self.sizes.are_siblings(q, pg)]:
            self.sizes.learned.setdefault(other, b)  # a DP rank that stored first
            self._resolve_pending(other, b)
        return b

    def _add_pending(self, pg: PG, h: Any, x: int) -> None:
        pend = self.pending.get(pg)
        if pend is None:
            pend = self.pending[pg] = {}
        if len(pend) >= self.max_pending:
            self.dropped_pending += 1  # stays PENDING: never counted, never wrong
            return
        pend[h] = x

    def _resolve_pending(self, pg: PG, b: int) -> None:
        pend = self.pending.pop(pg, None)
        if not pend or self.positions is None:
            return

        def fix(h: Any, packed: int) -> int | None:
            if packed & 3 != PENDING or h not in pend:
                return None
            x = pend[h]
            nt = packed >> 2
            if nt:
                return pack(nt, kind_at(nt, b))
            if x == b:
                return pack(0, FULL)
            if x < b:
                return pack(0, PARTIAL)
            self.conflicts += 1
            return None

        self.positions.rewrite(pg, fix)

    # -- out-of-order arrival --------------------------------------------------------------

    def _add_orphan(self, pg: PG, parent: Any, hashes: list[Any], x: int,
                    contiguous: bool) -> None:
        if parent is None or not contiguous:
            return
        orph = self.orphans.get(pg)
        if orph is None:
            orph = self.orphans[pg] = {}
        if len(orph) >= self.max_pending:
            self.dropped_pending += 1
            return
        orph.setdefault(parent, []).append((hashes, x))

    def _resolve_orphans(self, pg: PG, hashes: list[Any], first: int, step: int) -> None:
        """Hashes with known ``num_tokens`` arrived: give their waiting children positions."""
        orph = self.orphans[pg]
        if orph.keys().isdisjoint(hashes):
            return
        b = self.sizes.block_size(pg)
        updates: dict[Any, int] = {}
        work = [(h, first + i * step) for i, h in enumerate(hashes) if h in orph]
        while work:
            parent, parent_nt = work.pop()
            for child_hashes, x in orph.pop(parent, ()):
                for i, h in enumerate(child_hashes):
                    nt = parent_nt + (i + 1) * x
                    if b is None:
                        kind = PENDING
                    elif x == b or x < b and len(child_hashes) == 1:
                        kind = kind_at(nt, b)
                    else:
                        continue  # conflicting size: stays PENDING
                    updates[h] = pack(nt, kind)
                    if h in orph:
                        work.append((h, nt))
        if updates and self.positions is not None:
            self.positions.rewrite_hashes(pg, updates)


def classify_all(classifier: Classifier, publisher: Publisher,
                 events: list[Any], apply: Callable[[Run], None]) -> int:
    """Classify and apply events in order (a store's parent may be in the same batch)."""
    n = 0
    for ev in events:
        run = classifier.classify(publisher, ev)
        if run is not None:
            apply(run)
            n += 1
    return n
