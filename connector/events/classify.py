"""Classify KV events into index updates: what each announced hash covers, and its kind.

Every announced hash becomes an entry carrying (publisher, medium, group, hash, parent,
num_tokens, kind). ``num_tokens`` is the cumulative prefix length the hash covers (vLLM's
``KVCacheBlock.block_hash_num_tokens``); ``kind`` is a :class:`~offload_tiers.keys.BlockKind`
(FULL, PARTIAL or PLACEHOLDER), or ``None`` while it is PENDING (not decidable yet).

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
from the index. A store whose parent is unknown is remembered (bounded) and gets its
positions when the parent shows up (out-of-order arrival).

The classifier's output is one :class:`~connector.events.index.Run` per event (hashes + an
arithmetic progression of ``num_tokens``), so the hot path makes no per-hash objects; the
index applies it. Data flows classify -> index: the classifier asks the index for parents'
positions and rewrites entries it could not decide before; the index knows nothing of it.
"""

from __future__ import annotations

from typing import Any

from connector.events.index import (
    CLEAR,
    PG,
    REMOVE,
    STORE,
    KVIndex,
    Publisher,
    Run,
    pack,
    unpack,
)
from connector.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Medium,
    normalize_medium,
    raw_array_len,
)
from offload_tiers.keys import BlockKind, kind_for

__all__ = ["Classifier", "kind_at"]

# BlockKind members bound once: reading an Enum class attribute costs ~10x a global.
FULL, PARTIAL, PLACEHOLDER = BlockKind.FULL, BlockKind.PARTIAL, BlockKind.PLACEHOLDER
_GPU = Medium.GPU


_OPS: dict[type, int] = {}  # event struct type -> STORE/REMOVE/CLEAR, filled on first sight


def _op_of(cls: type) -> int:
    """STORE/REMOVE/CLEAR for an event struct type (subclasses included), 0 for any other.

    Looked up once per type: ``isinstance`` against a msgspec struct's base costs ~4x a
    dict hit on the hot path."""
    if issubclass(cls, BlockStored):
        op = STORE
    elif issubclass(cls, BlockRemoved):
        op = REMOVE
    elif issubclass(cls, AllBlocksCleared):
        op = CLEAR
    else:
        return 0
    _OPS[cls] = op
    return op


def _skipped_len(tok: Any) -> int | None:
    """``len(skipped_token_ids)``, raw or decoded; ``None`` when absent (or not an array)."""
    if tok is None:
        return None
    if type(tok) is list:
        return len(tok)
    if bytes(tok) == b"\xc0":  # msgpack nil: absent
        return None
    try:
        return raw_array_len(tok)
    except ValueError:
        return None


def kind_at(num_tokens: int, block_size: int) -> BlockKind | None:
    """FULL/PARTIAL of the block a known ``num_tokens`` (> 0) ends in."""
    return kind_for(num_tokens, (num_tokens - 1) // block_size, block_size)


class Classifier:
    """Turns decoded events into :class:`Run` updates for ``index``.

    Accepts the structs of :mod:`connector.events.wire`, :class:`RawBlockStored` included;
    anything else is an invalid event.
    Holds the bounded bookkeeping for undecidable entries: single-hash stores waiting for
    their group's block size (``pending``) and stores waiting for their parent (``orphans``).
    Block sizes are the index's (``index.sizes``): configured, or learned here.
    """

    __slots__ = ("index", "sizes", "max_pending", "pending", "orphans", "single_sizes",
                 "invalid_events", "conflicts", "dropped_pending", "_medium_cache")

    def __init__(self, index: KVIndex, max_pending: int = 65536) -> None:
        self.index = index
        self.sizes = index.sizes
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
        if m is None:  # a plain str: a Medium member hashes in Python, on every key look-up
            m = str(normalize_medium(raw))
            if len(self._medium_cache) < 64:
                self._medium_cache[raw] = m
        return m

    def classify(self, publisher: Publisher, event: Any) -> Run | None:
        """One event -> one run, or ``None`` (invalid: counted in ``invalid_events``)."""
        op = _OPS.get(type(event)) or _op_of(type(event))
        if op == STORE:
            return self._stored(publisher, event)
        if op == REMOVE:
            hashes = event.block_hashes
            g = event.group_idx or 0
            if not hashes or g < 0:
                self.invalid_events += 1
                return None
            return Run(REMOVE, (publisher, self._medium(event.medium), g, event.ownership),
                       hashes, None, 0, 0, None)
        if op == CLEAR:  # the GPU block pool's reset: the publisher's offloaded copies stay
            return Run(CLEAR, (publisher, _GPU, 0, None), [], None, 0, 0, None)
        self.invalid_events += 1
        return None

    def _stored(self, publisher: Publisher, ev: Any) -> Run | None:
        hashes = ev.block_hashes
        n = len(hashes)
        group = ev.group_idx or 0
        x = ev.block_size
        ntok = _token_count(ev.token_ids)
        if ntok < 0 or n == 0 or x < 0 or group < 0:
            self.invalid_events += 1
            return None
        medium = self._medium_cache.get(ev.medium) or self._medium(ev.medium)
        key = (publisher, medium, group, ev.ownership)
        parent = ev.parent_block_hash
        if x == 0 or ntok == 0:
            return Run(STORE, key, hashes, parent, 0, 0, PLACEHOLDER)
        if ntok < x * n:
            self.invalid_events += 1
            return None
        contiguous = ntok == x * n  # null/masked blocks skipped => positions unknown
        pg = (publisher, group)
        b = self.sizes.configured.get(group) or self.sizes.block_size(pg)
        if b is None:
            b = self._learn(pg, x, n)

        # where the parent ends (never announced: placed by the skipped span, if any)
        parent_nt = 0 if parent is None else (self.index.position_of(pg, parent)
                                              or self._skipped_end(pg, ev))
        known = contiguous and (parent is None or parent_nt > 0)
        if b is None:  # single hash, size not decidable yet
            self._add_pending(pg, hashes[0], x)
            if not known:
                self._add_orphan(pg, parent, hashes, x, contiguous)
            return Run(STORE, key, hashes, parent, parent_nt + x if known else 0, 0, None)

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
        return Run(STORE, key, hashes, parent, 0, 0, None)

    def _skipped_end(self, pg: PG, ev: Any) -> int:
        """Where an unannounced parent ends, from vLLM #44488's skipped span: the skipped
        parent's position (0 at the chain's start) plus ``len(skipped_token_ids)``; 0 when
        the event has no span or its skipped parent is not placed either."""
        n = _skipped_len(getattr(ev, "skipped_token_ids", None))
        if n is None:
            return 0
        sp = ev.skipped_parent_block_hash
        if sp is None:
            return n
        base = self.index.position_of(pg, sp)
        return base + n if base else 0

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
        if not pend:
            return

        def fix(h: Any, packed: int) -> int | None:
            nt, kind = unpack(packed)
            if kind is not None or h not in pend:
                return None
            x = pend[h]
            if nt:
                return pack(nt, kind_at(nt, b))
            if x == b:
                return pack(0, FULL)
            if x < b:
                return pack(0, PARTIAL)
            self.conflicts += 1
            return None

        self.index.rewrite(pg, fix, pend)

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
                        kind = None
                    elif x == b or x < b and len(child_hashes) == 1:
                        kind = kind_at(nt, b)
                    else:
                        continue  # conflicting size: stays PENDING
                    updates[h] = pack(nt, kind)
                    if h in orph:
                        work.append((h, nt))
        if updates:
            self.index.rewrite_hashes(pg, updates)


def _token_count(tokens: Any) -> int:
    """How many token ids an event carries (a list, or a raw array); -1 if unreadable."""
    try:
        return len(tokens) if type(tokens) is list else raw_array_len(tokens)
    except ValueError:
        return -1
