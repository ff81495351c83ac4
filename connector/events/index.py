"""The partial-aware residency index: reference-counted where copies can repeat, a set
where they cannot.

Residency is kept per (publisher incl. DP rank, medium, group, ownership). How repeated
announcements count is the :class:`ResidencyPolicy`'s call, per residency key:

* **refcounted** (GPU by default): vLLM can hold two physical blocks with one hash, each
  announced and each removed, so a hash stays resident until its last announcement there is
  removed;
* **set** (CPU and STORAGE by default; GPU of a publisher whose requests use vLLM's
  ``kv_cache_report_mode="full"``): a tier holds one value per key, so an entry is there or
  not: a repeated ``BlockStored`` refreshes its facts, one ``BlockRemoved`` removes it.

A removal of an unknown hash is harmless (counted). ``AllBlocksCleared`` is the GPU block
pool's reset: the caller clears the publisher's GPU entries only. Entries of a medium with a
TTL (STORAGE with ``storage_ttl_s``: Redis expires values and announces nothing) expire that
long after their last announcement (:meth:`KVIndex.expire`).

One node table serves every residency key: block hash -> node. A key owns a lane (a bit);
a node is ``lanes << SHIFT | facts`` (packed facts ``num_tokens * 4 + kind``, :func:`pack`)
while its lanes agree on the facts, else a dict lane -> facts. Counts above one live in a
small side table per key, so the common case (announced once, removed once) costs one node
per block however many engines hold it, and the bulk paths stay in C. ``res[key]`` is a
read-only view of one key's entries (:class:`LaneView`).
Facts live exactly as long as the entry: memory is bounded by ``max_entries``; stores
beyond it are dropped and counted, which can only make look-ups answer *less*.

Look-up answers the longest cached prefix of a chain of block hashes (as vLLM computes
them), per medium and over all media: FULL entries count whole; a PARTIAL entry can only
end a prefix and counts only its own ``num_tokens``; nothing extends past a partial;
PLACEHOLDER and PENDING entries never count. Each publisher is walked with its own block
size (publishers that share one are walked together); the answer is the best of those walks.
Scoring (``connector.events.score``) walks every engine of one block size at once over the
node table (:func:`lane_groups`). The table is a C ``NodeTable`` where the extension is built
(block hashes inline, the walk in one C pass), else a dict (:mod:`connector.events.node_table`).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from itertools import compress, count, islice, repeat
from operator import and_, ne, or_, rshift
from typing import Any, NamedTuple

from connector.events import node_table
from connector.events.wire import Medium
from offload_tiers.keys import BlockKind

__all__ = [
    "ANY",
    "CLEAR",
    "STATE_KINDS",
    "DEFAULT_SET_MEDIA",
    "KIND_NAMES",
    "PARTIAL_BITS",
    "PG",
    "REMOVE",
    "STORE",
    "GroupSizes",
    "KVIndex",
    "LaneView",
    "PrefixMatch",
    "Publisher",
    "ResidencyKey",
    "ResidencyPolicy",
    "Run",
    "kind_name",
    "lane_groups",
    "lane_runs",
    "lanes_of",
    "merge",
    "pack",
    "publisher_id",
    "source_of",
    "unpack",
    "full_run",
    "has_partial",
    "has_state",
]

Publisher = str
"""One source (configured name or endpoint) at one DP rank: ``"{source}#dp{rank}"``."""
ResidencyKey = tuple[Publisher, str, int, str | None]  # (publisher, medium, group, ownership)
PG = tuple[Publisher, int]  # (publisher, group)


def publisher_id(source: str, rank: int) -> Publisher:
    """The publisher id of ``source`` at DP rank ``rank``."""
    return f"{source}#dp{rank}"


def source_of(publisher: Publisher) -> str:
    """The source of a publisher id (inverse of :func:`publisher_id`)."""
    return publisher.rsplit("#dp", 1)[0]


# -- packed facts --------------------------------------------------------------------------
# One int per entry: ``num_tokens * 4 + kind bits``. ``num_tokens`` 0 means unknown; the
# kind bits are the BlockKind value, 0 while the kind is not decidable yet (PENDING, ``None``
# in the API). The index's hot paths pack and read them inline: ``f >> 2`` and ``f & 3``.

assert [k.value for k in BlockKind] == [1, 2, 3], "kind bits are BlockKind values 1..3"
_KINDS: tuple[BlockKind | None, ...] = (None, *BlockKind)  # indexed by kind bits
_BIT_NAMES: tuple[str, ...] = ("PENDING", *(k.name for k in BlockKind))  # indexed by kind bits
KIND_NAMES: tuple[str, ...] = (*_BIT_NAMES[1:], "PENDING")
"""Every kind name :meth:`KVIndex.entry_counts` reports: FULL, PARTIAL, PLACEHOLDER, PENDING."""
_FULL, _PARTIAL = int(BlockKind.FULL), int(BlockKind.PARTIAL)  # kind bits, read as globals
_RANK = (0, 3, 2, 1)  # kind bits -> specificity: FULL > PARTIAL > PLACEHOLDER > PENDING


def pack(num_tokens: int, kind: BlockKind | None) -> int:
    """Packed facts of an entry covering ``num_tokens`` (0 = unknown) of kind ``kind``."""
    return num_tokens * 4 + (kind or 0)


def unpack(packed: int) -> tuple[int | None, BlockKind | None]:
    """``(num_tokens or None, kind or None)``."""
    return (packed >> 2) or None, _KINDS[packed & 3]


def kind_name(bits: int) -> str:
    """``"FULL"``, ``"PARTIAL"``, ``"PLACEHOLDER"`` or ``"PENDING"`` of packed kind bits."""
    return _BIT_NAMES[bits]


def merge(old: int, new: int) -> int:
    """Facts of a hash announced again: a known position wins (it decides the kind);
    between unknown positions the most specific shape wins (FULL > PARTIAL > PLACEHOLDER)."""
    if new >> 2:
        return new
    if old >> 2:
        return old
    return new if _RANK[new & 3] > _RANK[old & 3] else old


# -- what the index is told ----------------------------------------------------------------

STORE, REMOVE, CLEAR = 1, 2, 3  # Run.op


class Run(NamedTuple):
    """One event's effect on the index: ``op`` applied to ``hashes`` under ``key``.

    For STORE, hash ``i`` covers ``first_tokens + i * step`` tokens when ``first_tokens``
    is non-zero (0 = unknown), and every hash has kind ``kind`` (``None``: PENDING).
    """

    op: int
    key: ResidencyKey
    hashes: list[Any]
    parent: Any
    first_tokens: int
    step: int
    kind: BlockKind | None


class _Learned(dict[PG, int]):
    """Learned block sizes, with a count of changes (``version``) that scoring's cache reads."""

    version = 0

    def __setitem__(self, pg: PG, b: int) -> None:
        self.version += 1
        super().__setitem__(pg, b)

    def __delitem__(self, pg: PG) -> None:
        self.version += 1
        super().__delitem__(pg)

    def setdefault(self, pg: PG, b: int) -> int:  # type: ignore[override]
        if pg not in self:
            self[pg] = b
        return self[pg]

    def pop(self, pg: PG, *default: Any) -> Any:  # type: ignore[override]
        self.version += 1
        return super().pop(pg, *default)

    def update(self, *args: Any, **kw: Any) -> None:
        self.version += 1
        super().update(*args, **kw)

    def clear(self) -> None:
        self.version += 1
        super().clear()


class GroupSizes:
    """Physical block size per (publisher, group): configured per group, or learned."""

    __slots__ = ("configured", "learned")

    def __init__(self, configured: Mapping[int, int] | None = None) -> None:
        self.configured: dict[int, int] = dict(configured or {})
        for g, b in self.configured.items():
            if b <= 0:
                raise ValueError(f"block size of group {g} must be positive, got {b}")
        self.learned: dict[PG, int] = _Learned()

    def block_size(self, pg: PG) -> int | None:
        b = self.configured.get(pg[1])
        return b if b is not None else self.learned.get(pg)

    @staticmethod
    def are_siblings(a: PG, b: PG) -> bool:
        """Two DP ranks of one source, same group, not the same."""
        return a != b and a[1] == b[1] and source_of(a[0]) == source_of(b[0])

    def sibling(self, pg: PG) -> int | None:
        """Size learned by another DP rank of the same source."""
        source = source_of(pg[0])
        for (pub, g), b in self.learned.items():
            if g == pg[1] and source_of(pub) == source:
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


# -- the index -----------------------------------------------------------------------------

DEFAULT_SET_MEDIA: tuple[str, ...] = (Medium.CPU, Medium.STORAGE)
"""Media whose residency is a set unless a publisher says otherwise: kvtier's CPU tier and
Redis hold one value per key however often it is written (a set there can only under-claim
for a publisher that refcounts, such as vLLM's OffloadingConnector: give it ``set_media: []``)."""

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


class ResidencyPolicy:
    """Per residency key: is it a set (one entry per hash) or refcounted, and do its
    entries expire (seconds after their last announcement, by medium)?

    ``by_source`` overrides ``set_media`` per source (the publisher id without ``#dp{r}``).
    """

    __slots__ = ("set_media", "by_source", "ttl_s")

    def __init__(self, set_media: Iterable[str] = DEFAULT_SET_MEDIA,
                 by_source: Mapping[str, Iterable[str]] | None = None,
                 ttl_s: Mapping[str, float] | None = None) -> None:
        self.set_media = frozenset(set_media)
        self.by_source = {src: frozenset(m) for src, m in (by_source or {}).items()}
        self.ttl_s = dict(ttl_s or {})
        for medium, ttl in self.ttl_s.items():
            if not ttl > 0:
                raise ValueError(f"TTL of {medium} must be positive, got {ttl}")

    def is_set(self, key: ResidencyKey) -> bool:
        return key[1] in self.by_source.get(source_of(key[0]), self.set_media)

    def ttl(self, key: ResidencyKey) -> float | None:
        return self.ttl_s.get(key[1])


# -- the shared node table -----------------------------------------------------------------
# One table for the whole index (a dict, or the C NodeTable that behaves as one): block hash
# -> node. A residency key holds a *lane* (a bit number). A node is an int in the common
# case, ``(lanes << SHIFT) | facts``: the lanes holding the hash, all with the same packed
# facts, once each (refcounts above one live in ``KVIndex.extra``); a dict ``{lane: facts}``
# where lanes disagree on the facts (rare: an engine that learned a position another did
# not) or facts do not fit in SHIFT bits. The C table keeps int nodes below 2**127 (up to 95
# lanes) inline and walks them in C; wider nodes are Python ints there, walked in Python.

SHIFT = 32
FACTS = (1 << SHIFT) - 1  # the facts bits of an int node
_DEAD_LANE = 1 << 20  # a released view's lane: no node has that bit
assert node_table.C_PACKING in (None, (SHIFT, _FULL)), "the C walk reads nodes as packed here"


def _lanes_of(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _unfold(node: int) -> dict[int, int]:
    f = node & FACTS
    return dict.fromkeys(_lanes_of(node >> SHIFT), f)


def _fold(node: dict[int, int]) -> int | dict[int, int]:
    """The int form of a dict node whose lanes agree on facts that fit; else the dict."""
    facts = set(node.values())
    if len(facts) != 1:
        return node
    f = facts.pop()
    if f > FACTS:
        return node
    m = 0
    for lane in node:
        m |= 1 << lane
    return (m << SHIFT) | f


class LaneView(Mapping[Any, int]):
    """The entries of one residency key, read from the shared node table: hash -> packed
    facts. Valid until its key is cleared (then empty)."""

    __slots__ = ("index", "key", "lane")

    def __init__(self, index: KVIndex, key: ResidencyKey, lane: int) -> None:
        self.index, self.key, self.lane = index, key, lane

    def get(self, h: Any, default: Any = None) -> Any:
        node = self.index.nodes.get(h)
        if node is None:
            return default
        if type(node) is int:
            return node & FACTS if node >> SHIFT >> self.lane & 1 else default
        return node.get(self.lane, default)

    def __getitem__(self, h: Any) -> int:
        f = self.get(h, _MISS)
        if f == _MISS:
            raise KeyError(h)
        return f

    def __contains__(self, h: object) -> bool:
        return self.get(h) is not None

    def __len__(self) -> int:
        kc = self.index.kinds.get(self.key)
        return sum(kc) if kc is not None and self.lane != _DEAD_LANE else 0

    def __iter__(self) -> Iterator[Any]:
        lane = self.lane
        return iter([h for h, node in self.index.nodes.items()
                     if (node >> SHIFT >> lane & 1 if type(node) is int else lane in node)])

    def __repr__(self) -> str:
        return f"LaneView({self.key!r}, {dict(self)!r})"


class KVIndex:
    """Refcounted residency + longest-prefix look-up over one shared node table (see above).
    Not thread-safe: one writer."""

    __slots__ = ("sizes", "max_entries", "res", "extra", "by_pg", "kinds", "n_entries",
                 "dropped_capacity", "unknown_removals", "stores", "removals", "clears",
                 "policy", "set_keys", "ttl_keys", "expires", "expired", "_heap", "_tick",
                 "_heap_limit", "group_kinds", "shape", "plans", "nodes", "_free_lanes",
                 "_next_lane")

    def __init__(self, sizes: GroupSizes | None = None, max_entries: int = 10_000_000,
                 policy: ResidencyPolicy | None = None) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self.sizes = sizes if sizes is not None else GroupSizes()
        self.max_entries = max_entries
        self.policy = policy if policy is not None else ResidencyPolicy()
        self.set_keys: set[ResidencyKey] = set()  # keys whose residency is a set
        self.ttl_keys: dict[ResidencyKey, float] = {}  # keys whose entries expire: TTL
        self.expires: dict[ResidencyKey, dict[Any, float]] = {}  # hash -> expiry time
        self._heap: list[tuple[float, int, ResidencyKey, Any]] = []  # (expiry, tie, key, h)
        self._tick = count()
        self._heap_limit = 1024
        self.expired = 0
        # hash -> node (module comment): a C NodeTable or a dict (connector.events.node_table)
        self.nodes: MutableMapping[Any, int | dict[int, int]] = node_table.new_table()
        self.res: dict[ResidencyKey, LaneView] = {}  # residency key -> its entries
        self._free_lanes: list[int] = []  # lanes of cleared keys, reused smallest first
        self._next_lane = 0
        self.extra: dict[ResidencyKey, dict[Any, int]] = {}  # refcount - 1, when > 0
        self.by_pg: dict[PG, list[ResidencyKey]] = {}
        # vLLM's kv_cache_spec_kind per (publisher, group), as announced; outlives clears
        self.group_kinds: dict[PG, str] = {}
        # bumped when residency keys or group kinds come or go; what scoring caches per
        # engine (connector.events.score) holds while it (and the learned sizes) stay put
        self.shape = 0
        self.plans: dict[Any, Any] = {}
        self.kinds: dict[ResidencyKey, list[int]] = {}  # resident entries per kind, per key
        self.n_entries = 0
        self.dropped_capacity = 0
        self.unknown_removals = 0
        self.stores = 0  # hash announcements applied
        self.removals = 0  # hash removals applied (known)
        self.clears = 0

    # -- lanes ---------------------------------------------------------------------------

    def _dict(self, key: ResidencyKey) -> LaneView:
        view = self.res.get(key)
        if view is None:
            lane = heapq.heappop(self._free_lanes) if self._free_lanes else self._next_lane
            self._next_lane = max(self._next_lane, lane + 1)
            view = self.res[key] = LaneView(self, key, lane)
            self.shape += 1
            self.kinds[key] = [0, 0, 0, 0]
            self.by_pg.setdefault((key[0], key[2]), []).append(key)
            if self.policy.is_set(key):
                self.set_keys.add(key)
            ttl = self.policy.ttl(key)
            if ttl is not None:
                self.ttl_keys[key] = ttl
                self.expires[key] = {}
        return view

    def _facts(self, lane: int, h: Any) -> int | None:
        node = self.nodes.get(h)
        if node is None:
            return None
        if type(node) is int:
            return node & FACTS if node >> SHIFT >> lane & 1 else None
        return node.get(lane)

    def _put(self, lane: int, h: Any, f: int) -> None:
        """Set ``lane``'s facts of ``h`` (resident there already or not)."""
        nodes = self.nodes
        node = nodes.get(h)
        if node is None:
            nodes[h] = (1 << lane << SHIFT) | f if f <= FACTS else {lane: f}
            return
        if type(node) is int:
            if node & FACTS == f:
                nodes[h] = node | (1 << lane << SHIFT)
                return
            if node >> SHIFT == 1 << lane and f <= FACTS:  # this lane alone: new facts
                nodes[h] = (node >> SHIFT << SHIFT) | f
                return
            node = _unfold(node)
        node[lane] = f
        nodes[h] = _fold(node)

    def _take(self, lane: int, h: Any) -> int | None:
        """Drop ``lane`` from ``h``'s node; its facts, or ``None`` when it was not there."""
        nodes = self.nodes
        node = nodes.get(h)
        if node is None:
            return None
        if type(node) is int:
            bit = 1 << lane << SHIFT
            if not node & bit:
                return None
            node ^= bit
            if node >> SHIFT:
                nodes[h] = node
            else:
                del nodes[h]
            return node & FACTS
        f = node.pop(lane, None)
        if f is not None:
            if not node:
                del nodes[h]
            else:
                nodes[h] = _fold(node)
        return f

    # -- updates -------------------------------------------------------------------------

    def store(self, run: Run, now: float = 0.0) -> int:
        """One more announcement of each hash of a STORE run, with its facts (on a set key:
        the entry, once). ``now`` starts the TTL of media that have one. Returns how many
        of the hashes were resident under the key already."""
        key, hashes = run.key, run.hashes
        view = self.res.get(key)
        if view is None:
            view = self._dict(key)
        n = len(hashes)
        self.stores += n
        if n == 1:
            again = self._store_one(key, view.lane, hashes[0],
                                    run.first_tokens * 4 + (run.kind or 0))
        else:
            again = self._store_many(key, view.lane, run, n)
        if key in self.ttl_keys:
            self._touch(key, view, hashes, now)
        return again

    def _store_one(self, key: ResidencyKey, lane: int, h: Any, packed: int) -> int:
        if h not in self.nodes and packed <= FACTS and self.n_entries < self.max_entries:
            self.nodes[h] = (1 << lane << SHIFT) | packed  # a new hash: its node
            self.n_entries += 1
            self.kinds[key][packed & 3] += 1
            return 0
        old = self._facts(lane, h)
        if old is not None:
            self._again(key, lane, h, old, packed)
            return 1
        if self.n_entries < self.max_entries:
            self._put(lane, h, packed)
            self.n_entries += 1
            self.kinds[key][packed & 3] += 1
        else:
            self.dropped_capacity += 1
        return 0

    def _store_many(self, key: ResidencyKey, lane: int, run: Run, n: int) -> int:
        hashes = run.hashes
        base = run.first_tokens * 4 + (run.kind or 0)  # pack(), inline
        if run.first_tokens:
            step4 = run.step * 4
            values: Iterable[int] = range(base, base + n * step4, step4)
            last = base + (n - 1) * step4
        else:
            values, last = repeat(base, n), base
        nodes = self.nodes
        if (last <= FACTS and self.n_entries + n <= self.max_entries
                and nodes.keys().isdisjoint(hashes)):
            before = len(nodes)  # new hashes (the common case): one C-speed update
            lanes = 1 << lane << SHIFT  # the nodes: the facts plus the lane bit, as a range
            nodes.update(zip(hashes, range(lanes + base, lanes + base + n * step4, step4)
                             if run.first_tokens else repeat(lanes + base, n), strict=True))
            added = len(nodes) - before
            self.n_entries += added
            self.kinds[key][base & 3] += added
            if added != n and key not in self.set_keys:  # one hash twice: count it twice
                ex = self.extra.setdefault(key, {})
                for h, c in Counter(hashes).items():
                    if c > 1:
                        ex[h] = ex.get(h, 0) + c - 1
            return 0
        again = 0
        for h, packed in zip(hashes, values, strict=True):
            again += self._store_one(key, lane, h, packed)
        return again

    def _again(self, key: ResidencyKey, lane: int, h: Any, old: int, packed: int) -> None:
        """A resident hash announced again: one more reference (not on a set key); the
        facts merged."""
        if key not in self.set_keys:
            ex = self.extra.get(key)
            if ex is None:
                ex = self.extra[key] = {}
            ex[h] = ex.get(h, 0) + 1
        if old != packed:
            self._set(key, lane, h, old, merge(old, packed))

    def _set(self, key: ResidencyKey, lane: int, h: Any, old: int, new: int) -> None:
        """Replace the facts of a resident entry, keeping the per-kind counts right."""
        if new == old:
            return
        self._put(lane, h, new)
        if (old ^ new) & 3:
            kc = self.kinds[key]
            kc[old & 3] -= 1
            kc[new & 3] += 1

    def remove(self, key: ResidencyKey, hashes: Sequence[Any]) -> None:
        """Drop one announcement of each hash under ``key``; unknown hashes are counted."""
        n = len(hashes)
        view = self.res.get(key)
        if view is None:
            self.unknown_removals += n
            return
        lane = view.lane
        ex = self.extra.get(key)
        kc = self.kinds[key]
        if not ex or ex.keys().isdisjoint(hashes):
            missing = self._remove_bulk(lane, hashes, kc)
            gone = n - missing
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
                f = self._take(lane, h)
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
        exp = self.expires.get(key)
        if exp:
            for h in hashes:
                if h not in view:
                    exp.pop(h, None)

    def _remove_bulk(self, lane: int, hashes: Sequence[Any], kc: list[int]) -> int:
        """Drop ``lane`` from each hash (no extra references); return how many were not
        there. C passes when every hash is absent or held by this lane alone (the common
        case); a node other lanes hold is put back (without this lane's bit)."""
        n = len(hashes)
        nodes = self.nodes
        popped = list(map(nodes.pop, hashes, repeat(_MISS, n)))
        mine = 1 << lane
        try:
            owners = list(map(rshift, popped, repeat(SHIFT, n)))  # _MISS -> -1
        except TypeError:  # a dict node
            return self._remove_each(lane, hashes, popped, kc)
        missing = owners.count(-1)
        alone = owners.count(mine)
        shared: list[int] = []  # held by other lanes too: put back without this lane's bit
        strays: list[int] = []  # not this lane's at all: put back, counted as missing
        if alone + missing != n:
            for i in compress(count(), map(and_, map(ne, owners, repeat(mine)),
                                           map(ne, owners, repeat(-1)))):
                (shared if owners[i] & mine else strays).append(i)
        if kc[_FULL] == sum(kc):  # the key holds FULL entries only: so were these
            kc[_FULL] -= alone + len(shared)
        else:
            bits = bytes(map(and_, popped, repeat(3, n)))  # _MISS & 3 == 0
            full = bits.count(_FULL)
            kc[_FULL] -= full
            if full + missing != n:  # other kinds (or strays) among them
                for k in (0, _PARTIAL, 3):
                    kc[k] -= bits.count(k)
                kc[0] += missing
            for i in strays:
                kc[popped[i] & 3] += 1
        bit = mine << SHIFT
        for i in shared:
            nodes[hashes[i]] = popped[i] ^ bit
        for i in strays:
            nodes[hashes[i]] = popped[i]
        return missing + len(strays)

    def _remove_each(self, lane: int, hashes: Sequence[Any], popped: list[Any],
                     kc: list[int]) -> int:
        """:meth:`_remove_bulk` hash by hash, after putting back what it popped."""
        nodes = self.nodes
        for h, node in zip(reversed(hashes), reversed(popped), strict=True):
            if node is not _MISS:  # put back (a hash twice: its first pop, last)
                nodes[h] = node
        missing = 0
        for h in hashes:
            f = self._take(lane, h)
            if f is None:
                missing += 1
            else:
                kc[f & 3] -= 1
        return missing

    def clear(self, publisher: Publisher, mediums: Iterable[str] | None = None) -> int:
        """Drop every entry of ``publisher`` (optionally only on ``mediums``); return count.
        Scans the node table once (a reset or a restart, not the hot path)."""
        wanted = None if mediums is None else set(mediums)
        dropped = 0
        lanes = 0
        for key in [k for k in self.res if k[0] == publisher]:
            if wanted is None or key[1] in wanted:
                view = self.res.pop(key)
                size = len(view)
                if size:
                    lanes |= 1 << view.lane
                dropped += size
                heapq.heappush(self._free_lanes, view.lane)
                view.lane = _DEAD_LANE
                self.shape += 1
                self.extra.pop(key, None)
                del self.kinds[key]
                self.set_keys.discard(key)
                self.ttl_keys.pop(key, None)
                self.expires.pop(key, None)  # its heap items are skipped when they come up
                pg = (key[0], key[2])
                self.by_pg[pg].remove(key)
                if not self.by_pg[pg]:
                    del self.by_pg[pg]
        if lanes:
            self._drop_lanes(lanes)
        self.n_entries -= dropped
        self.clears += 1
        return dropped

    def _drop_lanes(self, lanes: int) -> None:
        nodes = self.nodes
        keep = ~(lanes << SHIFT)
        try:  # int nodes only: which hold one of the lanes, in C passes
            held = map(and_, map(rshift, nodes.values(), repeat(SHIFT)), repeat(lanes))
            hit = list(compress(list(nodes), list(held)))
        except TypeError:  # dict nodes too
            hit = [h for h, node in nodes.items()
                   if (node >> SHIFT & lanes if type(node) is int
                       else any(1 << lane & lanes for lane in node))]
        for h in hit:
            node = nodes[h]
            if type(node) is int:
                node &= keep
                if node >> SHIFT:
                    nodes[h] = node
                else:
                    del nodes[h]
            else:
                rest = {lane: f for lane, f in node.items() if not 1 << lane & lanes}
                if rest:
                    nodes[h] = _fold(rest)
                else:
                    del nodes[h]

    # -- expiry (media with a TTL) ----------------------------------------------------------

    def _touch(self, key: ResidencyKey, d: Mapping[Any, int], hashes: Sequence[Any],
               now: float) -> None:
        """(Re)start the TTL of the resident ``hashes``: one heap item per entry; a refresh
        only moves its time (the item is re-queued when it comes up early)."""
        exp = self.expires[key]
        t = now + self.ttl_keys[key]
        heap = self._heap
        for h in hashes:
            if h in d:
                if h not in exp:
                    heapq.heappush(heap, (t, next(self._tick), key, h))
                exp[h] = t
        if len(heap) > self._heap_limit:  # stale items of removed entries: rebuild
            self._heap = [(t, next(self._tick), k, h)
                          for k, e in self.expires.items() for h, t in e.items()]
            heapq.heapify(self._heap)
            self._heap_limit = 2 * len(self._heap) + 1024

    def expire(self, now: float) -> int:
        """Drop the entries whose TTL ran out by ``now``; return how many."""
        heap = self._heap
        n = 0
        while heap and heap[0][0] <= now:
            _, _, key, h = heapq.heappop(heap)
            exp = self.expires.get(key)
            t = None if exp is None else exp.get(h)
            if t is None:
                continue  # removed or cleared meanwhile
            if t > now:  # refreshed since it was queued
                heapq.heappush(heap, (t, next(self._tick), key, h))
                continue
            del exp[h]
            self._drop(key, h)
            n += 1
        self.expired += n
        return n

    def _drop(self, key: ResidencyKey, h: Any) -> None:
        """Remove an entry outright, whatever its refcount (a Redis key expires for all)."""
        f = self._take(self.res[key].lane, h)
        assert f is not None
        ex = self.extra.get(key)
        if ex is not None and ex.pop(h, None) is not None and not ex:
            del self.extra[key]
        self.kinds[key][f & 3] -= 1
        self.n_entries -= 1

    # -- what the classifier asks: parents' positions, and rewrites of undecided entries ----

    def position_of(self, pg: PG, block_hash: Any) -> int:
        """``num_tokens`` of a resident hash of (publisher, group); 0 when unknown."""
        node = self.nodes.get(block_hash)
        if node is None:
            return 0
        res = self.res
        if type(node) is int:
            if not (node & FACTS) >> 2:  # its lanes share its facts: position unknown
                return 0
            for key in self.by_pg.get(pg, ()):
                if node >> SHIFT >> res[key].lane & 1:
                    return (node & FACTS) >> 2
            return 0
        for key in self.by_pg.get(pg, ()):
            f = node.get(res[key].lane)
            if f is not None and f >> 2:
                return f >> 2
        return 0

    def rewrite(self, pg: PG, fn: Callable[[Any, int], int | None],
                hashes: Iterable[Any] | None = None) -> None:
        """Replace facts of resident entries of (publisher, group) where ``fn`` says so
        (``hashes``: only those; default every entry, a scan of the node table)."""
        for key in self.by_pg.get(pg, ()):
            view = self.res[key]
            for h in list(view if hashes is None else hashes):
                f = view.get(h)
                if f is not None:
                    new = fn(h, f)
                    if new is not None:
                        self._set(key, view.lane, h, f, new)

    def rewrite_hashes(self, pg: PG, updates: Mapping[Any, int]) -> None:
        """Merge known facts into resident entries of (publisher, group)."""
        for key in self.by_pg.get(pg, ()):
            lane = self.res[key].lane
            for h, f in updates.items():
                old = self._facts(lane, h)
                if old is not None:
                    self._set(key, lane, h, old, merge(old, f))

    # -- queries -------------------------------------------------------------------------

    def refcount(self, key: ResidencyKey, block_hash: Any) -> int:
        view = self.res.get(key)
        if view is None or block_hash not in view:
            return 0
        return 1 + self.extra.get(key, {}).get(block_hash, 0)

    def _sources(self, medium: str | None, group: int,
                 publishers: set[Publisher] | None) -> list[LaneView]:
        return [d for key, d in self.res.items()
                if key[2] == group and d
                and (medium is None or key[1] == medium)
                and (publishers is None or key[0] in publishers)]

    def _size_classes(self, group: int,
                      publisher: Publisher | None) -> dict[int, set[Publisher] | None]:
        """Block size -> the publishers walked with it (``None``: all of them)."""
        sizes = self.sizes
        if publisher is not None:
            b = sizes.group_block_size(group, publisher)
            return {} if b is None else {b: {publisher}}
        if group in sizes.configured:
            return {sizes.configured[group]: None}
        classes: dict[int, set[Publisher] | None] = {}
        for pg in self.by_pg:
            if pg[1] == group:
                b = sizes.block_size(pg) or sizes.sibling(pg)
                if b is not None:  # unknown: its entries are PENDING, never counted
                    members = classes.setdefault(b, set())
                    assert members is not None
                    members.add(pg[0])
        return classes

    def lookup(self, block_hashes: Sequence[Any], group: int = 0, unit: int | None = None,
               publisher: Publisher | None = None,
               mediums: Sequence[str] = tuple(Medium)) -> dict[str, PrefixMatch]:
        """Longest cached prefix of ``block_hashes`` per medium and over all (``"any"``).

        ``block_hashes`` is the request's chain, one hash per ``unit`` tokens (default: the
        block size). Pass ``unit`` = vLLM's hash block size (``prefix_match_unit``) with the
        request's fine-grained ``block_hashes`` to let partial entries end a prefix.
        Publishers are walked with their own block size (``publisher``: that one only);
        publishers whose block size ``unit`` does not divide are left out; a ``unit`` that
        fits none is a :class:`ValueError`.
        """
        result = {m: _EMPTY for m in mediums}
        result[ANY] = _EMPTY
        if not block_hashes:
            return result
        classes = self._size_classes(group, publisher)
        walks = [(b, unit or b, pubs) for b, pubs in classes.items()
                 if (unit or b) > 0 and b % (unit or b) == 0]
        if classes and not walks:
            known = " or ".join(map(str, sorted(classes)))
            raise ValueError(f"unit {unit} must divide the group's block size {known}")
        for b, u, pubs in walks:
            for medium in (*mediums, ANY):
                sources = self._sources(None if medium == ANY else medium, group, pubs)
                if sources:
                    m = _walk(block_hashes, sources, u, b)
                    if m.tokens > result[medium].tokens:
                        result[medium] = m
        return result

    # -- what scoring reads (connector.events.score) ---------------------------------------

    def note_group_kind(self, pg: PG, spec_kind: str | None) -> None:
        """Remember vLLM's ``kv_cache_spec_kind`` of (publisher, group) (``None``: unsaid)."""
        if spec_kind and self.group_kinds.get(pg) != spec_kind:
            self.group_kinds[pg] = spec_kind
            self.shape += 1

    def publishers(self) -> set[Publisher]:
        """Every publisher the index has heard of (entries, block sizes or group kinds)."""
        return {pg[0] for pg in (*self.by_pg, *self.sizes.learned, *self.group_kinds)}

    def groups_of(self, publisher: Publisher) -> list[int]:
        """The KV-cache groups ``publisher`` has announced, sorted."""
        return sorted({g for p, g in (*self.by_pg, *self.sizes.learned, *self.group_kinds)
                       if p == publisher})

    def groups_by_publisher(self) -> dict[Publisher, list[int]]:
        """Every publisher the index has heard of, with its groups (:meth:`groups_of`), in
        one pass."""
        out: dict[Publisher, set[int]] = {}
        for p, g in (*self.by_pg, *self.sizes.learned, *self.group_kinds):
            out.setdefault(p, set()).add(g)
        return {p: sorted(gs) for p, gs in out.items()}

    def media_view(self, pg: PG, empty: bool = False) -> dict[str, list[Mapping[Any, int]]]:
        """Medium -> the entry dicts of (publisher, group) there (one per ownership); with
        ``empty``, those that hold nothing right now too (the dicts live as long as their
        residency key: until :attr:`shape` changes)."""
        view: dict[str, list[Mapping[Any, int]]] = {}
        for key in self.by_pg.get(pg, ()):
            d = self.res[key]
            if d or empty:
                view.setdefault(key[1], []).append(d)
        return view

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


def _walk(chain: Sequence[Any], sources: list[Mapping[Any, int]], u: int, b: int) -> PrefixMatch:
    prefix = 0
    full = 0
    best_partial = 0
    end = 0
    for h in chain:
        end += u
        limit = prefix + b
        if end > limit:
            break
        kind = 0  # kind bits: PENDING until an entry says otherwise
        for d in sources:
            f = d.get(h)
            if f is None:
                continue
            nt = f >> 2
            if nt and nt != end:  # recorded position disagrees with the chain: ignore
                continue
            k = f & 3
            if k == _FULL:
                kind = _FULL
                break
            if k == _PARTIAL:
                kind = _PARTIAL
        if kind == _FULL and end == limit:
            prefix = end
            full += 1
            best_partial = 0
        elif kind == _PARTIAL and end < limit:
            best_partial = end
    if best_partial > prefix:
        return PrefixMatch(best_partial, full, True)
    return PrefixMatch(prefix, full, False)


# -- per-position tests for scoring (the packed format stays in this module) ----------------

STATE_KINDS = frozenset({_FULL, _PARTIAL, int(BlockKind.PLACEHOLDER)})
"""Kind bits that prove a recurrent (Mamba) state at a hash's position: any but PENDING."""


def _at(sources: list[Mapping[Any, int]], h: Any, end: int, kinds: frozenset[int]) -> bool:
    for d in sources:
        f = d.get(h)
        if f is not None and f & 3 in kinds and (not f >> 2 or f >> 2 == end):
            return True
    return False


_FULL_ONLY = frozenset({_FULL})
_PARTIAL_ONLY = frozenset({_PARTIAL})


def full_run(chain: Sequence[Any], sources: list[Mapping[Any, int]], u: int, b: int) -> int:
    """How many whole blocks of ``b`` tokens from the chain's start are resident FULL entries
    (chain hash ``i`` covers ``(i + 1) * u`` tokens; a recorded position that disagrees does
    not count). The run stops at the first block that is not: nothing past a gap counts."""
    r = b // u
    n = len(chain) // r
    if len(sources) != 1:
        i = 0
        while i < n and _at(sources, chain[(i + 1) * r - 1], (i + 1) * b, _FULL_ONLY):
            i += 1
        return i
    # One dict (the common case). FULL at a known position packs to end * 4 + 1 (an
    # unknown position packs to 1). Where the run ends is guessed with single probes: the
    # first block (most engines hold none of a request), the last (an engine often holds
    # it all), else a bisection (a prefix cache holds the start of a chain: gaps are rare).
    # The guess is then proved: the blocks before it compared with the progression as one
    # list, at C speed, which finds the first gap if the guess was wrong. Exact either way.
    get = sources[0].get
    step = b * 4
    if not n or get(chain[r - 1]) not in (step + _FULL, _FULL):
        return 0
    lo, hi = 0, n  # block lo is FULL; block hi is not (or hi == n)
    if get(chain[n * r - 1]) not in (n * step + _FULL, _FULL):
        hi = n - 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if get(chain[(mid + 1) * r - 1]) in ((mid + 1) * step + _FULL, _FULL):
                lo = mid
            else:
                hi = mid
    if hi > 1:
        facts = list(map(get, chain[2 * r - 1:hi * r:r]))  # blocks 1 .. hi - 1
        ends = _progression(step, hi)[1:hi]
        if facts != ends:
            for k in compress(count(), map(ne, facts, ends)):
                if facts[k] != _FULL:
                    return 1 + k
    return hi


_PROGRESSIONS: dict[int, list[int]] = {}  # step -> [step + 1, 2 * step + 1, ...]: FULL facts
_PROGRESSION_CAP = 1 << 16  # longest cached progression (a 1M-token chain at 16 per hash)


def _progression(step: int, n: int) -> list[int]:
    """FULL facts of blocks ``1..n`` of ``step // 4`` tokens: ``[step + 1, ..., n * step + 1]``
    (at least ``n`` items; cached per step up to :data:`_PROGRESSION_CAP`)."""
    p = _PROGRESSIONS.get(step)
    if p is None or len(p) < n:
        if n > _PROGRESSION_CAP:
            return list(range(step + _FULL, (n + 1) * step, step))
        m = max(n, min(_PROGRESSION_CAP, 2 * len(p) if p else 1024))
        p = _PROGRESSIONS[step] = list(range(step + _FULL, (m + 1) * step, step))
    return p


def has_partial(sources: list[Mapping[Any, int]], h: Any, end: int) -> bool:
    """A PARTIAL entry of hash ``h`` ending at ``end`` (or at an unknown position) is resident."""
    return _at(sources, h, end, _PARTIAL_ONLY)


def has_state(sources: list[Mapping[Any, int]], h: Any, end: int) -> bool:
    """An entry of hash ``h`` that is not PENDING and not placed elsewhere is resident: for a
    recurrent group, its state after ``end`` tokens."""
    return _at(sources, h, end, STATE_KINDS)


# -- every engine's run of whole blocks, in one pass (what scoring walks) ---------------------

PARTIAL_BITS = _PARTIAL
"""Kind bits of a PARTIAL entry (``KVIndex.kinds[key][PARTIAL_BITS]`` counts them)."""


def lane_runs(nodes: Mapping[Any, int | dict[int, int]], chain: Sequence[Any], u: int,
              b: int) -> dict[int, int]:
    """Lane -> how many whole blocks of ``b`` tokens from the chain's start it holds as FULL
    entries at their chain position (or at an unknown one); lanes holding none are left out.
    (:func:`lane_groups`, by lane.)"""
    return {lane: k for lanes, k in lane_groups(nodes, chain, u, b) for lane in lanes_of(lanes)}


def lane_groups(nodes: Mapping[Any, int | dict[int, int]], chain: Sequence[Any], u: int,
                b: int) -> list[tuple[int, int]]:
    """:func:`lane_runs` as ``(lanes, run)`` pairs: the lanes (bits) whose run ends after
    ``run`` blocks, each run once.

    One table hop per block for every lane at once. On a C ``NodeTable`` the whole walk is one
    C pass (:func:`connector.events.node_table.walk_groups`). Else the lanes still in the run
    (``alive``) predict each block's node exactly (``alive`` at the FULL facts of its
    position): the nodes are compared with that prediction at C speed up to the first that
    differs, where the run of the lanes that node lacks ends. Nodes in the dict form, and
    more surprises than :data:`_SURPRISES`, take :func:`_lane_runs_exact`.
    """
    r = b // u
    ends = chain[r - 1::r] if r > 1 else chain
    n = len(ends)
    if not n:
        return []
    walked = node_table.walk_groups(nodes, ends, b)
    if walked is not None:
        return walked
    get = nodes.get
    groups: list[tuple[int, int]] = []
    alive = 0
    j = 0  # ends[j] is the block to look at; nothing past a run's end is fetched
    surprises = 0
    prog = _progression(b * 4, n)
    while j < n:
        node = get(ends[j], 0)
        if type(node) is not int:
            return _lane_runs_exact(list(map(get, ends, repeat(0, n))), b)
        f = node & FACTS
        held = node >> SHIFT if f == prog[j] or f == _FULL else 0
        now = alive & held if j else held
        if j and alive & ~now:
            groups.append((alive & ~now, j))
        if not now:
            return groups
        if now == alive:  # a node with more lanes than the run's, or a FULL of unknown place
            surprises += 1
            if surprises > _SURPRISES:
                return _lane_runs_exact(list(map(get, ends, repeat(0, n))), b)
        alive = now
        want = _predicted(alive, b, n)
        j = next(compress(count(j + 1), map(ne, map(get, islice(ends, j + 1, n)),
                                            islice(want, j + 1, n))), n)
    groups.append((alive, n))
    return groups


_LANES: dict[int, tuple[int, ...]] = {}  # lanes (bits) -> their numbers


def lanes_of(mask: int) -> tuple[int, ...]:
    """The lane numbers of the bits of ``mask``, ascending (cached)."""
    lanes = _LANES.get(mask)
    if lanes is None:
        lanes = tuple(_lanes_of(mask))
        if len(_LANES) < 1 << 16:  # full: made each time
            _LANES[mask] = lanes
    return lanes


_SURPRISES = 8
_PREDICTED: dict[tuple[int, int], list[int]] = {}  # (lanes, b) -> their nodes, block by block
_PREDICTED_CAP = 4096


def _predicted(lanes: int, b: int, n: int) -> list[int]:
    """The nodes of blocks ``0..n-1`` held by exactly ``lanes`` as FULL entries of ``b``
    tokens at their positions (cached per ``(lanes, b)``)."""
    p = _PREDICTED.get((lanes, b))
    if p is None or len(p) < n:
        p = list(map(or_, _progression(b * 4, max(n, 256)), repeat(lanes << SHIFT)))
        if len(_PREDICTED) < _PREDICTED_CAP:  # full: made each time
            _PREDICTED[lanes, b] = p
    return p


def _lane_runs_exact(vals: list[Any], b: int) -> list[tuple[int, int]]:
    """:func:`lane_groups` one block at a time (dict nodes, FULL entries of unknown place)."""
    groups: list[tuple[int, int]] = []
    alive = -1  # every lane
    for i, node in enumerate(vals):
        full = (i + 1) * b * 4 + _FULL
        if not node:
            m = 0
        elif type(node) is int:
            f = node & FACTS
            m = node >> SHIFT if f == full or f == _FULL else 0
        else:
            m = 0
            for lane, f in node.items():
                if f == full or f == _FULL:
                    m |= 1 << lane
        if i == 0:
            alive = m
        elif alive & ~m:
            groups.append((alive & ~m, i))
            alive &= m
        if not alive:
            return groups
    groups.append((alive, len(vals)))
    return groups
