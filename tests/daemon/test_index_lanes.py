"""The shared node table (issue 49): one walk per query for every engine, exact as the walk of
each engine alone; vLLM #44488's skipped span decoded; vLLM #49125's stale partial replayed.

No vLLM needed: events are kvtier's own wire structs (field for field vLLM's), encoded as vLLM
encodes them and fed through the daemon's ingest.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest

from connector.daemon.ingest import Ingestor
from connector.events.index import FACTS, SHIFT, lane_runs
from connector.events.score import (
    _walk_one,
    _walks,
    prefixes,
    rank,
    score_engines,
    weights_from,
)
from connector.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
)

pytestmark = pytest.mark.usefixtures("node_tables")  # the C node table and the dict

B, U = 64, 16  # block size, hash unit: partial entries end every 16 tokens inside a block


def stored(hashes: list[int], parent: int | None, size: int, medium: str = "GPU",
           **kw: Any) -> BlockStored:
    return BlockStored(hashes, parent, [1] * (size * len(hashes)), size, None, medium, None,
                       group_idx=0, **kw)


def feed(ing: Ingestor, source: str, *events: Any) -> None:
    ing.ingest(source, 0, encode_batch(KVEventBatch(1.0, list(events))), now=1.0)


def chain_of(seed: int, n: int) -> list[int]:
    """A request's fine-grained chain: hash i covers (i + 1) * U tokens; requests with the
    same ``seed % 3`` share their first quarter (a shared system prompt)."""
    shared = n // 4
    return [(seed % 3) * 10**6 + i + 1 for i in range(shared)] + \
           [10**9 + seed * 10**4 + i for i in range(shared, n)]


def block_ends(chain: list[int]) -> list[int]:
    return chain[B // U - 1::B // U]


def random_stream(rng: random.Random, engines: int, steps: int) -> list[tuple[str, Any]]:
    """Stores (whole chains, their starts, parents known or not), partial tails, removals,
    re-announcements, CPU copies and resets, over ``engines`` engines."""
    out: list[tuple[str, Any]] = []
    for _ in range(steps):
        src = f"e{rng.randrange(engines)}"
        c = chain_of(rng.randrange(12), 32)
        ends = block_ends(c)
        k = rng.randrange(1, len(ends) + 1)
        medium = rng.choice(("GPU", "GPU", "CPU"))
        roll = rng.random()
        if roll < 0.45:
            out.append((src, stored(ends[:k], None, B, medium)))
        elif roll < 0.55:  # a parent never announced: positions unknown
            j = rng.randrange(1, len(ends))
            out.append((src, stored(ends[j:j + 2], ends[j - 1], B, medium)))
        elif roll < 0.7:  # a partial tail inside block k
            e = k * B + rng.choice((1, 2, 3)) * U
            if e // U <= len(c):
                out.append((src, stored([c[e // U - 1]], c[e // U - 2], U, medium)))
        elif roll < 0.95:
            out.append((src, BlockRemoved(ends[rng.randrange(k):k][::-1], medium,
                                          group_idx=0)))
        else:
            out.append((src, AllBlocksCleared()))
    return out


def queries(rng: random.Random) -> list[list[int]]:
    qs = []
    for seed in range(12):
        c = chain_of(seed, 32)
        qs.append(c)
        cut = rng.randrange(1, 32)
        qs.append(c[:cut] + [7 * 10**11 + i for i in range(32 - cut)])
        qs.append(c[:rng.randrange(1, 32)])
    qs.append(block_ends(chain_of(1, 32))[::-1])  # hashes off their positions
    return qs


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("unit", [U, B])
def test_one_walk_for_every_engine_answers_as_each_engine_walked_alone(seed: int,
                                                                       unit: int) -> None:
    rng = random.Random(seed)
    ing = Ingestor({0: B})
    for src, ev in random_stream(rng, engines=1 + seed * 3, steps=400):
        feed(ing, src, ev)
    index = ing.index
    for q in queries(rng):
        chain = q if unit == U else block_ends(q)
        together = prefixes(index, chain, unit=unit)
        w = _walks(index, unit, None, ())
        plans = {**{p.publisher: p for p in w.slow}, **w.fast_plans}
        for pub, found in together.items():
            if pub in plans:
                alone = _walk_one(plans[pub], chain)
                assert found.media == alone.media, (pub, chain)
        for weights in ({}, {"GPU": 0.0, "CPU": 2.0}):  # ranked as a plain dict is
            w = weights_from(weights)
            assert [s.as_dict() for s in rank(together, w)] == \
                [s.as_dict() for s in rank(dict(together), w)]


def test_lane_runs_match_a_block_by_block_walk_with_dict_nodes_and_unplaced_entries() -> None:
    """Lanes that disagree on a hash's facts (dict nodes) and FULL entries of unknown
    position (that count at any position) take the exact walk: same answer."""
    ing = Ingestor({0: B})
    c = block_ends(chain_of(0, 32))
    feed(ing, "a", stored(c[:6], None, B))
    feed(ing, "b", stored(c[3:5], c[2], B))  # parent placed by a: positions known
    feed(ing, "c", stored(c[2:6], 999, B))  # parent never announced: unknown positions
    feed(ing, "c", stored(c[:2], None, B))
    index = ing.index
    assert any(type(n) is dict for n in index.nodes.values())
    lanes = {key[0]: view.lane for key, view in index.res.items()}
    runs = lane_runs(index.nodes, c, B, B)
    assert runs == {lanes["a#dp0"]: 6, lanes["c#dp0"]: 6}  # b lacks block 0
    by_engine = {s.publisher: s.media["GPU"].tokens for s in score_engines(index, c)}
    assert by_engine == {"a#dp0": 6 * B, "c#dp0": 6 * B, "b#dp0": 0}


def test_a_block_held_by_every_engine_is_one_node() -> None:
    """64 engines holding one system prompt: one node per block (a lane bit per engine),
    facts packed beside the bits."""
    ing = Ingestor({0: B})
    prompt = block_ends(chain_of(0, 32))
    for e in range(64):
        feed(ing, f"e{e}", stored(prompt, None, B))
    index = ing.index
    assert len(index.nodes) == len(prompt) and index.n_entries == 64 * len(prompt)
    node = index.nodes[prompt[2]]
    assert node >> SHIFT == (1 << 64) - 1 and node & FACTS == 3 * B * 4 + 1
    ranked = score_engines(index, prompt + [1, 2])
    assert {s.media["GPU"].tokens for s in ranked} == {len(prompt) * B}


# -- vLLM #44488 / #58121: skipped span -------------------------------------------------------

FULL0 = 4  # block 0's last hash (64 tokens), announced
SKIPPED = 5  # the 80-token boundary: never announced (a partial entry skips it)
PART = 6  # the partial entry at 96 tokens


def _ingest_partial(skipped: bool, raw: bool) -> Ingestor:
    ing = Ingestor({0: B})
    kw = {"skipped_parent_block_hash": FULL0, "skipped_token_ids": [1] * U} if skipped else {}
    events = [stored([FULL0], None, B), stored([PART], SKIPPED, U, **kw)]
    payload = encode_batch(KVEventBatch(1.0, events))
    if raw:  # the daemon's decode path (token ids left raw)
        ing.ingest("e", 0, payload, now=1.0)
    else:  # the plain structs (array-form publishers decode to these)
        for ev in msgspec.msgpack.decode(payload, type=KVEventBatch).events:
            run = ing.classifier.classify("e#dp0", ev)
            assert run is not None
            ing.index.store(run)
    return ing


@pytest.mark.parametrize("raw", [True, False])
def test_skipped_span_places_a_partial_whose_parent_was_never_announced(raw: bool) -> None:
    """#58121: parent H80 never announced; skipped_parent H64 + 16 skipped tokens place it at
    80, so the partial is at 96: counted at 96, not where the chain puts the hash elsewhere."""
    ing = _ingest_partial(skipped=True, raw=raw)
    (_full, part) = ing.index.describe([FULL0, PART])
    assert (part["num_tokens"], part["kind"]) == (96, "PARTIAL")
    chain = [1, 2, 3, FULL0, SKIPPED, PART]
    assert score_engines(ing.index, chain, unit=U)[0].media["GPU"] == (96, True)
    off = [1, 2, 3, FULL0, PART]  # the hash at 80 tokens: its recorded 96 disagrees
    assert score_engines(ing.index, off, unit=U)[0].media["GPU"] == (64, False)


@pytest.mark.parametrize("raw", [True, False])
def test_without_skipped_fields_an_unannounced_parent_leaves_the_position_unknown(
        raw: bool) -> None:
    """Before #44488 (fields absent): the parent is never announced, so the partial's
    position stays unknown (PARTIAL by its shape) and the chain places it."""
    ing = _ingest_partial(skipped=False, raw=raw)
    (_full, part) = ing.index.describe([FULL0, PART])
    assert (part["num_tokens"], part["kind"]) == (None, "PARTIAL")
    off = [1, 2, 3, FULL0, PART]
    assert score_engines(ing.index, off, unit=U)[0].media["GPU"] == (80, True)


def test_skipped_span_from_the_chain_start_and_an_unplaced_skipped_parent() -> None:
    """#44488 sparse full blocks: skipped_parent None means the span starts at token 0; a
    skipped parent never announced either leaves the position unknown."""
    ing = Ingestor({0: B})
    feed(ing, "e", stored([20], 19, B, skipped_parent_block_hash=None,
                          skipped_token_ids=[1] * (2 * B)))
    feed(ing, "e", stored([30], 29, B, skipped_parent_block_hash=28,
                          skipped_token_ids=[1] * B))
    assert [e["num_tokens"] for e in ing.index.describe([20, 30])] == [3 * B, None]


# -- vLLM #49125: a stale partial re-registered after promotion -------------------------------

def test_stale_partial_after_promotion_keeps_refcounts_exact() -> None:
    """The block pool's sequence under #49125: partial P stored; promotion removes P and
    stores F; the stale P is stored again (spurious); another request's block holds P too;
    eviction removes F and P, then the other block's P. Every count follows the events."""
    ing = Ingestor({0: B})
    index = ing.index
    c = chain_of(5, 8)  # 8 hashes of 16: blocks end at c[3] and c[7]
    key = ("e#dp0", "GPU", 0, None)
    p_hash, f_hash = c[5], c[7]  # partial at 96 tokens, full block at 128
    feed(ing, "e", stored(block_ends(c)[:1], None, B))
    feed(ing, "e", stored([p_hash], c[4], U))
    assert index.refcount(key, p_hash) == 1
    feed(ing, "e", BlockRemoved([p_hash], "GPU", group_idx=0),
         stored([f_hash], c[3], B))  # promotion
    assert (index.refcount(key, p_hash), index.refcount(key, f_hash)) == (0, 1)
    feed(ing, "e", stored([p_hash], c[4], U))  # the spurious re-registration
    feed(ing, "e", stored([p_hash], c[4], U))  # a second block (another request) holds P
    assert (index.refcount(key, p_hash), index.refcount(key, f_hash)) == (2, 1)
    assert index.entry_counts() == {("GPU", "FULL"): 2, ("GPU", "PARTIAL"): 1}
    assert score_engines(index, c, unit=U)[0].media["GPU"] == (128, False)
    feed(ing, "e", BlockRemoved([f_hash], "GPU", group_idx=0),
         BlockRemoved([p_hash], "GPU", group_idx=0))  # eviction: both keys of the block
    assert (index.refcount(key, p_hash), index.refcount(key, f_hash)) == (1, 0)
    assert score_engines(index, c, unit=U)[0].media["GPU"] == (96, True)
    feed(ing, "e", BlockRemoved([p_hash], "GPU", group_idx=0),
         BlockRemoved(block_ends(c)[:1], "GPU", group_idx=0))
    assert index.n_entries == 0 and not index.nodes and not index.extra
    assert index.unknown_removals == 0 and index.entry_counts() == {}
