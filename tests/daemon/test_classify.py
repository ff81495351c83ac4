"""Classifier and index edge cases (pure logic; the real-stream tests are elsewhere)."""

from __future__ import annotations

import pytest

from connector.events.classify import Classifier
from connector.events.index import GroupSizes, KVIndex, unpack
from connector.events.wire import AllBlocksCleared, BlockRemoved, BlockStored
from offload_tiers.keys import BlockKind
from tests.support.events import Entry, apply, entries
from tests.support.events import facts as read_facts

pytestmark = pytest.mark.usefixtures("node_tables")  # the C node table and the dict

FULL, PARTIAL, PLACEHOLDER = BlockKind.FULL, BlockKind.PARTIAL, BlockKind.PLACEHOLDER

P = "pub#dp0"


def st(hashes, parent, size, ntok=None, medium="GPU", group=0, own=None):
    n = size * len(hashes) if ntok is None else ntok
    return BlockStored(hashes, parent, [0] * n, size, None, medium, None, group_idx=group,
                       ownership=own)


class Facts:
    """Reads back what the index recorded for a hash (any medium) of one publisher."""

    def __init__(self, idx: KVIndex, sizes: GroupSizes) -> None:
        self.idx, self.sizes = idx, sizes

    def block_size(self, pg):
        return self.sizes.block_size(pg)

    def lookup(self, pg, h):
        for key in self.idx.by_pg.get(pg, ()):
            f = read_facts(self.idx, key, h)
            if f is not None:
                return unpack(f)
        return None, None


def rig(sizes=None):
    gs = GroupSizes(sizes)
    idx = KVIndex(gs)
    return Classifier(idx), idx, Facts(idx, gs)


def feed(c, idx, *events, pub=P):
    runs = []
    for e in events:
        run = c.classify(pub, e)
        if run is not None:
            apply(idx, run)
        runs.append(run)
    return runs


def test_full_chunk_learns_block_size_and_cumulative_num_tokens() -> None:
    c, idx, facts = rig()
    (run,) = feed(c, idx, st([1, 2, 3], None, 16))
    assert facts.block_size((P, 0)) == 16
    assert list(entries(run)) == [
        Entry(P, "GPU", 0, 1, None, 16, BlockKind.FULL, None),
        Entry(P, "GPU", 0, 2, 1, 32, BlockKind.FULL, None),
        Entry(P, "GPU", 0, 3, 2, 48, BlockKind.FULL, None),
    ]
    (run,) = feed(c, idx, st([4], 3, 16))
    assert [e.num_tokens for e in entries(run)] == [64]


def test_single_hash_is_pending_until_block_size_known_then_resolved() -> None:
    c, idx, facts = rig()
    (run,) = feed(c, idx, st([7], None, 32))
    assert run.kind is None  # PENDING
    assert idx.lookup([7])["GPU"].tokens == 0  # unknown size: never counted
    feed(c, idx, st([8], None, 16))  # a second single size: the larger is the block size
    assert facts.block_size((P, 0)) == 32
    assert facts.lookup((P, 0), 7) == (32, FULL)
    assert facts.lookup((P, 0), 8) == (16, PARTIAL)
    assert idx.lookup([7])["GPU"].tokens == 32


def test_partial_kind_and_num_tokens_from_parent_never_from_hash_presence() -> None:
    c, idx, facts = rig({0: 64})
    feed(c, idx, st([1], None, 64))
    (run,) = feed(c, idx, st([2], 1, 32))  # 96 tokens: ends inside block 1
    assert (run.kind, run.first_tokens) == (PARTIAL, 96)
    assert facts.lookup((P, 0), 2) == (96, PARTIAL)
    (run,) = feed(c, idx, st([3], 99, 32))  # parent never seen: shape says partial
    assert run.kind == PARTIAL and next(entries(run)).num_tokens is None


def test_partial_shaped_announcement_on_a_block_boundary_is_full() -> None:
    c, idx, facts = rig({0: 64})
    feed(c, idx, st([10], None, 32))  # 32 tokens: partial
    (run,) = feed(c, idx, st([11], 10, 32))  # 64 tokens (Mamba checkpoint on a boundary)
    assert (run.kind, run.first_tokens) == (FULL, 64)


def test_out_of_order_child_gets_position_when_parent_arrives() -> None:
    c, idx, facts = rig({0: 16})
    feed(c, idx, st([3, 4], 2, 16))  # child first: positions unknown, shape full
    assert facts.lookup((P, 0), 4) == (None, FULL)
    feed(c, idx, st([1, 2], None, 16))
    assert facts.lookup((P, 0), 3) == (48, FULL)
    assert facts.lookup((P, 0), 4) == (64, FULL)
    assert idx.lookup([1, 2, 3, 4])["GPU"].tokens == 64


def test_placeholder_never_counts() -> None:
    c, idx, facts = rig({0: 16})
    (run,) = feed(c, idx, BlockStored([5], None, [], 0, None, "CPU", None, group_idx=0))
    assert run.kind == PLACEHOLDER
    assert idx.lookup([5])["CPU"].tokens == 0
    assert idx.entry_counts() == {("CPU", "PLACEHOLDER"): 1}


def test_repeats_refcount_per_residency_key_and_unknown_removal_is_harmless() -> None:
    c, idx, _ = rig({0: 16})
    feed(c, idx, st([1], None, 16), st([1], None, 16), st([1], None, 16, own="tierB"))
    feed(c, idx, BlockRemoved([1], "GPU", group_idx=0))
    assert idx.lookup([1])["GPU"].tokens == 16
    feed(c, idx, BlockRemoved([1], "GPU", group_idx=0))
    assert idx.lookup([1])["GPU"].tokens == 16  # still owned by tierB
    feed(c, idx, BlockRemoved([1], "GPU", group_idx=0, ownership="tierB"))
    assert idx.lookup([1])["GPU"].tokens == 0
    feed(c, idx, BlockRemoved([42], "GPU", group_idx=0))
    assert idx.unknown_removals == 1 and idx.n_entries == 0


def test_clear_drops_only_that_publisher() -> None:
    c, idx, _ = rig({0: 16})
    feed(c, idx, st([1], None, 16))
    feed(c, idx, st([1], None, 16), pub="other#dp0")
    feed(c, idx, AllBlocksCleared())
    assert idx.lookup([1])["GPU"].tokens == 16
    assert idx.lookup([1], publisher=P)["GPU"].tokens == 0


@pytest.mark.parametrize("event", [
    st([1, 2], None, 16, ntok=16),  # fewer token ids than blocks need
    BlockStored([], None, [], 16, None, "GPU", None),  # no hashes
    BlockStored([1], None, [0] * 16, -16, None, "GPU", None),  # negative size
    BlockRemoved([], "GPU"),
])
def test_invalid_events_are_counted_and_skipped(event) -> None:
    c, idx, _ = rig({0: 16})
    assert c.classify(P, event) is None
    assert c.invalid_events == 1


def test_size_conflicting_with_configuration_is_never_counted() -> None:
    c, idx, _ = rig({0: 16})
    (run,) = feed(c, idx, st([1, 2], None, 32))
    assert run.kind is None and c.conflicts == 1  # PENDING
    assert idx.lookup([1, 2])["GPU"].tokens == 0


def test_capacity_bound_drops_and_never_overclaims() -> None:
    c, idx, _ = rig({0: 16})
    idx.max_entries = 3
    feed(c, idx, st([1, 2, 3, 4, 5], None, 16))
    assert idx.n_entries == 3 and idx.dropped_capacity == 2
    assert idx.lookup([1, 2, 3, 4, 5])["GPU"].tokens == 48


def test_memory_stays_bounded_under_churn() -> None:
    c, idx, _ = rig({0: 16})
    for i in range(0, 200_000, 50):
        hashes = list(range(i + 1, i + 51))
        feed(c, idx, st(hashes, i or None, 16), BlockRemoved(hashes, "GPU", group_idx=0))
    assert idx.n_entries == 0
    assert sum(map(len, idx.res.values())) == 0 and not idx.extra
    assert sum(map(len, c.orphans.values())) <= c.max_pending


def test_lookup_rejects_unit_that_does_not_divide_block_size() -> None:
    c, idx, _ = rig({0: 64})
    feed(c, idx, st([1], None, 64))
    with pytest.raises(ValueError, match="must divide"):
        idx.lookup([1], unit=48)


def test_array_form_batch_ingests_as_the_map_form() -> None:
    import msgspec

    from connector.daemon.ingest import Ingestor
    from connector.events.wire import KVEventBatch, encode_batch

    events = [st([1, 2], None, 16), st([3], 2, 8, medium="cpu"), BlockRemoved([1], "GPU"),
              AllBlocksCleared()]
    as_map = encode_batch(KVEventBatch(1.0, events))
    as_array = msgspec.msgpack.encode([1.0, [
        [type(e).__name__, *(getattr(e, f) for f in e.__struct_fields__)] for e in events]])
    ingested = []
    for payload in (as_map, as_array):
        ing = Ingestor({0: 16})
        ing.ingest("src", 0, payload, now=2.0)
        ingested.append((ing.index.res, vars(ing.publishers["src#dp0"])))
    assert ingested[0] == ingested[1]
    assert ingested[0][0] == {("src#dp0", "CPU", 0, None): {3: 40 * 4 + PARTIAL}}
