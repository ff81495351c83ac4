"""The index must not drift from what the tiers hold (issue 10, items 6-9).

Real sockets throughout: vLLM's own ``ZmqEventPublisher`` -> a real ``kvtier daemon``
process; the events are the shapes vLLM 0.32 and kvtier's connector emit.

* 6: kvtier's CPU tier and Redis hold one value per key, however often it is written:
  repeated ``BlockStored`` on CPU/STORAGE is one entry, one ``BlockRemoved`` removes it;
  Redis TTL expiry (never announced) is mirrored by ``storage_ttl_s``.
* 7: ``kv_cache_report_mode="full"`` re-announces reused GPU blocks with no removal
  (``BlockPool.emit_cached_block_events``): detected and counted; handled when configured.
* 8: ``AllBlocksCleared`` (GPU prefix-cache reset) clears that publisher's GPU entries only.
* 9: a look-up without ``publisher`` walks each publisher with its own block size.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from rigs.daemon_proc import DaemonProcess
from rigs.ports import free_port
from tests.daemon.test_daemon_zmq import Rig, kv_events, removed, stored

pytestmark = pytest.mark.usefixtures("node_tables")  # the C node table and the dict

B = 16


def entries(d: DaemonProcess, hashes: list[int], group: int = 0) -> list[dict[str, Any]]:
    status, body = d.post("/entries", {"block_hashes": hashes, "group_idx": group})
    assert status == 200, body
    return body["entries"]


def publisher_stats(s: dict[str, Any]) -> dict[str, Any]:
    (pub,) = s["publishers"].values()
    return pub


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig().start()
    yield r
    r.close()


# -- 6: CPU and STORAGE are sets ------------------------------------------------------------


def test_tier_media_are_sets_one_removal_removes_the_entry(rig: Rig) -> None:
    d = rig.daemon
    for medium in ("CPU", "STORAGE"):
        # kvtier re-writes the same keys (a second save of a prefix, a re-promotion from
        # Redis): three announcements of block 1, two of block 2, all of one value each.
        rig.publish(stored([1, 2], None, medium=medium))
        rig.publish(stored([1, 2], None, medium=medium))
        rig.publish(stored([1], None, medium=medium))
    rig.settle()
    got = entries(d, [1, 2])
    assert sorted((e["medium"], e["block_hash"], e["refcount"]) for e in got) == [
        ("CPU", 1, 1), ("CPU", 2, 1), ("STORAGE", 1, 1), ("STORAGE", 2, 1)]
    res = d.lookup([1, 2])
    assert res["CPU"]["tokens"] == res["STORAGE"]["tokens"] == 2 * B

    # One eviction from the CPU tier, one UNLINK from Redis: gone, whatever was announced.
    rig.publish(removed([1, 2], medium="CPU"), removed([1, 2], medium="STORAGE"))
    s = rig.settle()
    res = d.lookup([1, 2])
    assert res["CPU"]["tokens"] == res["STORAGE"]["tokens"] == res["any"]["tokens"] == 0
    assert s["index"]["entries"] == 0 and entries(d, [1, 2]) == []

    # GPU stays reference-counted: vLLM can hold two physical blocks with one hash.
    rig.publish(stored([1, 2], None), stored([1, 2], None), removed([1, 2]))
    rig.settle()
    assert d.lookup([1, 2])["GPU"]["tokens"] == 2 * B


def test_set_media_empty_keeps_refcounts_for_vllms_offloading_connector() -> None:
    """vLLM's OffloadingConnector re-announces shared hashes once per chunk and expects
    refcounts: ``set_media: []`` gives them back (the default can only under-claim there)."""
    r = Rig(publisher_keys={"set_media": []}).start()
    try:
        r.publish(stored([1, 2], None, medium="CPU"), stored([2], 1, medium="CPU"))
        r.publish(removed([2], medium="CPU"))
        r.settle()
        assert [e["refcount"] for e in entries(r.daemon, [1, 2])] == [1, 1]
        assert r.daemon.lookup([1, 2])["CPU"]["tokens"] == 2 * B
    finally:
        r.close()


def test_storage_entries_expire_after_storage_ttl() -> None:
    """Redis drops a value at its TTL and announces nothing: with ``storage_ttl_s`` the
    daemon drops the STORAGE entry then too (CPU entries have no TTL)."""
    r = Rig(daemon_args=("--storage-ttl", "1.5")).start()
    try:
        d = r.daemon
        t0 = time.time()
        r.publish(stored([1, 2], None, medium="STORAGE"), stored([1, 2], None, medium="CPU"))
        s = r.daemon.wait_for(lambda s: s["index"]["expired"] == 2, what="expiry")
        assert time.time() - t0 >= 1.5  # not before the TTL
        assert s["index"]["entries"] == 2  # the CPU pair
        res = d.lookup([1, 2])
        assert res["STORAGE"]["tokens"] == 0 and res["CPU"]["tokens"] == 2 * B
        assert 'kvtier_daemon_hashes_total{op="expired"} 2.0' in d.get("/metrics")
    finally:
        r.close()


# -- 7: kv_cache_report_mode="full" ----------------------------------------------------------


def _full_mode_stream(rig: Rig) -> None:
    """What vLLM 0.32 publishes for one prompt of 3 blocks under ``kv_cache_report_mode=
    "full"``: ``cache_full_blocks`` stores it; a second request reusing it makes
    ``emit_cached_block_events`` announce the same blocks again (parent None, from block
    0); eviction later removes each block once."""
    rig.publish(stored([1, 2, 3], None))
    rig.publish(stored([1, 2, 3], None))  # reuse, re-announced, no removal will match
    rig.publish(removed([3]), removed([2]), removed([1]))  # evicted (tail first)
    rig.settle()


def test_full_report_mode_is_detected_and_counted(rig: Rig) -> None:
    _full_mode_stream(rig)
    s = rig.daemon.stats()
    assert publisher_stats(s)["reannounced_events"] == 1
    assert "kvtier_daemon_reannounced_events_total" in rig.daemon.get("/metrics")
    # Configured incremental, the index keeps the re-announcement's count (documented):
    assert rig.daemon.lookup([1, 2, 3])["GPU"]["tokens"] == 3 * B


def test_full_report_mode_configured_leaves_nothing_after_eviction() -> None:
    r = Rig(daemon_args=("--kv-cache-report-mode", "full")).start()
    try:
        _full_mode_stream(r)
        s = r.daemon.stats()
        assert r.daemon.lookup([1, 2, 3])["GPU"]["tokens"] == 0
        assert s["index"]["entries"] == 0
        # A repeat is not a second copy, but the blocks are still cached until removed.
        r.publish(stored([1, 2], None), stored([1, 2], None))
        r.settle()
        assert [e["refcount"] for e in entries(r.daemon, [1, 2])] == [1, 1]
        assert r.daemon.lookup([1, 2])["GPU"]["tokens"] == 2 * B
    finally:
        r.close()


# -- 8: AllBlocksCleared is a GPU event --------------------------------------------------------


def test_all_blocks_cleared_drops_only_gpu_entries_of_that_publisher(rig: Rig) -> None:
    d = rig.daemon
    rig.publish(stored([1, 2], None), stored([1, 2], None, medium="CPU"),
                stored([1, 2], None, medium="STORAGE"))
    rig.settle()
    rig.publish(kv_events.AllBlocksCleared())  # reset_prefix_cache() on the engine
    s = rig.settle()
    res = d.lookup([1, 2])
    assert res["GPU"]["tokens"] == 0
    assert res["CPU"]["tokens"] == res["STORAGE"]["tokens"] == res["any"]["tokens"] == 2 * B
    assert s["index"]["entries"] == 4
    assert s["index"]["by_medium_kind"] == {"CPU/FULL": 2, "STORAGE/FULL": 2}


# -- 9: per-publisher block sizes ----------------------------------------------------------


class TwoEngines:
    """Two vLLM publishers (different block sizes) into one daemon."""

    def __init__(self) -> None:
        ports = [(free_port(), free_port()) for _ in range(2)]
        self.names = ("engine-32", "engine-16")
        args = []
        for p, rp in ports:
            args += ["--endpoint", f"tcp://*:{p},tcp://*:{rp}"]
        self.pubs = [kv_events.ZmqEventPublisher(
            data_parallel_rank=0, endpoint=f"tcp://*:{p}", replay_endpoint=f"tcp://*:{rp}")
            for p, rp in ports]
        self.ids = [f"tcp://*:{p}#dp0" for p, _ in ports]
        self.daemon = DaemonProcess(*args, "--no-replay-on-start").start()
        self.seqs = [0, 0]

    def publish(self, i: int, *events: Any) -> None:
        self.pubs[i].publish(kv_events.KVEventBatch(ts=time.time(), events=list(events)))
        self.seqs[i] += 1
        self.daemon.wait_for(lambda s: s["sources"][i]["next_seq"] == self.seqs[i]
                             and not s["sources"][i]["replaying"], what=f"engine {i}")

    def close(self) -> None:
        for p in self.pubs:
            p.shutdown()
        self.daemon.kill()


def test_lookup_without_publisher_uses_each_publishers_block_size() -> None:
    e = TwoEngines()
    try:
        d = e.daemon
        # Engine 0 (block 32) is learned first.
        e.publish(0, stored([101, 102], None, block_size=32))
        # Engine 1 (block 16; a sliding-window-like group skips a masked block, so the
        # announced positions are unknown): block 0 is hash 1, block 2 is hash 3.
        e.publish(1, stored([1, 3], None, block_size=16, ntok=48))
        s = d.stats()
        assert s["index"]["block_sizes"] == {f"{e.ids[0]}/0": 32, f"{e.ids[1]}/0": 16}
        # Hash 1 covers 16 tokens; walked with the other engine's 32 it would claim 32.
        assert d.lookup([1, 2, 3], publisher=e.ids[1])["GPU"] == {
            "tokens": 16, "full_blocks": 1, "partial": False}
        assert d.lookup([1, 2, 3])["GPU"] == {"tokens": 16, "full_blocks": 1,
                                              "partial": False}
        assert d.lookup([101, 102])["GPU"] == {"tokens": 64, "full_blocks": 2,
                                               "partial": False}
        # A unit that fits only one engine answers for that one; one that fits none is a 400.
        assert d.lookup([1, 2, 3], hash_block_size=16)["GPU"]["tokens"] == 16
        status, body = d.post("/lookup", {"block_hashes": [1], "hash_block_size": 48})
        assert status == 400 and "must divide" in body["error"]
    finally:
        e.close()
