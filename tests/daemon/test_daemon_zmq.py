"""vLLM's own ZmqEventPublisher -> a real ``kvtier daemon`` process over loopback ZMQ."""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from rigs.daemon_proc import DaemonProcess
from rigs.ports import free_port
from tests.daemon.vllm_required import import_vllm

kv_events = import_vllm("vllm.distributed.kv_events")

B = 16  # physical block size of group 0 in these tests


def stored(hashes: list[int], parent: int | None, *, block_size: int = B, medium: str = "GPU",
           group: int = 0, ntok: int | None = None, **kw: Any) -> Any:
    n = block_size * len(hashes) if ntok is None else ntok
    return kv_events.BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                 token_ids=list(range(n)), block_size=block_size, lora_id=None,
                                 medium=medium, lora_name=None, group_idx=group, **kw)


def removed(hashes: list[int], medium: str = "GPU", group: int = 0) -> Any:
    return kv_events.BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group)


class DroppingSocket:
    """Wraps vLLM's PUB socket and drops the sends of chosen sequence numbers (a real gap:
    the batch is still in the publisher's replay buffer); ``wait_sent(seq)`` waits until
    vLLM's publisher thread is done with the send of ``seq`` (sent or dropped)."""

    def __init__(self, sock: Any, drop: set[int]) -> None:
        self._sock = sock
        self.drop = drop
        self._done: set[int] = set()
        self._cond = threading.Condition()

    def send_multipart(self, frames: Any, *a: Any, **kw: Any) -> Any:
        if len(frames) < 3:  # not a batch (a test's handshake probe)
            return self._sock.send_multipart(frames, *a, **kw)
        seq = int.from_bytes(frames[1], "big")
        try:
            if seq in self.drop:
                return None
            return self._sock.send_multipart(frames, *a, **kw)
        finally:
            with self._cond:
                self._done.add(seq)
                self._cond.notify_all()

    def wait_sent(self, seq: int, timeout: float = 60.0) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: seq in self._done, timeout), \
                f"vLLM's publisher never sent batch {seq}"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def wait_subscribed(pub: Any, daemon: DaemonProcess, source: int = 0,
                    timeout: float = 20.0) -> None:
    """Readiness handshake for a stream without replay: a PUB drops what it sends before the
    SUB's subscription reaches it, so send one-frame probes on vLLM's own PUB socket until
    the daemon has received one (it counts them as malformed frames; sequence state, and so
    every gap/replay counter, is untouched). Call before the first ``publish`` (vLLM's
    publisher thread has not used the socket yet, and ``publish``'s queue hand-off orders
    our sends before its own), or once that thread is done with its last send
    (``DroppingSocket.wait_sent``): a ZMQ socket is never used by two threads at once."""
    deadline = time.monotonic() + timeout
    base = daemon.source(source)["received"]
    while time.monotonic() < deadline:
        pub._pub.send_multipart([b"kvtier-test-handshake"])
        try:
            daemon.wait_for(lambda s: s["sources"][source]["received"] > base, timeout=0.2,
                            what="handshake probe")
            return
        except AssertionError:
            continue
    raise AssertionError(f"the daemon's SUB never received a probe from {pub._endpoint} "
                         f"within {timeout} s")


class Rig:
    def __init__(self, replay: bool = True, bind_side: str = "vllm",
                 daemon_args: tuple[str, ...] = (),
                 publisher_keys: dict[str, Any] | None = None) -> None:
        """``publisher_keys``: more keys of the publisher's config entry (then the daemon
        gets a config file instead of ``--endpoint``)."""
        self.pub_port, self.replay_port = free_port(), free_port()
        if bind_side == "vllm":  # vLLM binds ('*'), the daemon connects
            vllm_ep = f"tcp://*:{self.pub_port}"
        else:  # vLLM connects, the daemon binds
            vllm_ep = f"tcp://127.0.0.1:{self.pub_port}"
        replay_ep = f"tcp://*:{self.replay_port}"
        self._config: str | None = None
        if publisher_keys is None:
            spec = vllm_ep + (f",{replay_ep}" if replay else "")
            source = ("--endpoint", spec)
        else:
            entry = {"endpoint": vllm_ep, **({"replay_endpoint": replay_ep} if replay else {}),
                     **publisher_keys}
            fd, path = tempfile.mkstemp(prefix="kvtier-daemon-", suffix=".yaml")
            with os.fdopen(fd, "w") as fh:
                json.dump({"publishers": [entry]}, fh)  # JSON is YAML
            source = ("--config", path)
            self._config = path
        self.daemon = DaemonProcess(*source, "--no-replay-on-start",
                                    "--replay-timeout", "3", *daemon_args)
        self.vllm_ep = vllm_ep
        self.replay = replay
        self.pub: Any = None
        self.seq = 0

    def start(self) -> Rig:
        if self.vllm_ep.startswith("tcp://*"):
            self.pub = self._publisher()
            self.daemon.start()
        else:
            self.daemon.start()
            self.pub = self._publisher()
        return self

    def _publisher(self) -> Any:
        return kv_events.ZmqEventPublisher(
            data_parallel_rank=0, endpoint=self.vllm_ep,
            replay_endpoint=f"tcp://*:{self.replay_port}" if self.replay else None)

    def publish(self, *events: Any) -> int:
        self.pub.publish(kv_events.KVEventBatch(ts=time.time(), events=list(events)))
        self.seq += 1
        return self.seq

    def settle(self) -> dict[str, Any]:
        """Wait until every published batch is applied (directly or by replay)."""
        return self.daemon.wait_for(
            lambda s: s["sources"][0]["next_seq"] == self.seq and not s["sources"][0]["replaying"],
            what=f"next_seq == {self.seq}")

    def close(self) -> None:
        if self.pub is not None:
            self.pub.shutdown()
        self.daemon.kill()
        if self._config is not None:
            os.unlink(self._config)


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig().start()
    yield r
    r.close()


def test_store_remove_promote_clear_over_real_zmq(rig: Rig) -> None:
    d = rig.daemon
    # Two full blocks, then a third chained on them; a repeat announcement of block 0.
    rig.publish(stored([11, 12], None))
    rig.publish(stored([13], 12), stored([11], None))
    rig.settle()
    assert d.lookup([11, 12, 13])["GPU"] == {"tokens": 48, "full_blocks": 3, "partial": False}
    assert d.lookup([11, 12, 13])["CPU"]["tokens"] == 0

    # Removing block 0 once leaves it resident (announced twice); a second removal drops it.
    rig.publish(removed([11]))
    rig.settle()
    assert d.lookup([11, 12, 13])["GPU"]["tokens"] == 48
    rig.publish(removed([11]))
    rig.settle()
    assert d.lookup([11, 12, 13])["GPU"]["tokens"] == 0
    rig.publish(stored([11], None))

    # A partial entry of 8 tokens (hash unit 8) inside block 3, then promotion to full.
    rig.publish(stored([141], 13, block_size=8))
    s = rig.settle()
    fine = [1011, 11, 1012, 12, 1013, 13, 141, 142]  # unit-8 chain (odd hashes unknown)
    assert d.lookup(fine, hash_block_size=8)["GPU"] == {
        "tokens": 56, "full_blocks": 3, "partial": True}
    assert d.lookup([11, 12, 13, 14])["GPU"] == {"tokens": 48, "full_blocks": 3,
                                                 "partial": False}
    assert s["index"]["by_medium_kind"]["GPU/PARTIAL"] == 1
    rig.publish(removed([141]), stored([142], 13))
    rig.settle()
    assert d.lookup(fine, hash_block_size=8)["GPU"] == {
        "tokens": 64, "full_blocks": 4, "partial": False}
    assert d.lookup([11, 12, 13, 142])["GPU"]["tokens"] == 64

    # Offloaded copy on CPU (LMCache spells it 'cpu'); 'any' combines.
    rig.publish(stored([11, 12], None, medium="cpu"))
    rig.settle()
    res = d.lookup([11, 12, 13, 142])
    assert res["CPU"]["tokens"] == 32 and res["any"]["tokens"] == 64

    # reset_prefix_cache(): the GPU block pool is emptied; the offloaded CPU copy stays.
    rig.publish(kv_events.AllBlocksCleared())
    s = rig.settle()
    res = d.lookup([11, 12, 13, 142])
    assert res["GPU"]["tokens"] == 0 and res["STORAGE"]["tokens"] == 0
    assert res["CPU"]["tokens"] == res["any"]["tokens"] == 32
    assert s["index"]["entries"] == 2
    metrics = d.get("/metrics")
    assert 'kvtier_daemon_events_total{publisher="tcp://*:' in metrics
    assert "kvtier_daemon_gaps_total" in metrics


def test_forced_gap_is_repaired_by_replay(rig: Rig) -> None:
    d = rig.daemon
    rig.publish(stored([1, 2], None))
    rig.settle()
    before = d.source()
    rig.pub._pub = DroppingSocket(rig.pub._pub, drop={rig.seq, rig.seq + 1})
    rig.publish(stored([3], 2))  # dropped on the PUB socket, kept in the replay buffer
    rig.publish(stored([4], 3))  # dropped too
    rig.publish(stored([5], 4))  # arrives: the daemon sees the gap and replays both
    s = rig.settle()
    src = s["sources"][0]
    assert src["gaps"] == before["gaps"] + 1
    assert src["repaired_batches"] >= before["repaired_batches"] + 2
    assert src["missing_batches"] == before["missing_batches"]
    assert d.lookup([1, 2, 3, 4, 5])["GPU"]["tokens"] == 5 * B


def test_gap_without_replay_is_counted_unrepaired() -> None:
    r = Rig(replay=False).start()
    try:
        d = r.daemon
        wait_subscribed(r.pub, d)  # no replay here: a batch sent before the SUB is ready is lost
        r.publish(stored([1, 2], None))
        r.daemon.wait_for(lambda s: s["sources"][0]["next_seq"] == 1, what="first batch")
        r.pub._pub = DroppingSocket(r.pub._pub, drop={r.seq})
        r.publish(stored([3], 2))
        r.publish(stored([4], 3))
        s = r.settle()
        assert s["sources"][0]["missing_batches"] == 1
        assert s["sources"][0]["gaps"] == 1
        # Block 3 was lost: the prefix stops before it and never claims it.
        assert d.lookup([1, 2, 3, 4])["GPU"]["tokens"] == 2 * B
    finally:
        r.close()


def test_vllm_connects_daemon_binds_and_first_message_loss_is_replayed() -> None:
    r = Rig(bind_side="daemon").start()
    try:
        sent = r.pub._pub = DroppingSocket(r.pub._pub, drop=set())
        r.publish(stored([21, 22], None))  # may be lost by the connecting PUB: replay fixes it
        sent.wait_sent(0)  # vLLM's thread is done with its socket: the probes may use it
        wait_subscribed(r.pub, r.daemon)  # the next batch reaches the daemon ...
        r.publish(stored([23], 22))  # ... which sees seq 1 first (or after 0) and replays 0
        s = r.settle()
        assert s["sources"][0]["binds"] is True
        assert r.daemon.lookup([21, 22, 23])["GPU"]["tokens"] == 3 * B
    finally:
        r.close()


def test_sigterm_shuts_down_cleanly(rig: Rig) -> None:
    rig.publish(stored([1], None))
    rig.settle()
    assert rig.daemon.terminate() == 0


def test_data_parallel_ranks_are_separate_publishers() -> None:
    import socket

    while True:  # a port P with P+1 free too (vLLM offsets rank r to P+r)
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                break
            except OSError:
                continue
    d = DaemonProcess("--endpoint", f"tcp://*:{port}", "--dp-size", "2",
                      "--no-replay-on-start").start()
    pubs = [kv_events.ZmqEventPublisher(data_parallel_rank=r, endpoint=f"tcp://*:{port}")
            for r in (0, 1)]
    try:
        for rank, p in enumerate(pubs):  # no replay socket in this test: both SUBs ready first
            wait_subscribed(p, d, source=rank)
        # Rank 1's single-hash store arrives first: its kind is undecidable until rank 0's
        # two-hash store teaches the group's block size, which then resolves rank 1's too.
        pubs[1].publish(kv_events.KVEventBatch(ts=time.time(), events=[stored([1], None)]))
        d.wait_for(lambda s: sum(x["applied"] for x in s["sources"]) == 1, what="rank 1")
        pubs[0].publish(kv_events.KVEventBatch(ts=time.time(), events=[stored([1, 2], None)]))
        s = d.wait_for(lambda s: sum(x["applied"] for x in s["sources"]) == 2, what="both")
        assert [x["endpoint"] for x in s["sources"]] == [f"tcp://*:{port}",
                                                         f"tcp://*:{port + 1}"]
        assert set(s["publishers"]) == {f"tcp://*:{port}#dp0", f"tcp://*:{port}#dp1"}
        one = d.lookup([1, 2], publisher=f"tcp://*:{port}#dp1")
        assert one["GPU"]["tokens"] == B
        assert d.lookup([1, 2])["GPU"]["tokens"] == 2 * B
    finally:
        for p in pubs:
            p.shutdown()
        d.kill()
