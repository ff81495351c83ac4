"""The C node table (connector/events/_node_table.c) is a dict for every key and every value,
holds its objects as a dict does (references, GC), and its walk answers as the Python one.

Skipped where the extension is not built; the dict path is what runs there (and, with the
``node_tables`` fixture, beside the C table everywhere else).
"""

from __future__ import annotations

import gc
import os
import pickle
import random
import subprocess
import sys
import weakref
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connector.events import node_table
from connector.events.index import FACTS, SHIFT, KVIndex, _lane_runs_exact, lane_groups

pytestmark = pytest.mark.skipif(not node_table.C_TABLE, reason="the C node table is not built")

if node_table.C_TABLE:
    from connector.events._node_table import NodeTable
    from connector.events._node_table import lane_groups as c_lane_groups

M64 = 2**64
EDGE_KEYS = [0, 1, M64 - 1, M64, M64 + 1, -1, -(2**70), 2**63, 2**63 - 1, b"", b"\x00" * 8,
             "0", 1.0, 2.5, -0.0, float(2**63), True, None, (1, 2)]
EDGE_VALUES = [0, 1, 2**63 - 1, 2**63, M64 - 1, M64, 2**126, 2**127 - 1, 2**127, 2**300, -1,
               -(2**80), {3: 4}, "x", None, True, 1.5, b"v"]

keys = st.one_of(st.sampled_from(EDGE_KEYS), st.integers(0, M64 - 1), st.integers(0, 64),
                 st.integers(-(2**66), 2**66), st.binary(max_size=4))
values = st.one_of(st.sampled_from(EDGE_VALUES), st.integers(0, 2**130),
                   st.dictionaries(st.integers(0, 100), st.integers(0, 2**40), max_size=3))
ops = st.one_of(
    st.tuples(st.just("set"), keys, values),
    st.tuples(st.just("del"), keys),
    st.tuples(st.just("pop"), keys),
    st.tuples(st.just("get"), keys),
    st.tuples(st.just("update"), st.lists(st.tuples(keys, values), max_size=20)),
    st.tuples(st.just("fill"), st.integers(1, 300), st.integers(0, 2**31)),
    st.tuples(st.just("drain"), st.floats(0.0, 1.0), st.integers(0, 2**31)),
    st.tuples(st.just("clear")),
)


def _canon(k: Any) -> str:
    """A key's sort key, the same for keys a dict holds as one (``True``, ``1``, ``1.0``)."""
    if isinstance(k, int | float) and k == int(k):
        return f"i{int(k)}"
    return f"o{k!r}"


def _apply(t: Any, op: tuple[Any, ...]) -> Any:
    """One operation on a dict or a NodeTable: what it returned, or the exception type."""
    kind = op[0]
    try:
        if kind == "set":
            t[op[1]] = op[2]
        elif kind == "del":
            del t[op[1]]
        elif kind == "pop":
            return t.pop(op[1], "missing"), t.pop(op[1], "again")
        elif kind == "get":
            return t.get(op[1]), t.get(op[1], "d"), op[1] in t, t[op[1]]
        elif kind == "update":
            t.update(op[1])
        elif kind == "fill":  # many keys at once: growth, long probe chains
            rng = random.Random(op[2])
            t.update((rng.getrandbits(64), i) for i in range(op[1]))
        elif kind == "drain":  # drop a share of the keys in random order: backward shifts
            rng = random.Random(op[2])
            ks = sorted(t, key=_canon)
            rng.shuffle(ks)
            for k in ks[:int(len(ks) * op[1])]:
                del t[k]
        else:
            t.clear()
    except (KeyError, TypeError) as e:
        return type(e)
    return None


def _same(t: Any, ref: dict[Any, Any]) -> None:
    assert len(t) == len(ref)
    assert dict(t) == ref
    assert dict(t.items()) == ref and len(t.keys()) == len(t.values()) == len(ref)
    for k, v in ref.items():
        assert t[k] == v and k in t and t.get(k) == v


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, max_size=40))
def test_node_table_behaves_as_a_dict(seq: list[tuple[Any, ...]]) -> None:
    t, ref = NodeTable(), {}
    for op in seq:
        assert _apply(t, op) == _apply(ref, op), op
        assert len(t) == len(ref)
    _same(t, ref)


def test_edge_keys_and_values_every_pair() -> None:
    t, ref = NodeTable(), {}
    for i, k in enumerate(EDGE_KEYS):
        for v in EDGE_VALUES:
            t[k] = ref[k] = v
            assert t[k] == v and type(t[k]) is type(v)
        t[k] = ref[k] = EDGE_VALUES[i % len(EDGE_VALUES)]
    _same(t, ref)
    assert 2**64 in t and -1 in t and b"" in t and 1 in t  # True and 1.0 are the key 1
    with pytest.raises(TypeError):
        t[[1]] = 1
    with pytest.raises(TypeError):
        _ = [1] in NodeTable()  # unhashable even with nothing in the dict beside
    with pytest.raises(KeyError):
        _ = NodeTable()[5]
    with pytest.raises(KeyError):
        NodeTable().pop(2**64)


def test_growth_and_shrink_keep_every_key_and_release_memory() -> None:
    rng = random.Random(7)
    t, ref = NodeTable(), {}
    small = t.__sizeof__()
    ks = [rng.getrandbits(64) for _ in range(200_000)] + list(range(1000))
    for i, k in enumerate(ks):
        t[k] = ref[k] = i
    big = t.__sizeof__()
    assert big > 100 * small
    rng.shuffle(ks)
    for k in ks[:-10]:
        assert t.pop(k) == ref.pop(k)
    _same(t, ref)
    assert t.__sizeof__() < big // 1000
    t.clear()
    assert len(t) == 0 and t.__sizeof__() == small


def test_keys_view_isdisjoint_and_update_forms() -> None:
    t = NodeTable({5: 1, b"k": 2})
    assert t.keys().isdisjoint([6, 7, b"q"]) and not t.keys().isdisjoint(iter([9, b"k"]))
    assert (5, 1) in t.items() and (5, 2) not in t.items() and 2 in t.values()
    t.update({6: 3})
    t.update([[7, 4]])
    t.update(NodeTable({8: 5}))
    assert dict(t) == {5: 1, b"k": 2, 6: 3, 7: 4, 8: 5}
    with pytest.raises(ValueError):
        t.update([(1, 2, 3)])


def test_iterating_while_keys_come_or_go_raises() -> None:
    t = NodeTable({i: i for i in range(10)})
    with pytest.raises(RuntimeError):
        for k in t:
            t[k + 100] = 0
    for k in t:  # new values of present keys: allowed, as in a dict
        t[k] = 1
    with pytest.raises(RuntimeError):
        for k in t:
            del t[k]


def test_references_are_held_and_released_as_a_dict_does() -> None:
    big, obj = 2**200 + 12345, object()
    for v in (big, obj):
        before = sys.getrefcount(v)
        t = NodeTable()
        t[1] = v
        t[b"fallback"] = v
        assert sys.getrefcount(v) == before + 2
        t[1] = 7  # replaced
        assert sys.getrefcount(v) == before + 1
        t[1] = v
        assert t.pop(1) is v
        assert sys.getrefcount(v) == before + 1
        t[2] = v
        del t[2]
        t.update([(3, v), (4, v)])
        t.clear()
        assert sys.getrefcount(v) == before
        t[5] = v
        del t
        assert sys.getrefcount(v) == before
    inline = 2**100  # an int below 2**127: kept inline, not referenced
    before = sys.getrefcount(inline)
    t = NodeTable()
    t[1] = inline
    assert sys.getrefcount(inline) == before and t[1] == inline


class _Box:
    table: Any = None


def test_gc_collects_a_cycle_through_the_table() -> None:
    for key in (1, b"fallback"):
        box = _Box()
        box.table = NodeTable()
        box.table[key] = box
        alive = weakref.ref(box)
        del box
        gc.collect()
        assert alive() is None


def test_not_picklable() -> None:
    with pytest.raises(TypeError):
        pickle.dumps(NodeTable({1: 2}))


def _random_nodes(rng: random.Random, n: int, b: int,
                  lanes: int) -> tuple[list[int], dict[int, Any]]:
    """A chain's block ends and their nodes: runs of FULL facts at their positions (or at no
    position), lanes dropping out, wide lane masks, a dict node now and then."""
    ends = [rng.getrandbits(64) for _ in range(n)]
    nodes: dict[int, Any] = {}
    alive = rng.getrandbits(lanes) | 1
    for j, h in enumerate(ends):
        if rng.random() < 0.1:
            alive &= rng.getrandbits(lanes)
        if rng.random() < 0.05:
            alive |= rng.getrandbits(lanes)
        facts = rng.choice([(j + 1) * b * 4 + 1, 1, (j + 2) * b * 4 + 1, (j + 1) * b * 4 + 2])
        if alive and rng.random() < 0.97:
            nodes[h] = (alive << SHIFT) | facts
        if rng.random() < 0.01:
            nodes[h] = {0: (j + 1) * b * 4 + 1, 3: 5}
    return ends, nodes


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32), st.integers(0, 300), st.sampled_from([1, 16, 64]),
       st.sampled_from([1, 8, 31, 32, 64, 95, 96, 200]))
def test_c_walk_answers_as_the_python_walk(seed: int, n: int, b: int, lanes: int) -> None:
    rng = random.Random(seed)
    ends, nodes = _random_nodes(rng, n, b, lanes)
    t = NodeTable(nodes)
    want = lane_groups(nodes, ends, b, b)  # the dict: Python's walk
    assert want == _lane_runs_exact([nodes.get(h, 0) for h in ends], b) or not n
    assert lane_groups(t, ends, b, b) == want
    got = c_lane_groups(t, ends, b)
    if got is None:  # a node the C walk does not read: a dict, or an int of 2**127 and up
        assert any(type(v) is not int or v >= 2**127 for v in map(nodes.get, ends, [0] * n))
    else:
        assert got == want


def test_c_walk_reads_fallback_keys_and_refuses_other_tables() -> None:
    b = 16
    ends = [b"a", b"b", 7]
    facts = [(j + 1) * b * 4 + 1 for j in range(3)]
    nodes = {b"a": (3 << SHIFT) | facts[0], b"b": (1 << SHIFT) | facts[1], 7: (1 << SHIFT) | 1}
    t = NodeTable(nodes)
    assert c_lane_groups(t, ends, b) == lane_groups(nodes, ends, b, b) == [(2, 1), (1, 3)]
    with pytest.raises(TypeError):
        c_lane_groups(nodes, ends, b)
    assert node_table.walk_groups(nodes, ends, b) is None
    assert FACTS == (1 << SHIFT) - 1


def test_the_index_picks_its_table_and_the_environment_forces_the_dict() -> None:
    assert type(KVIndex().nodes) is (NodeTable if node_table.use_c else dict)
    code = ("from connector.events.index import KVIndex; from connector.events import node_table;"
            "print(type(KVIndex().nodes).__name__, node_table.C_TABLE)")
    env = dict(os.environ, **{node_table.ENV: "1"})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__)))))
    assert out.stdout.split() == ["dict", "True"]
