"""Fuzz a real daemon process through its real ZMQ socket: random and mutated msgpack,
wrong frame layouts, duplicate / reordered / gapped sequence numbers. The daemon must stay
up, count every bad message, keep its index bounded and still answer correctly after."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connector.events import wire as ev
from rigs.daemon_proc import DaemonProcess
from rigs.ports import free_port

MAX_ENTRIES = 5000


class Feeder:
    """The test's own PUB socket, connected to the daemon's bound SUB."""

    def __init__(self) -> None:
        self.port = free_port()
        self.daemon = DaemonProcess("--endpoint", f"tcp://127.0.0.1:{self.port}",
                                    "--no-replay-on-start", "--max-entries", str(MAX_ENTRIES),
                                    "--block-size", "0=16")
        self.daemon.start()
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.connect(f"tcp://127.0.0.1:{self.port}")
        self.sent = 0
        self.seq = 0
        # A connecting PUB drops messages until the subscription arrives: warm up.
        deadline = time.monotonic() + 20
        while self.daemon.source()["received"] == 0:
            assert time.monotonic() < deadline, "daemon never received a message"
            self.send([b"", (10**9).to_bytes(8, "big"), b"warm-up"])
            time.sleep(0.05)
        self.sent = self.daemon.source()["received"]

    def send(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)
        self.sent += 1

    def batch(self, events: list[Any]) -> bytes:
        return ev.encode_batch(ev.KVEventBatch(ts=time.time(), events=events))

    def wait_received(self) -> dict[str, Any]:
        return self.daemon.wait_for(lambda s: s["sources"][0]["received"] >= self.sent,
                                    what=f"received == {self.sent}")

    def close(self) -> None:
        self.pub.close(linger=0)
        self.ctx.term()
        self.daemon.kill()


@pytest.fixture(scope="module")
def feeder(node_tables_module: str) -> Iterator[Feeder]:
    """A daemon fed over ZMQ, once with each node table (its environment picks it)."""
    f = Feeder()
    yield f
    f.close()


def _valid_events() -> st.SearchStrategy[list[Any]]:
    hashes = st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=8)
    stored = st.builds(
        lambda hs, parent, size, medium, group: ev.BlockStored(
            hs, parent, [1] * (size * len(hs)), size, None, medium, None, group_idx=group),
        hashes, st.none() | st.integers(0, 2**64 - 1), st.sampled_from([0, 8, 16]),
        st.sampled_from(["GPU", "cpu", "STORAGE", None, "weird"]), st.integers(0, 3))
    removed = st.builds(lambda hs, m: ev.BlockRemoved(hs, m), hashes,
                        st.sampled_from(["GPU", "CPU", None]))
    return st.lists(stored | removed | st.just(ev.AllBlocksCleared()), max_size=6)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=30)


def _mutate(data: bytes, draw: Any) -> bytes:
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete"]))
        if not buf:
            break
        i = draw(st.integers(0, len(buf) - 1))
        if op == "flip":
            buf[i] ^= draw(st.integers(1, 255))
        elif op == "truncate":
            del buf[i:]
        elif op == "insert":
            buf[i:i] = draw(st.binary(min_size=1, max_size=8))
        else:
            del buf[i]
    return bytes(buf)


@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_messages_never_crash_and_are_counted(feeder: Feeder, data: Any) -> None:
    kind = data.draw(st.sampled_from(["random", "msgpack", "mutated", "valid", "frames"]))
    seq_kind = data.draw(st.sampled_from(["next", "dup", "old", "jump", "zero"]))
    seq = {"next": feeder.seq, "dup": max(feeder.seq - 1, 0), "old": feeder.seq // 2,
           "jump": feeder.seq + data.draw(st.integers(2, 50)), "zero": 0}[seq_kind]
    if kind == "random":
        payload = data.draw(st.binary(max_size=300))
    elif kind == "msgpack":
        payload = msgspec.msgpack.encode(data.draw(msgpack_values))
    elif kind == "mutated":
        payload = _mutate(feeder.batch(data.draw(_valid_events())), data.draw)
    else:
        payload = feeder.batch(data.draw(_valid_events()))
    if kind == "frames":
        frames = data.draw(st.lists(st.binary(max_size=12), max_size=5)
                           .filter(lambda f: len(f) != 3 or len(f[1]) != 8))
        if not frames:
            frames = [b""]
    else:
        frames = [b"", seq.to_bytes(8, "big"), payload]
    feeder.send(frames)
    if kind != "frames" and seq >= feeder.seq:
        feeder.seq = seq + 1
    elif kind != "frames" and seq == 0:
        feeder.seq = 1


def test_daemon_survived_counted_everything_and_still_works(feeder: Feeder) -> None:
    """Runs alone too: it sends its own bad messages (one of each kind it counts) on top of
    whatever the fuzz test sent before it."""
    base = 2**40  # past any seq the fuzz test or the warm-up used
    # A marker batch: once the index has it, every message before it is fully counted.
    feeder.send([b"", base.to_bytes(8, "big"), feeder.batch([
        ev.BlockStored([9001], None, [1] * 16, 16, None, "GPU", None, group_idx=0)])])
    deadline = time.monotonic() + 20
    while feeder.daemon.lookup([9001])["GPU"]["tokens"] != 16:
        assert time.monotonic() < deadline, "the marker batch never reached the index"
        time.sleep(0.05)
    before = feeder.wait_received()["sources"][0]
    seq = (base + 1).to_bytes(8, "big")
    feeder.send([b"", b"no seq"])  # two frames: malformed
    feeder.send([b"", seq, b"\xc1 not msgpack"])  # the next seq, applied: a decode error
    feeder.send([b"", seq, b"\xc1 again"])  # the same seq again: duplicate
    s = feeder.daemon.wait_for(  # received is counted before the payload is decoded
        lambda s: s["sources"][0]["received"] >= feeder.sent
        and s["sources"][0]["decode_errors"] > before["decode_errors"],
        what=f"received == {feeder.sent} and the decode error counted")
    src = s["sources"][0]
    assert feeder.daemon.get("/healthz")["status"] == "ok"
    delta = {k: src[k] - before[k] for k in ("received", "malformed_frames", "duplicates",
                                               "applied", "decode_errors")}
    assert delta == {"received": 3, "malformed_frames": 1, "duplicates": 1, "applied": 1,
                     "decode_errors": 1}
    # Every message is accounted for: malformed, duplicate/old, or applied (decoded or not).
    assert src["received"] == src["malformed_frames"] + src["duplicates"] + src["applied"]
    assert src["errors_by_reason"].get("internal", 0) == 0  # no bug path was hit
    assert s["index"]["entries"] <= MAX_ENTRIES
    # Still correct: a fresh publisher stream after the garbage (seq 0 = restart).
    feeder.send([b"", (0).to_bytes(8, "big"), feeder.batch([ev.AllBlocksCleared()])])
    feeder.send([b"", (1).to_bytes(8, "big"), feeder.batch([
        ev.BlockStored([7001, 7002], None, [1] * 32, 16, None, "GPU", None, group_idx=0)])])
    feeder.wait_received()
    looked = feeder.daemon.lookup([7001, 7002, 7003])
    assert looked["GPU"] == {"tokens": 32, "full_blocks": 2, "partial": False}
    print(f"\nfuzz: {src['received']} messages, {src['decode_errors']} decode errors, "
          f"{src['malformed_frames']} malformed, {src['duplicates']} duplicates, "
          f"{src['gaps']} gaps, rss={s['rss_bytes'] / 2**20:.1f} MiB")
    assert feeder.daemon.terminate() == 0
