"""Engine scores for KV-aware routing: how much of one request each engine can restore, where.

Rules it keeps (docs/daemon.md, "POST /score"):

* The request is a chain of hashes as vLLM computes them, one per ``unit`` tokens (the hash
  block size): hash ``i`` covers exactly ``(i + 1) * unit`` tokens, so a resident hash is
  placed by its chain position (an entry whose recorded ``num_tokens`` disagrees is ignored).
* An engine is a publisher (source + DP rank). Per medium, an attention group of block size
  ``b`` restores an end ``e`` when every block up to ``e`` is a resident FULL entry and, for
  ``e`` inside a block, a PARTIAL entry ends exactly at ``e``: a partial ends a prefix and
  never extends it. The walk stops at the first missing block (a store whose parent was
  never announced, vLLM #58119, counts only where the chain up to it is resident).
* A recurrent group (``kv_cache_spec_kind`` ``mamba``) restores ``e`` when its state at
  ``e`` is resident (any kind but PENDING). An engine's prefix is the longest end every
  group it needs restores: the connector's hit rule (connector/vllm_connector/scheduler.py).
* score = sum over media, best weight first, of weight x the tokens that medium adds beyond
  the media weighted above it: each cached token counts once, at the best tier holding it.
  Engines rank by score, then cached tokens, then name.

Functions over a :class:`~connector.events.index.KVIndex`; not thread-safe (the caller holds
the index's lock while :func:`prefixes` walks it). What a walk needs per engine and changes
only with the index's shape (groups, block sizes, unit, each medium's residency key) is kept
on the index (``KVIndex.plans``) until that shape changes. Engines with one attention group
are walked together, one pass over the chain's nodes per block size
(:func:`~connector.events.index.lane_groups`): the cost is one dict hop per block whatever the
number of engines; engines whose run ends at one block share one answer, made once per shape.
Others (hybrid, several ownerships on a medium, media past the three) are walked one by one.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from operator import attrgetter, itemgetter
from typing import Any, NamedTuple

from connector.events.index import (
    PARTIAL_BITS,
    KVIndex,
    Publisher,
    full_run,
    has_partial,
    has_state,
    lane_groups,
    lanes_of,
)
from connector.events.wire import Medium, normalize_medium

__all__ = [
    "DEFAULT_WEIGHTS",
    "EngineScore",
    "Found",
    "Prefix",
    "check_unit",
    "prefixes",
    "rank",
    "score_engines",
    "weighted",
    "weights_from",
]

DEFAULT_WEIGHTS: dict[str, float] = {Medium.GPU: 1.0, Medium.CPU: 0.8, Medium.STORAGE: 0.5}
"""Tier weights when none are given: a token in GPU memory is worth most, one in Redis least."""

_DEFAULT_WEIGHTS = {str(m): w for m, w in DEFAULT_WEIGHTS.items()}  # str keys: an enum hashes
# in Python on every look-up

STATE_SPEC_KINDS = frozenset({"mamba"})
"""``kv_cache_spec_kind`` values of groups that restore a state at an end, not blocks."""


class Prefix(NamedTuple):
    """One engine's cached prefix on one medium: ``tokens``, and whether it ends inside an
    attention block (a PARTIAL entry ends it)."""

    tokens: int
    partial: bool


_NONE = Prefix(0, False)
_MEDIA: tuple[str, ...] = tuple(str(m) for m in Medium)
_NO_MEDIA: dict[str, Prefix] = dict.fromkeys(_MEDIA, _NONE)


class EngineScore(NamedTuple):
    """One engine's answer: prefix per medium, the weighted score, the groups walked, and a
    note when it could not be walked (unknown block size, a unit that does not divide it)."""

    publisher: Publisher
    score: float
    media: dict[str, Prefix]
    groups: list[int]
    note: str | None

    @property
    def cached_tokens(self) -> int:
        return max(self.media.values(), default=_NONE).tokens  # Prefix orders by tokens

    def as_dict(self) -> dict[str, Any]:
        return {"publisher": self.publisher, "score": round(self.score, 6),
                "cached_tokens": self.cached_tokens,
                "tokens": {m: p.tokens for m, p in self.media.items()},
                "partial": {m: p.partial for m, p in self.media.items()},
                "groups": self.groups, "note": self.note}


class Found(NamedTuple):
    """What :func:`prefixes` finds for one engine, before weights."""

    media: dict[str, Prefix]
    groups: list[int]
    note: str | None


class _Group(NamedTuple):
    group: int
    block_size: int  # 0 for a state group of unknown size (not needed to walk it)
    state: bool


def weights_from(given: Mapping[str, Any] | None,
                 known_media: Iterable[str] | None = None) -> dict[str, float]:
    """:data:`DEFAULT_WEIGHTS` overridden by ``given`` (medium names normalised: ``cpu`` is
    CPU). :class:`ValueError` naming ``weights.<medium>`` for a weight that is not a finite
    number >= 0, and with ``known_media`` (media announced besides the three) for a medium
    that is neither one of the three (or an alias) nor one of those."""
    out = dict(_DEFAULT_WEIGHTS)
    known = None if known_media is None else {*_MEDIA, *known_media}
    for name, w in (given or {}).items():
        if (isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w)
                or w < 0):
            raise ValueError(f"'weights.{name}' must be a finite number >= 0")
        medium = str(normalize_medium(name))
        if known is not None and medium not in known:
            raise ValueError(f"'weights.{name}' is not a medium: known media "
                             f"{', '.join(sorted(known))} (or aliases such as cpu, disk)")
        out[medium] = float(w)
    return out


def weighted(media: Mapping[str, Prefix], weights: Mapping[str, float]) -> float:
    """Each cached token once, at the best-weighted medium whose prefix holds it."""
    return _weighted(media, _by_weight(media, weights))


_ORDERS: dict[tuple[tuple[str, float], ...], tuple[list[tuple[str, float]], int]] = {}
_ORDER_IDS = itertools.count()


def _by_weight(media: Iterable[str], weights: Mapping[str, float]) -> list[tuple[str, float]]:
    """``(medium, weight)`` best weight first (ties by name)."""
    return [(m, weights.get(m, 0.0))
            for m in sorted(media, key=lambda m: (-weights.get(m, 0.0), m))]


def _weighted(media: Mapping[str, Prefix], order: list[tuple[str, float]]) -> float:
    covered = 0
    total = 0.0
    for m, w in order:
        p = media.get(m)
        if p is not None and p.tokens > covered:
            total += w * (p.tokens - covered)
            covered = p.tokens
    return total


def _groups(index: KVIndex, publisher: Publisher,
            wanted: Sequence[int] | None) -> tuple[list[_Group], str | None]:
    groups = []
    for g in (wanted if wanted is not None else index.groups_of(publisher)):
        state = index.group_kinds.get((publisher, g), "").lower() in STATE_SPEC_KINDS
        b = index.sizes.group_block_size(g, publisher)
        if b is None and not state:
            return [], f"block size of group {g} not known yet"
        groups.append(_Group(g, b or 0, state))
    return groups, None


def _unit(groups: list[_Group], unit: int | None) -> tuple[int, str | None]:
    sizes = [g.block_size for g in groups if g.block_size]
    if unit is None:
        return (math.gcd(*sizes) if sizes else 0), None
    bad = [g.group for g in groups if not g.state and g.block_size % unit]
    if bad:
        return 0, f"unit {unit} does not divide the block size of group {bad[0]}"
    return unit, None


def _servable(chain: Sequence[Any], e: int, u: int, g: _Group, k: int,
              sources: list[Mapping[Any, int]]) -> bool:
    """Can group ``g`` (``k`` whole blocks resident from the start) restore end ``e``?"""
    h = chain[e // u - 1]
    if g.state:
        return has_state(sources, h, e)
    b = g.block_size
    if e % b == 0:
        return e <= k * b
    return e < (k + 1) * b and has_partial(sources, h, e)


def _attention_prefix(chain: Sequence[Any], u: int, b: int, srcs: list[Mapping[Any, int]],
                      k: int | None = None) -> Prefix:
    """One attention group: the run of whole blocks (``k`` when known), then a partial
    inside the next block."""
    if k is None:
        k = full_run(chain, srcs, u, b)
    top = min(len(chain) * u, (k + 1) * b - u)
    for e in range(top, k * b, -u):  # a partial inside block k ends the prefix there
        if has_partial(srcs, chain[e // u - 1], e):
            return Prefix(e, True)
    return Prefix(k * b, False) if k else _NONE


def _medium_prefix(chain: Sequence[Any], u: int, groups: list[_Group],
                   srcs: list[list[Mapping[Any, int]]]) -> Prefix:
    """The longest end every group restores from one medium (``srcs``: its entry dicts, per
    group)."""
    if len(groups) == 1 and not groups[0].state:
        return _attention_prefix(chain, u, groups[0].block_size, srcs[0])
    horizon = len(chain) * u
    runs = []
    for g, s in zip(groups, srcs, strict=True):
        k = 0 if g.state else full_run(chain, s, u, g.block_size)
        runs.append(k)
        if not g.state:  # nothing past block k's end: a gap cuts the chain
            horizon = min(horizon, (k + 1) * g.block_size - u)
    for e in range(horizon - horizon % u, 0, -u):
        if all(_servable(chain, e, u, g, k, s)
               for g, k, s in zip(groups, runs, srcs, strict=True)):
            return Prefix(e, any(not g.state and e % g.block_size for g in groups))
    return _NONE


class _Plan(NamedTuple):
    """What walking one engine needs that changes only with the index's shape: its groups,
    unit and note, and per medium each group's entry dicts (empty ones too: emptiness is
    checked per query)."""

    publisher: Publisher
    groups: list[_Group]
    group_ids: list[int]
    unit: int
    note: str | None
    walks: list[tuple[str, list[list[Mapping[Any, int]]]]]  # medium, per group: its dicts
    extra: list[tuple[str, list[Mapping[Any, int]]]]  # media past GPU/CPU/STORAGE: their dicts
    attention: int  # the block size when the engine has one group, an attention group; or 0


_PLANS_MAX = 64  # cached (unit, groups, publishers) combinations per index shape


class _ZeroFound(Found):
    """A :class:`Found` that is the same on every query while the index's shape holds (an
    engine that holds nothing of the chain, or cannot be walked): shared, with its
    :class:`EngineScore` (``ranked``) made once. Callers must not mutate it."""

    ranked: EngineScore


def _zero(plan: _Plan) -> _ZeroFound:
    z = _ZeroFound(dict(_NO_MEDIA), list(plan.group_ids), plan.note)
    z.ranked = EngineScore(plan.publisher, 0.0, z.media, z.groups, plan.note)
    return z


class _Walks(NamedTuple):
    """Every engine's walk for one (unit, groups, publishers), for one index shape.

    ``fast``: per (block size, unit), lane -> (engine, medium) of the engines with one
    attention group and one residency key per medium (walked together, one pass over the
    node table); ``slow``: every other engine that can hold something (walked alone);
    ``base``: every engine's answer when it holds nothing, in name order."""

    fast: list[tuple[int, int, dict[int, tuple[Publisher, str]], bool]]
    fast_plans: dict[Publisher, _Plan]
    slow: list[_Plan]
    base: dict[Publisher, Found]
    zeros: dict[Publisher, EngineScore]  # every engine's ranking when it holds nothing
    hits: dict[tuple[int, int, int], _Hits]  # (lanes, k, b) -> their answers
    answers: dict[tuple[int, int], tuple[Publisher, _HitFound]]  # (lane, tokens) -> answer
    # the engines of groups that hold something -> every other engine's ranking, by name
    left: dict[tuple[tuple[Publisher, ...], ...], list[EngineScore]]


def _walks(index: KVIndex, unit: int | None, groups: Sequence[int] | None,
           publishers: Iterable[Publisher]) -> _Walks:
    """The :class:`_Walks`, cached on the index until its shape (keys, group kinds, learned
    block sizes) changes."""
    pubs = frozenset(publishers)
    token = (index.shape, getattr(index.sizes.learned, "version", None), len(index.sizes.learned))
    cache = index.plans
    if cache.get(None) != token or len(cache) > _PLANS_MAX:
        cache.clear()
        cache[None] = token
    ck = (unit, None if groups is None else tuple(groups), pubs)
    cached: _Walks | None = cache.get(ck)
    if cached is None:
        cached = cache[ck] = _classify_plans(_plans(index, unit, groups, pubs))
    return cached


def _classify_plans(plans: list[_Plan]) -> _Walks:
    fast: dict[tuple[int, int], dict[int, tuple[Publisher, str]]] = {}
    fast_plans: dict[Publisher, _Plan] = {}
    slow = []
    base: dict[Publisher, Found] = {}
    for plan in plans:
        base[plan.publisher] = _zero(plan)
        if plan.extra:
            slow.append(plan)
        elif plan.walks and plan.attention and all(len(per_group[0]) == 1
                                                   for _m, per_group in plan.walks):
            lanes = fast.setdefault((plan.attention, plan.unit), {})
            for m, per_group in plan.walks:
                lanes[per_group[0][0].lane] = (plan.publisher, m)
            fast_plans[plan.publisher] = plan
        elif plan.walks:
            slow.append(plan)
    return _Walks([(b, u, lanes, len({pub for pub, _m in lanes.values()}) == len(lanes))
                   for (b, u), lanes in fast.items()], fast_plans, slow, base,
                  {pub: f.ranked for pub, f in base.items()}, {}, {}, {})


def _plans(index: KVIndex, unit: int | None, groups: Sequence[int] | None,
           pubs: frozenset[Publisher]) -> list[_Plan]:
    """Every engine's :class:`_Plan`, by name."""
    known = index.groups_by_publisher()
    for pub in pubs:
        known.setdefault(pub, [])
    plans = []
    for pub in sorted(known):
        gs, note = _groups(index, pub, groups if groups is not None else known[pub])
        u, bad = _unit(gs, unit) if gs else (0, None)
        note = note or bad or (None if gs else "no KV-cache group announced yet")
        views = [index.media_view((pub, g.group), empty=True) for g in gs]
        extra = sorted({m for v in views for m in v}.difference(_MEDIA))
        walks = [(m, [v[m] for v in views]) for m in views[0]
                 if all(m in v for v in views)] if gs and u > 0 and note is None else []
        plans.append(_Plan(pub, gs, [g.group for g in gs], u, note, walks,
                           [(m, [d for v in views for d in v.get(m, ())]) for m in extra],
                           gs[0].block_size if len(gs) == 1 and not gs[0].state else 0))
    return plans


def prefixes(index: KVIndex, chain: Sequence[Any], unit: int | None = None,
             groups: Sequence[int] | None = None,
             publishers: Iterable[Publisher] = ()) -> dict[Publisher, Found]:
    """Per engine: prefix per medium, the groups walked, and a note.

    ``chain`` holds one hash per ``unit`` tokens (default: the gcd of the engine's block
    sizes). ``groups``: the groups every engine must restore (default: each engine's
    announced groups). ``publishers`` are listed even if the index holds nothing of them.
    Only media where every group holds entries are walked (elsewhere nothing is restorable).
    Engines with one attention group are walked together: one pass over the chain per block
    size (:func:`lane_runs`), whatever their number. The :class:`Found` returned are shared
    between calls while the index's shape holds: read them, do not mutate them.
    """
    w = _walks(index, unit, groups, publishers)
    out = _Answers(w.base)
    out.zeros = w.zeros
    out.left = w.left
    partials = None
    for b, u, lanes, one_lane in w.fast:
        groups = lane_groups(index.nodes, chain, u, b)
        if u < b and partials is None:  # a partial can end a prefix: probe for one
            partials = any(kc[PARTIAL_BITS] for kc in index.kinds.values())
        if u < b and partials:
            runs = {lane: k for mask, k in groups for lane in lanes_of(mask)}
            _probe_partials(w, chain, u, b, lanes, runs, out)
            continue
        hits = w.hits
        for mask, k in groups:
            g = hits.get((mask, k, b))
            if g is None:
                g = _Hits(_hits(w, lanes, mask, k * b))
                if len(hits) < _HITS_MAX:  # full: made each time (a clear would pause)
                    hits[mask, k, b] = g
            if one_lane:  # an engine in one group at most: its answer as it is
                dict.update(out, g.pairs)
                out.groups.append(g)
                continue
            for pub, f in g.pairs:
                prev = out[pub]
                out[pub] = f if type(prev) is _ZeroFound else _hit(pub, prev, f.media)
    for plan in w.slow:
        out[plan.publisher] = _walk_one(plan, chain)
    return out


class _Hits:
    """The engines whose run ends at one block, with one answer each: made once per index
    shape; ranked once per weighting (``ranked``: the shared sort key and the engines'
    scores by name)."""

    __slots__ = ("pairs", "pubs", "ranked")

    def __init__(self, pairs: list[tuple[Publisher, _HitFound]]) -> None:
        self.pairs = pairs
        self.pubs = tuple(pub for pub, _f in pairs)
        self.ranked: dict[int, tuple[tuple[float, int], list[EngineScore]]] = {}

    def rank(self, wid: int, order: list[tuple[str, float]]
             ) -> tuple[tuple[float, int], list[EngineScore]]:
        got = self.ranked.get(wid)
        if got is None:
            keyed = sorted((f.ranked.get(wid) or f.ranked.setdefault(wid, _keyed(pub, f, order))
                            for pub, f in self.pairs), key=itemgetter(0))
            key = keyed[0][0][:2] if keyed else (0.0, 0)
            got = self.ranked[wid] = (key, [sc for _k, sc in keyed])
        return got


class _Answers(dict[Publisher, Found]):
    """What :func:`prefixes` returns: a dict, plus what :func:`rank` reads to skip the
    engines that hold nothing (``zeros``: all of them ranked, by name; ``groups``: engines
    answered in groups; ``changed``: those answered otherwise this time)."""

    zeros: dict[Publisher, EngineScore]
    left: dict[tuple[tuple[Publisher, ...], ...], list[EngineScore]]  # _Walks.left

    def __init__(self, base: dict[Publisher, Found]) -> None:
        super().__init__(base)
        self.changed: set[Publisher] = set()
        self.groups: list[_Hits] = []

    def __setitem__(self, pub: Publisher, found: Found) -> None:
        super().__setitem__(pub, found)
        self.changed.add(pub)

    def update(self, *args: Any, **kw: Any) -> None:
        new = dict(*args, **kw)
        super().update(new)
        self.changed.update(new)

    def __delitem__(self, pub: Publisher) -> None:  # rank would list it among the zeros
        raise TypeError("an engine's answer cannot be deleted")


_HITS_MAX = 1 << 16  # cached group answers, and engine answers, per index shape
_LEFT_MAX = 1 << 12  # cached rankings of the engines left out of the groups, per index shape


def _hits(w: _Walks, lanes: dict[int, tuple[Publisher, str]], mask: int,
          tokens: int) -> list[tuple[Publisher, _HitFound]]:
    """Each engine's answer where the lanes of ``mask`` hold ``tokens`` in whole blocks
    (made once per lane and answer)."""
    out = []
    answers = w.answers
    for lane in lanes_of(mask):
        pair = answers.get((lane, tokens))
        if pair is None:
            at = lanes.get(lane)
            if at is None:  # an engine walked otherwise
                continue
            pair = (at[0], _hit(at[0], w.base[at[0]], {at[1]: Prefix(tokens, False)}))
            if len(answers) < _HITS_MAX:
                answers[lane, tokens] = pair
        out.append(pair)
    return out


class _HitFound(Found):
    """A :class:`Found` of the joint walk, shared while the index's shape holds, with its
    ranking per weighting (``ranked``) made on first use."""

    ranked: dict[int, tuple[tuple[float, int, str], EngineScore]]  # by weighting
    ranked_as: Publisher


def _hit(pub: Publisher, base: Found, media: Mapping[str, Prefix]) -> _HitFound:
    """``base`` with ``media`` found (each over what ``base`` has there), for ``pub``."""
    f = _HitFound({**base.media, **{m: p for m, p in media.items()
                                     if p.tokens > base.media[m].tokens}},
                  base.groups, base.note)  # shared, as the answer is
    f.ranked, f.ranked_as = {}, pub
    return f


def _probe_partials(w: _Walks, chain: Sequence[Any], u: int, b: int,
                    lanes: dict[int, tuple[Publisher, str]], runs: dict[int, int],
                    out: _Answers) -> None:
    """The joint walk's runs, each followed by a probe for a partial entry inside the next
    block (only while the index holds partial entries)."""
    for lane, (pub, m) in lanes.items():
        view = next(ds[0][0] for mm, ds in w.fast_plans[pub].walks if mm == m)
        p = _attention_prefix(chain, u, b, [view], runs.get(lane, 0)) if view else _NONE
        if p.tokens:
            out[pub] = _hit(pub, out[pub], {m: p})


def _walk_one(plan: _Plan, chain: Sequence[Any]) -> Found:
    """One engine walked on its own (several groups, a recurrent group, several residency
    keys on one medium, or media past the three)."""
    _pub, gs, group_ids, u, note, walks, extra, b = plan
    media = dict(_NO_MEDIA)
    for m, ds in extra:  # listed where entries are, in name order after the three
        if any(ds):
            media[m] = _NONE
    for m, per_group in walks:
        if b:  # one attention group: no per-group lists
            ds = [d for d in per_group[0] if d]
            if ds:
                media[m] = _attention_prefix(chain, u, b, ds)
            continue
        srcs = [[d for d in ds if d] for ds in per_group]
        if all(srcs):
            media[m] = _medium_prefix(chain, u, gs, srcs)
    return Found(media, list(group_ids), note)


def rank(found: Mapping[Publisher, Found], weights: Mapping[str, float]) -> list[EngineScore]:
    """Engines with their weighted scores, best first (score, cached tokens, then name)."""
    wk = tuple(weights.items())
    got = _ORDERS.get(wk)
    if got is None:
        if len(_ORDERS) > 256:
            _ORDERS.clear()
        got = _ORDERS[wk] = (_by_weight(_MEDIA, weights), next(_ORDER_IDS))
    order, wid = got  # wid: a small int naming the weighting (media hash slowly)
    if type(found) is _Answers and (not found.changed or not any(
            found.changed.intersection(g.pubs) for g in found.groups)):
        return _rank_answers(found, order, wid, weights)
    return _rank_each(list(found.items()), [], order, weights)


def _rank_answers(found: _Answers, order: list[tuple[str, float]], wid: int,
                  weights: Mapping[str, float]) -> list[EngineScore]:
    """:func:`rank` of :func:`prefixes`' answer: the engines that hold nothing are ranked
    already (the rest of them, once per set of groups), each group of engines once per
    weighting; only the rest one by one."""
    if not found.changed:
        key = tuple(g.pubs for g in found.groups)
        zeros = found.left.get(key)
        if zeros is None:
            rest = found.zeros.copy()
            for pubs in key:
                for pub in pubs:
                    del rest[pub]
            zeros = list(rest.values())
            if len(found.left) < _LEFT_MAX:  # full: made each time
                found.left[key] = zeros
        return _merge([g.rank(wid, order) for g in found.groups], zeros)
    left = found.zeros.copy()
    blocks = []
    for g in found.groups:
        for pub in g.pubs:
            del left[pub]
        blocks.append(g.rank(wid, order))
    for pub in found.changed:
        left.pop(pub, None)
    return _rank_each([(pub, found[pub]) for pub in found.changed], blocks, order, weights,
                      list(left.values()))


def _rank_each(items: list[tuple[Publisher, Found]],
               blocks: list[tuple[tuple[float, int], list[EngineScore]]],
               order: list[tuple[str, float]], weights: Mapping[str, float],
               zeros: list[EngineScore] | None = None) -> list[EngineScore]:
    """Rank ``items`` one by one (engines that hold nothing once per shape) with ``blocks``
    (ranked groups) and ``zeros`` (engines known to hold nothing, by name)."""
    zeros = [] if zeros is None else zeros
    extra = [f.media for _p, f in items if len(f.media) > len(_MEDIA)]
    if extra:
        order = _by_weight(set(_MEDIA).union(*extra), weights)
    for pub, f in items:
        if type(f) is _ZeroFound:
            zeros.append(f.ranked)
        else:
            k, sc = _keyed(pub, f, order)
            blocks.append((k[:2], [sc]))
    zeros.sort(key=attrgetter("publisher"))  # sorted already, mostly: linear
    return _merge(blocks, zeros)


def _merge(blocks: list[tuple[tuple[float, int], list[EngineScore]]],
           zeros: list[EngineScore]) -> list[EngineScore]:
    """Blocks of equally ranked engines (each by name) best first, engines of equal rank
    by name; then the zeros (by name) with the blocks that rank as nothing."""
    blocks.sort(key=itemgetter(0))
    out: list[EngineScore] = []
    i, n = 0, len(blocks)
    while i < n:
        key, scores = blocks[i]
        if not (key[0] or key[1]):  # ranks as nothing: among the zeros, by name
            rest = [sc for _k, ss in blocks[i:] for sc in ss] + zeros
            return out + sorted(rest, key=attrgetter("publisher"))
        j = i + 1
        while j < n and blocks[j][0] == key:
            j += 1
        if j == i + 1:
            out += scores
        else:
            out += sorted((sc for _k, ss in blocks[i:j] for sc in ss),
                          key=attrgetter("publisher"))
        i = j
    return out + zeros


def _keyed(pub: Publisher, f: Found,
           order: list[tuple[str, float]]) -> tuple[tuple[float, int, str], EngineScore]:
    """One engine's sort key (score, cached tokens, name) and :class:`EngineScore`."""
    media, gs, note = f
    covered = 0  # _weighted, inline
    total = 0.0
    for m, w in order:
        p = media.get(m)
        if p is not None and p[0] > covered:
            total += w * (p[0] - covered)
            covered = p[0]
    return ((-total, -max(media.values(), default=_NONE)[0], pub),
            EngineScore(pub, total, media, gs, note))


def score_engines(index: KVIndex, chain: Sequence[Any], unit: int | None = None,
                  groups: Sequence[int] | None = None,
                  weights: Mapping[str, Any] | None = None,
                  publishers: Iterable[Publisher] = ()) -> list[EngineScore]:
    """:func:`prefixes` then :func:`rank` with :func:`weights_from` ``weights``. A ``unit``
    that fits no engine whose block sizes are known is a :class:`ValueError`."""
    w = weights_from(weights)
    found = prefixes(index, chain, unit, groups, publishers)
    check_unit(found, unit)
    return rank(found, w)


def check_unit(found: Mapping[Publisher, Found], unit: int | None) -> None:
    """:class:`ValueError` naming ``hash_block_size`` when ``unit`` fits none of the engines
    that could otherwise be walked."""
    if unit is None:
        return
    notes = [note for _m, _g, note in found.values()]
    misfits = [n for n in notes if n and n.startswith(f"unit {unit} ")]
    if misfits and len(misfits) == sum(1 for n in notes if n is None or n in misfits):
        raise ValueError(f"'hash_block_size' {unit} must divide the engines' block sizes "
                         f"({misfits[0]})")
