"""Residency policy, TTL expiry, GPU-only clears and per-publisher block sizes in the index
itself (in-process, explicit clocks); the same over real ZMQ is tests/daemon/test_index_drift.py.
"""

from __future__ import annotations

import time

import pytest

from connector.daemon.config import load_config
from connector.daemon.service import residency_policy
from connector.events.classify import Classifier
from connector.events.index import GroupSizes, KVIndex, ResidencyPolicy
from connector.events.wire import AllBlocksCleared, BlockRemoved, BlockStored
from tests.support.events import apply, scan_entry_counts

pytestmark = pytest.mark.usefixtures("node_tables")  # the C node table and the dict

P = "engine#dp0"


def st(hashes: list[int], parent: int | None, size: int, medium: str = "GPU",
       ntok: int | None = None) -> BlockStored:
    n = size * len(hashes) if ntok is None else ntok
    return BlockStored(hashes, parent, [0] * n, size, None, medium, None, group_idx=0)


class Rig:
    def __init__(self, sizes: dict[int, int] | None = None,
                 policy: ResidencyPolicy | None = None) -> None:
        self.sizes = GroupSizes(sizes)
        self.idx = KVIndex(self.sizes, policy=policy)
        self.clf = Classifier(self.idx)

    def feed(self, *events: object, pub: str = P, now: float = 0.0) -> None:
        for e in events:
            run = self.clf.classify(pub, e)
            assert run is not None
            apply(self.idx, run, now)

    def refcount(self, medium: str, h: int, pub: str = P) -> int:
        return self.idx.refcount((pub, medium, 0, None), h)


@pytest.mark.parametrize("medium", ["CPU", "STORAGE"])
def test_tier_media_are_sets(medium: str) -> None:
    r = Rig({0: 16})
    r.feed(st([1, 2], None, 16, medium), st([1, 2], None, 16, medium), st([1], None, 16, medium))
    r.feed(BlockStored([9, 9], None, [], 0, None, medium, None))  # twice in one event
    assert r.refcount(medium, 1) == r.refcount(medium, 2) == r.refcount(medium, 9) == 1
    assert not r.idx.extra
    r.feed(BlockRemoved([1, 2, 9], medium, group_idx=0))
    assert r.idx.n_entries == 0 and r.idx.lookup([1, 2])[medium].tokens == 0


def test_gpu_is_refcounted_unless_the_publisher_reports_in_full_mode() -> None:
    r = Rig({0: 16}, ResidencyPolicy(by_source={"full": {"GPU", "CPU", "STORAGE"}}))
    for pub in (P, "full#dp0"):
        r.feed(st([1, 2], None, 16), st([1, 2], None, 16), pub=pub)
        r.feed(BlockRemoved([1, 2], "GPU", group_idx=0), pub=pub)
    assert r.idx.lookup([1, 2], publisher=P)["GPU"].tokens == 32  # two copies, one left
    assert r.idx.lookup([1, 2], publisher="full#dp0")["GPU"].tokens == 0


def test_store_reports_how_many_hashes_were_resident() -> None:
    r = Rig({0: 16})
    assert r.idx.store(r.clf.classify(P, st([1, 2], None, 16))) == 0
    assert r.idx.store(r.clf.classify(P, st([1, 2], None, 16))) == 2
    assert r.idx.store(r.clf.classify(P, st([2, 3], 1, 16))) == 1
    assert r.idx.store(r.clf.classify(P, st([3], 2, 16))) == 1


def test_all_blocks_cleared_drops_gpu_entries_only() -> None:
    r = Rig({0: 16})
    for m in ("GPU", "CPU", "STORAGE"):
        r.feed(st([1, 2], None, 16, m))
    r.feed(st([1, 2], None, 16), pub="other#dp0")
    r.feed(AllBlocksCleared())
    res = r.idx.lookup([1, 2], publisher=P)
    assert (res["GPU"].tokens, res["CPU"].tokens, res["STORAGE"].tokens) == (0, 32, 32)
    assert r.idx.lookup([1, 2], publisher="other#dp0")["GPU"].tokens == 32
    assert r.idx.entry_counts() == scan_entry_counts(r.idx)


def test_storage_ttl_expires_refreshes_and_forgets_removed_entries() -> None:
    r = Rig({0: 16}, ResidencyPolicy(ttl_s={"STORAGE": 10.0}))
    r.feed(st([1, 2], None, 16, "STORAGE"), st([1, 2], None, 16, "CPU"), now=100.0)
    r.feed(st([2], 1, 16, "STORAGE"), now=105.0)  # block 2 written again: TTL restarts
    assert r.idx.expire(109.999) == 0 and r.idx.n_entries == 4
    assert r.idx.expire(110.0) == 1  # block 1, at its TTL; block 2 re-queued for 115
    assert r.refcount("STORAGE", 1) == 0 and r.refcount("STORAGE", 2) == 1
    assert r.idx.lookup([1, 2])["STORAGE"].tokens == 0  # the prefix starts with block 1
    assert r.idx.expire(115.0) == 1 and r.idx.expired == 2
    assert r.idx.lookup([1, 2])["CPU"].tokens == 32  # no TTL there
    # A removed entry's queued expiry is dropped; a re-stored one gets a fresh TTL.
    r.feed(st([7], None, 16, "STORAGE"), now=200.0)
    r.feed(BlockRemoved([7], "STORAGE", group_idx=0))
    r.feed(st([7], None, 16, "STORAGE"), now=205.0)
    assert r.idx.expire(210.0) == 0 and r.refcount("STORAGE", 7) == 1
    assert r.idx.expire(215.0) == 1 and r.idx.n_entries == 2
    assert r.idx.entry_counts() == scan_entry_counts(r.idx)


def test_ttl_heap_stays_bounded_under_store_remove_churn() -> None:
    r = Rig({0: 16}, ResidencyPolicy(ttl_s={"STORAGE": 1e6}))
    for i in range(20_000):
        r.feed(st([5], None, 16, "STORAGE"), BlockRemoved([5], "STORAGE", group_idx=0),
               now=float(i))
    assert len(r.idx._heap) <= 2 * 1024 + 1
    assert r.idx.n_entries == 0


def test_lookup_walks_each_publisher_with_its_own_block_size() -> None:
    r = Rig()
    r.feed(st([101, 102], None, 32), pub="wide#dp0")  # learned first: block 32
    r.feed(st([1, 3], None, 16, ntok=48), pub=P)  # block 16, a masked block: no positions
    assert r.idx.lookup([1, 2, 3])["GPU"].tokens == 16  # not 32: hash 1 covers 16 tokens
    assert r.idx.lookup([1, 2, 3], publisher=P)["GPU"].tokens == 16
    assert r.idx.lookup([101, 102])["GPU"].tokens == 64
    assert r.idx.lookup([1, 2, 3], unit=16)["GPU"].tokens == 16
    with pytest.raises(ValueError, match="must divide the group's block size 16 or 32"):
        r.idx.lookup([1], unit=48)


def test_daemon_config_builds_the_policy() -> None:
    cfg = load_config(None, {"storage_ttl_s": 60, "publishers": [
        {"endpoint": "tcp://*:1", "name": "a"},
        {"endpoint": "tcp://*:2", "name": "b", "kv_cache_report_mode": "full"},
        {"endpoint": "tcp://*:3", "name": "c", "set_media": []}]})
    policy = residency_policy(cfg)
    assert policy.is_set(("a#dp0", "CPU", 0, None))
    assert not policy.is_set(("a#dp0", "GPU", 0, None))
    assert policy.is_set(("b#dp3", "GPU", 0, None))
    assert not policy.is_set(("c#dp0", "CPU", 0, None))
    assert policy.ttl(("c#dp0", "STORAGE", 0, None)) == 60
    assert policy.ttl(("a#dp0", "CPU", 0, None)) is None


def test_a_lookup_never_claims_an_entry_past_its_ttl() -> None:
    """No sweep has run (the ingest thread is not started): the look-up expires first. The
    TTL runs from the batch's own timestamp when it is earlier than the daemon's clock."""
    from connector.daemon.service import Daemon, LookupRequest
    from connector.events.wire import KVEventBatch, encode_batch

    cfg = load_config(None, {"storage_ttl_s": 10, "block_sizes": {0: 16},
                             "publishers": [{"endpoint": "tcp://127.0.0.1:9", "name": "e"}]})
    d = Daemon(cfg)
    try:
        written = time.time() - 11  # announced 11 s ago: past a 10 s TTL
        payload = encode_batch(KVEventBatch(written, [st([1, 2], None, 16, "STORAGE"),
                                                      st([1, 2], None, 16, "CPU")]))
        d.ingestor.ingest("e", 0, payload)
        assert d.ingestor.index.n_entries == 4
        res = d.lookup(LookupRequest({"block_hashes": [1, 2]}))
        assert res["STORAGE"]["tokens"] == 0 and res["CPU"]["tokens"] == 32
        assert d.ingestor.index.expired == 2
        fresh = encode_batch(KVEventBatch(time.time(), [st([3], None, 16, "STORAGE")]))
        d.ingestor.ingest("e", 0, fresh)
        assert d.lookup(LookupRequest({"block_hashes": [3]}))["STORAGE"]["tokens"] == 16
    finally:
        d.stop()
