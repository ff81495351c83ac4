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

Pure functions over a :class:`~connector.events.index.KVIndex`; not thread-safe (the
caller holds the index's lock while :func:`prefixes` walks it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from connector.events.index import (
    KVIndex,
    Publisher,
    full_run,
    has_partial,
    has_state,
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

STATE_SPEC_KINDS = frozenset({"mamba"})
"""``kv_cache_spec_kind`` values of groups that restore a state at an end, not blocks."""


class Prefix(NamedTuple):
    """One engine's cached prefix on one medium: ``tokens``, and whether it ends inside an
    attention block (a PARTIAL entry ends it)."""

    tokens: int
    partial: bool


_NONE = Prefix(0, False)
_MEDIA: tuple[str, ...] = tuple(str(m) for m in Medium)


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
        return max((p.tokens for p in self.media.values()), default=0)

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


def weights_from(given: Mapping[str, Any] | None) -> dict[str, float]:
    """:data:`DEFAULT_WEIGHTS` overridden by ``given`` (medium names normalised: ``cpu`` is
    CPU). :class:`ValueError` naming ``weights.<medium>`` for a weight that is not a finite
    number >= 0."""
    out = dict(DEFAULT_WEIGHTS)
    for name, w in (given or {}).items():
        if (isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w)
                or w < 0):
            raise ValueError(f"'weights.{name}' must be a finite number >= 0")
        out[str(normalize_medium(name))] = float(w)
    return out


def weighted(media: Mapping[str, Prefix], weights: Mapping[str, float]) -> float:
    """Each cached token once, at the best-weighted medium whose prefix holds it."""
    covered = 0
    total = 0.0
    for m in sorted(media, key=lambda m: (-weights.get(m, 0.0), m)):
        t = media[m].tokens
        if t > covered:
            total += weights.get(m, 0.0) * (t - covered)
            covered = t
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
              sources: list[dict[Any, int]]) -> bool:
    """Can group ``g`` (``k`` whole blocks resident from the start) restore end ``e``?"""
    h = chain[e // u - 1]
    if g.state:
        return has_state(sources, h, e)
    b = g.block_size
    if e % b == 0:
        return e <= k * b
    return e < (k + 1) * b and has_partial(sources, h, e)


def _medium_prefix(chain: Sequence[Any], u: int, groups: list[_Group],
                   views: list[dict[str, list[dict[Any, int]]]], medium: str) -> Prefix:
    """The longest end every group restores from ``medium``."""
    srcs = [v.get(medium, []) for v in views]
    if not all(srcs):
        return _NONE
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


def prefixes(index: KVIndex, chain: Sequence[Any], unit: int | None = None,
             groups: Sequence[int] | None = None,
             publishers: Iterable[Publisher] = ()) -> dict[Publisher, Found]:
    """Per engine: prefix per medium, the groups walked, and a note.

    ``chain`` holds one hash per ``unit`` tokens (default: the gcd of the engine's block
    sizes). ``groups``: the groups every engine must restore (default: each engine's
    announced groups). ``publishers`` are listed even if the index holds nothing of them.
    """
    out: dict[Publisher, Found] = {}
    for pub in sorted({*index.publishers(), *publishers}):
        gs, note = _groups(index, pub, groups)
        u, bad = _unit(gs, unit) if gs else (0, None)
        note = note or bad or (None if gs else "no KV-cache group announced yet")
        views = [index.media_view((pub, g.group)) for g in gs]
        seen = {m for v in views for m in v}
        walk = bool(gs) and u > 0 and note is None
        media = {m: _medium_prefix(chain, u, gs, views, m) if walk else _NONE
                 for m in (*_MEDIA, *sorted(seen.difference(_MEDIA)))}
        out[pub] = Found(media, [g.group for g in gs], note)
    return out


def rank(found: Mapping[Publisher, Found], weights: Mapping[str, float]) -> list[EngineScore]:
    """Engines with their weighted scores, best first (score, cached tokens, then name)."""
    scores = [EngineScore(pub, weighted(media, weights), media, gs, note)
              for pub, (media, gs, note) in found.items()]
    scores.sort(key=lambda s: (-s.score, -s.cached_tokens, s.publisher))
    return scores


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
