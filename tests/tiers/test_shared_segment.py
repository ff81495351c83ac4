"""SharedSegment: real /dev/shm files, real processes (spawn), a writer SIGKILLed mid-write.

Events between processes are ordered by multiprocessing Events and process exits, never by
sleeps; the stress test is bounded by iteration counts.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import struct
import uuid
from collections.abc import Callable, Iterator
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event as MpEvent
from typing import Any

import numpy as np
import pytest

from offload_tiers import shared_segment
from offload_tiers.shared_segment import (
    CHUNK_BYTES,
    LAYOUT_VERSION,
    SEQLOCK_ENV,
    ReadCounters,
    SharedSegment,
    default_path,
    digest,
    seqlock_sound,
)

SLOT = 4096
KEY_A = digest(b"key-a")
KEY_B = digest(b"key-b")
SPAWN = mp.get_context("spawn")
JOIN_S = 60  # bounds a hung child only; nothing waits on it to order events


def pattern(save_id: int, size: int = SLOT) -> bytes:
    """Deterministic, position-dependent bytes of one save."""
    return np.random.default_rng(save_id).integers(0, 256, size, dtype=np.uint8).tobytes()


def naive_read(seg: SharedSegment, slot: int, key: bytes, save_id: int) -> bytes | None:
    """A reader WITHOUT the seq and checksum checks: header fields only (negative control)."""
    h = seg.header(slot)
    if h.flags != 1 or h.key != key or h.save_id != save_id:
        return None
    return seg.payloads[slot, : h.length].tobytes()


@pytest.fixture
def new_path() -> Iterator[Callable[[], str]]:
    """Unique /dev/shm paths, unlinked at teardown."""
    made: list[str] = []

    def make() -> str:
        made.append(default_path(f"test-{os.getpid()}-{uuid.uuid4().hex[:12]}"))
        return made[-1]

    yield make
    for path in made:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@pytest.fixture
def seg(new_path: Callable[[], str]) -> Iterator[SharedSegment]:
    s = SharedSegment.create(new_path(), 8, SLOT)
    yield s
    s.close()


def run_child(target: Callable[..., None], *args: object) -> int:
    p = SPAWN.Process(target=target, args=args)
    p.start()
    p.join(JOIN_S)
    if p.is_alive():
        p.kill()
        p.join()
    assert p.exitcode is not None
    return p.exitcode


def pwrite(path: str, data: bytes, offset: int) -> None:
    """Change the file through another path than the mapping (as another process would)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ children (spawned)
def _child_round_trip(path: str) -> None:
    with SharedSegment.attach(path) as s:
        if s.read(0, KEY_A, 1) != pattern(1):
            raise SystemExit(3)
        s.write(1, KEY_B, 2, pattern(2))


def _child_half_write(path: str, ready: MpEvent,
                      never: MpEvent) -> None:
    s = SharedSegment.attach(path)
    row = s.begin_write(0)
    row[: SLOT // 2] = 0xBB
    ready.set()
    never.wait(JOIN_S)  # the parent SIGKILLs us here; the timeout only bounds an orphan
    raise SystemExit(5)


STRESS_BYTES = 128 * 1024
STRESS_MAX_WRITES = 1_000_000
PAUSE_EVERY = 32  # writes between the writer's pauses for one verified read


def _stress_key(save_id: int) -> bytes:
    return KEY_A if save_id % 2 else KEY_B


def _child_writer(path: str, started: MpEvent, stop: MpEvent, want_read: MpEvent,
                  go: MpEvent, writes: Synchronized) -> None:
    """Rewrite slot 0 back to back; every PAUSE_EVERY writes, wait until the reader has had
    a verified read (so hits are guaranteed without timing), until told to stop."""
    with SharedSegment.attach(path) as s:
        n = 0
        for save_id in range(2, STRESS_MAX_WRITES):
            row = s.begin_write(0)
            row.fill(save_id & 0xFF)  # consecutive saves differ in every byte
            s.commit_write(0, _stress_key(save_id), save_id, STRESS_BYTES)
            n += 1
            if n == 1:
                started.set()
            if n % PAUSE_EVERY == 0:
                if stop.is_set():
                    break
                go.clear()
                want_read.set()
                go.wait(JOIN_S)
        writes.value = n


# ------------------------------------------------------------------ tests
def test_round_trip_across_processes(new_path: Callable[[], str]) -> None:
    path = new_path()
    with SharedSegment.create(path, 4, SLOT) as s:
        s.write(0, KEY_A, 1, pattern(1))
        assert run_child(_child_round_trip, path) == 0  # the child read slot 0 and wrote 1
        assert s.read(1, KEY_B, 2) == pattern(2)
        out = np.empty(SLOT, dtype=np.uint8)
        assert s.read_into(1, KEY_B, 2, out) and out.tobytes() == pattern(2)
        assert s.counters.hits == 2


def test_file_is_private_by_default_and_mode_is_honoured(
        new_path: Callable[[], str]) -> None:
    path = new_path()
    with SharedSegment.create(path, 2, SLOT):
        assert os.stat(path).st_mode & 0o777 == 0o600
        with pytest.raises(FileExistsError):
            SharedSegment.create(path, 2, SLOT)
    other = new_path()
    old = os.umask(0o022)  # would strip group write: the mode must win anyway
    try:
        with SharedSegment.create(other, 2, SLOT, mode=0o660):
            assert os.stat(other).st_mode & 0o777 == 0o660
    finally:
        os.umask(old)


def test_attach_refuses_foreign_wrong_version_and_truncated_files(
        new_path: Callable[[], str]) -> None:
    foreign = new_path()
    with open(foreign, "wb") as f:
        f.write(os.urandom(8192))
    with pytest.raises(ValueError, match="not a kvtier shared segment"):
        SharedSegment.attach(foreign)

    versioned = new_path()
    SharedSegment.create(versioned, 2, SLOT).close()
    pwrite(versioned, struct.pack("<I", LAYOUT_VERSION + 1), 8)  # version follows the magic
    with pytest.raises(ValueError, match=f"layout version {LAYOUT_VERSION + 1}"):
        SharedSegment.attach(versioned)

    short = new_path()
    s = SharedSegment.create(short, 2, SLOT)
    size = s.size
    s.close()
    os.truncate(short, size - 1)
    with pytest.raises(ValueError, match=f"truncated: {size - 1} bytes, the layout needs"):
        SharedSegment.attach(short)
    os.truncate(short, 10)
    with pytest.raises(ValueError, match="truncated: 10 bytes, smaller than the segment"):
        SharedSegment.attach(short)


def test_layout_payload_view_and_batched_gather_scatter(seg: SharedSegment) -> None:
    assert seg.payloads.shape == (8, SLOT) and seg.payloads.dtype == np.uint8
    assert seg.payloads.strides == (seg.slot_stride, 1) and seg.slot_stride % 64 == 0
    base = seg.payloads[0].ctypes.data - seg.payload_offset(0)
    for i in range(seg.num_slots):
        assert seg.payload_offset(i) % 64 == 0
        assert seg.payloads[i].ctypes.data - base == seg.payload_offset(i)
    slots = [1, 5, 6]
    for i in slots:  # scatter: one fancy-indexed copy between begin and commit
        seg.begin_write(i)
    seg.payloads[slots] = np.stack([np.frombuffer(pattern(i), np.uint8) for i in slots])
    for i in slots:
        seg.commit_write(i, digest(b"%d" % i), i, SLOT)
    tickets = [seg.begin_read(i, digest(b"%d" % i), i) for i in slots]
    assert all(t is not None for t in tickets)
    gathered = seg.payloads[slots]  # gather: one copy
    assert all(seg.end_read(t, row) for t, row in zip(tickets, gathered, strict=True))
    assert [row.tobytes() for row in gathered] == [pattern(i) for i in slots]


def test_slot_reused_by_another_key_or_save_is_a_miss(seg: SharedSegment) -> None:
    with SharedSegment.attach(seg.path) as writer:
        writer.write(3, KEY_A, 1, pattern(1))
        assert seg.read(3, KEY_A, 1) == pattern(1)  # the reader's look-up said (3, A, 1)
        writer.write(3, KEY_B, 7, pattern(7))  # slot reused for another key
        assert seg.read(3, KEY_A, 1) is None and seg.counters.key_mismatch == 1
        writer.write(3, KEY_A, 8, pattern(8))  # same key, another save
        assert seg.read(3, KEY_A, 1) is None and seg.counters.save_mismatch == 1
        out = np.empty(SLOT, np.uint8)
        assert not seg.read_into(3, KEY_A, 1, out) and seg.counters.save_mismatch == 2
        assert seg.read(3, KEY_A, 8) == pattern(8)
        writer.invalidate(3)
        assert seg.read(3, KEY_A, 8) is None and seg.counters.empty == 1
        assert seg.read(4, KEY_A, 8) is None and seg.counters.empty == 2  # never written
        writer.write(3, KEY_A, 9, pattern(9, 100))
        assert not seg.read_into(3, KEY_A, 9, out) and seg.counters.length == 1
        assert seg.counters.hits == 2


def test_write_during_the_copy_is_caught(seg: SharedSegment) -> None:
    seg.write(5, KEY_A, 1, pattern(1))
    with SharedSegment.attach(seg.path) as writer:
        ticket = seg.begin_read(5, KEY_A, 1)
        assert ticket is not None
        writer.write(5, KEY_A, 2, pattern(2))  # a whole rewrite lands during the copy
        copied = seg.payloads[5, : ticket.length].copy()
        assert copied.tobytes() == pattern(2)
        assert not seg.end_read(ticket, copied) and seg.counters.torn == 1
        ticket = seg.begin_read(5, KEY_A, 2)
        assert ticket is not None
        writer.begin_write(5)[:10] = 0  # a write begun, not yet committed, during the copy
        copied = seg.payloads[5].copy()
        assert not seg.end_read(ticket, copied) and seg.counters.torn == 2
        assert seg.counters.hits == 0


def kill_mid_write(seg: SharedSegment) -> None:
    """Slot 0 holds save 1 of KEY_A (0xAA); a writer process begins a write, fills half the
    payload with 0xBB and is SIGKILLed there."""
    seg.write(0, KEY_A, 1, b"\xaa" * SLOT)
    ready, never = SPAWN.Event(), SPAWN.Event()
    p = SPAWN.Process(target=_child_half_write, args=(seg.path, ready, never))
    p.start()
    try:
        assert ready.wait(JOIN_S), "the writer never reached the middle of its write"
        os.kill(p.pid, signal.SIGKILL)
        p.join(JOIN_S)
    finally:
        if p.is_alive():
            p.kill()
            p.join()
    assert p.exitcode == -signal.SIGKILL


def test_writer_killed_mid_write_is_a_miss_then_the_slot_recovers(
        seg: SharedSegment) -> None:
    kill_mid_write(seg)
    assert seg.header(0).seq % 2 == 1
    assert seg.read(0, KEY_A, 1) is None and seg.counters.torn == 1
    out = np.empty(SLOT, np.uint8)
    assert not seg.read_into(0, KEY_A, 1, out) and seg.counters.torn == 2
    assert seg.begin_read(0, KEY_A, 1) is None and seg.counters.hits == 0
    seg.write(0, KEY_B, 2, pattern(2))  # a later writer takes the orphaned slot over
    assert seg.read(0, KEY_B, 2) == pattern(2)


def test_negative_control_without_the_checks_the_torn_bytes_would_be_served(
        seg: SharedSegment) -> None:
    kill_mid_write(seg)
    torn = b"\xbb" * (SLOT // 2) + b"\xaa" * (SLOT // 2)
    # the header still names save 1 of KEY_A: a reader checking only those serves garbage
    assert naive_read(seg, 0, KEY_A, 1) == torn
    assert seg.read(0, KEY_A, 1) is None
    # defeat the seq check (make it even again): the checksum alone still refuses
    h = seg.header(0)
    pwrite(seg.path, struct.pack("<Q", h.seq + 1), seg.header_offset(0))
    assert seg.header(0).seq % 2 == 0
    assert naive_read(seg, 0, KEY_A, 1) == torn
    assert seg.read(0, KEY_A, 1) is None
    assert seg.counters.checksum == 1 and seg.counters.torn == 1 and seg.counters.hits == 0


def test_flipped_payload_byte_after_commit_is_a_checksum_miss(seg: SharedSegment) -> None:
    seg.write(2, KEY_A, 1, pattern(1))
    assert seg.read(2, KEY_A, 1) == pattern(1)
    flipped = bytes([pattern(1)[777] ^ 0x01])
    pwrite(seg.path, flipped, seg.payload_offset(2) + 777)
    assert naive_read(seg, 2, KEY_A, 1) != pattern(1)  # the bytes really changed
    assert seg.read(2, KEY_A, 1) is None and seg.counters.checksum == 1
    out = np.empty(SLOT, np.uint8)
    assert not seg.read_into(2, KEY_A, 1, out) and seg.counters.checksum == 2


def test_concurrent_writer_never_yields_a_torn_value(new_path: Callable[[], str]) -> None:
    min_reads, min_hits, max_reads = 3000, 20, 200_000
    path = new_path()
    with SharedSegment.create(path, 1, STRESS_BYTES) as s:
        s.write(0, _stress_key(1), 1, bytes([1]) * STRESS_BYTES)
        started, stop, want_read, go = (SPAWN.Event() for _ in range(4))
        writes = SPAWN.Value("q", 0)
        p = SPAWN.Process(target=_child_writer,
                          args=(path, started, stop, want_read, go, writes))
        p.start()
        wrong: list[int] = []
        reads = hits = 0
        try:
            assert started.wait(JOIN_S), "the writer never started"
            while reads < max_reads and (reads < min_reads or hits < min_hits):
                reads += 1
                save_id = s.header(0).save_id  # what the look-up would have said
                got = s.read(0, _stress_key(save_id), save_id)
                if got is None:
                    continue
                hits += 1
                if got != bytes([save_id & 0xFF]) * STRESS_BYTES:
                    wrong.append(save_id)
                if want_read.is_set():  # the writer is paused until a verified read
                    want_read.clear()
                    go.set()
        finally:
            stop.set()
            go.set()
            p.join(JOIN_S)
            if p.is_alive():
                p.kill()
                p.join()
        assert p.exitcode == 0 and writes.value >= 1
        c = s.counters
        misses = c.torn + c.key_mismatch + c.save_mismatch + c.checksum + c.length + c.empty
        print(f"reads={reads} hits={hits} writes={writes.value} {c.as_dict()}")
        assert not wrong, f"torn or foreign bytes accepted for saves {wrong[:5]}"
        assert hits >= min_hits and c.hits == hits and c.hits + misses == reads


def test_writer_discipline_and_argument_errors(seg: SharedSegment) -> None:
    with pytest.raises(RuntimeError, match="without begin_write"):
        seg.commit_write(0, KEY_A, 1, 10)
    with SharedSegment.attach(seg.path) as other:
        seg.begin_write(0)
        other.begin_write(0)  # the directory should never let this happen; detect it
        with pytest.raises(RuntimeError, match="another writer"):
            seg.commit_write(0, KEY_A, 1, 10)
        other.commit_write(0, KEY_B, 2, 10)
    assert seg.read(0, KEY_B, 2) is not None
    with pytest.raises(ValueError, match="do not fit"):
        seg.write(0, KEY_A, 1, b"x" * (SLOT + 1))
    with pytest.raises(ValueError, match="16 bytes"):
        seg.write(0, b"short", 1, b"x")
    with pytest.raises(ValueError, match="uint64"):
        seg.write(0, KEY_A, -1, b"x")
    with pytest.raises(IndexError):
        seg.read(8, KEY_A, 1)
    with pytest.raises(ValueError):
        default_path("../etc")
    seg.close()
    seg.close()
    assert seg.closed
    with pytest.raises(ValueError, match="closed"):
        seg.read(0, KEY_A, 1)


def test_read_many_into_checks_each_slot_as_read_into_does(seg: SharedSegment) -> None:
    """One batch: a hit, a key reused by another save, the right key of another save, an
    empty slot, the wrong length, a slot being written, a byte flipped after the commit."""
    for slot, (key, save) in enumerate([(KEY_A, 1), (KEY_B, 2), (KEY_A, 3), (KEY_A, 4),
                                        (KEY_B, 5), (KEY_B, 6)]):
        seg.write(slot, key, save, pattern(save))
    seg.begin_write(5)  # being written
    seg.payloads[4, 7] ^= 0xFF  # corrupted after its commit
    outs = [np.zeros(SLOT, np.uint8) for _ in range(7)]
    outs[3] = np.zeros(SLOT - 1, np.uint8)
    before = seg.counters.as_dict()
    got = seg.read_many_into([0, 1, 2, 3, 4, 5, 6],
                             [KEY_A, KEY_A, KEY_A, KEY_A, KEY_B, KEY_B, KEY_A],
                             [1, 2, 9, 4, 5, 6, 7], outs)
    assert got == [True, False, False, False, False, False, False]
    assert outs[0].tobytes() == pattern(1)
    after = seg.counters.as_dict()
    delta = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    assert delta == {"hits": 1, "key_mismatch": 1, "save_mismatch": 1, "length": 1,
                     "checksum": 1, "torn": 1, "empty": 1}


def test_verify_many_checks_in_place_and_unchanged_catches_a_later_write(
        seg: SharedSegment) -> None:
    """The in-place check a direct load relies on: the exact save and length, its bytes'
    checksum where they lie, and afterwards whether a write began since."""
    with SharedSegment.attach(seg.path) as writer:
        writer.write(1, KEY_A, 5, pattern(5))
        writer.write(2, KEY_B, 6, pattern(6))
        writer.write(4, KEY_A, 9, pattern(9))
        pwrite(seg.path, bytes([pattern(9)[10] ^ 0x01]), seg.payload_offset(4) + 10)
        seqs = seg.verify_many([1, 2, 3, 4, 1], [KEY_A, KEY_A, KEY_A, KEY_A, KEY_A],
                               [5, 6, 1, 9, 5], [SLOT, SLOT, SLOT, SLOT, SLOT - 1])
        assert [s is not None for s in seqs] == [True, False, False, False, False]
        c = seg.counters
        assert (c.hits, c.key_mismatch, c.empty, c.checksum, c.length) == (1, 1, 1, 1, 1)
        assert seg.payloads[1, :SLOT].tobytes() == pattern(5)  # what a load copies
        assert seg.unchanged([1], [seqs[0]]) == [True]
        writer.write(1, KEY_A, 7, pattern(7))  # the slot written again after the check
        assert seg.unchanged([1], [seqs[0]]) == [False] and seg.counters.torn == 1


# ------------------------------------------------------------ copy-then-checksum (43.12)
BIG = 3 * CHUNK_BYTES + 100  # four chunks, the last one short


@pytest.mark.parametrize("length", [0, 1, 4096, CHUNK_BYTES - 1, CHUNK_BYTES,
                                    CHUNK_BYTES + 1, BIG])
def test_the_fused_copy_and_checksum_equals_the_committed_checksum(length: int) -> None:
    """One pass: copied in chunks, each hashed from the copy; the value is the checksum a
    commit stores (payload, then key, save id and length), and the copy is the source."""
    src = np.frombuffer(pattern(7, length), np.uint8)
    dst = np.zeros(length, np.uint8)
    got = shared_segment._copy_checksum(memoryview(dst), memoryview(src),
                                        shared_segment._tail(KEY_A, 42, length))
    assert got == shared_segment._checksum(src, KEY_A, 42, length)
    assert dst.tobytes() == src.tobytes()


def _move_source_at(chunk: int, new: bytes, where: slice | None = None
                    ) -> Callable[[memoryview, memoryview], None]:
    """A chunk copy that, at chunk ``chunk`` of a read, first rewrites the source slot's
    bytes ``where`` (default: all of them) to ``new``'s, with its seq unmoved: a write
    that a weakly ordered reader sees land during its copy under a seq that looks stable."""
    calls = [0]

    def copy(dst: memoryview, src: memoryview) -> None:
        if calls[0] == chunk:
            base = np.frombuffer(src.obj, np.uint8)  # the whole slot row
            span = where or slice(0, len(new))
            base[span] = np.frombuffer(new, np.uint8)[span]
        calls[0] += 1
        dst[:] = src

    return copy


def test_bytes_changed_during_the_copy_are_caught_by_the_checksum_of_the_copy(
        new_path: Callable[[], str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy hands out old bytes for its first chunk and new ones after: a torn value
    the seqlock did not see (seq never moved). The checksum, over the copied bytes, refuses
    it, for read_into and read_many_into; a change to bytes already copied leaves the copy
    exactly the save, and it is served."""
    old, new = pattern(1, BIG), pattern(2, BIG)
    with SharedSegment.create(new_path(), 2, BIG) as seg:
        for read in ("read_into", "read_many_into"):
            seg.write(0, KEY_A, 1, old)
            seq = seg.header(0).seq
            monkeypatch.setattr(shared_segment, "_copy_chunk", _move_source_at(1, new))
            out = np.zeros(BIG, np.uint8)
            before = seg.counters.as_dict()
            if read == "read_into":
                got = seg.read_into(0, KEY_A, 1, out)
            else:
                got = seg.read_many_into([0], [KEY_A], [1], [out]) == [True]
            after = seg.counters.as_dict()
            assert seg.header(0).seq == seq  # the seqlock saw nothing
            assert out[:CHUNK_BYTES].tobytes() == old[:CHUNK_BYTES]  # the torn copy
            assert out[CHUNK_BYTES:].tobytes() == new[CHUNK_BYTES:]
            assert not got, f"{read} served a torn copy"
            assert {k: after[k] - before[k] for k in after if after[k] != before[k]} == {
                "checksum": 1}
        # the first chunk's source rewritten while the third is copied: already copied and
        # hashed, so the copy is exactly save 1 and is served
        seg.write(0, KEY_A, 1, old)
        monkeypatch.setattr(shared_segment, "_copy_chunk",
                            _move_source_at(2, new, slice(0, CHUNK_BYTES)))
        out = np.zeros(BIG, np.uint8)
        assert seg.read_into(0, KEY_A, 1, out) and out.tobytes() == old
        assert seg.payloads[0, :CHUNK_BYTES].tobytes() == new[:CHUNK_BYTES]


def test_seqlock_sound_on_tso_machines_only_and_the_override(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SEQLOCK_ENV, raising=False)
    for machine, sound in (("x86_64", True), ("AMD64", True), ("i686", True),
                           ("aarch64", False), ("arm64", False), ("ppc64le", False),
                           ("riscv64", False), ("", False)):
        monkeypatch.setattr(shared_segment.platform, "machine", lambda m=machine: m)
        assert seqlock_sound() is sound, machine
    monkeypatch.setattr(shared_segment.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv(SEQLOCK_ENV, "0")
    assert seqlock_sound() is False
    monkeypatch.setattr(shared_segment.platform, "machine", lambda: "aarch64")
    monkeypatch.setenv(SEQLOCK_ENV, "1")
    assert seqlock_sound() is True
    monkeypatch.setenv(SEQLOCK_ENV, "yes")  # not 0 or 1: the machine decides
    assert seqlock_sound() is False


def test_read_many_into_one_array_of_rows_checks_each_row(seg: SharedSegment) -> None:
    """``outs`` as one 2-D array (how the worker's copy-then-checksum load reads): each row
    holds its save, a row whose slot holds another save is a counted miss."""
    for slot, save in ((0, 1), (1, 2), (2, 3)):
        seg.write(slot, KEY_A, save, pattern(save))
    outs = np.zeros((3, SLOT), np.uint8)
    assert seg.read_many_into([0, 1, 2], [KEY_A] * 3, [1, 2, 9], outs) == [True, True, False]
    assert outs[0].tobytes() == pattern(1) and outs[1].tobytes() == pattern(2)
    assert seg.counters.hits == 2 and seg.counters.save_mismatch == 1
    with pytest.raises(ValueError, match="contiguous"):
        seg.read_many_into([0, 1], [KEY_A] * 2, [1, 2], np.zeros((2, 2 * SLOT), np.uint8)[:, ::2])


def test_neighbouring_slots_copied_at_once_are_each_checked_on_the_copy(
        seg: SharedSegment, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of one array, slots side by side: copied in runs (one copy per run, the slot
    headers skipped), each row hashed from the copy. A write landing in the middle slot
    (seq unmoved) before the run's copy fails that row only."""
    assert shared_segment._neighbour_runs([0, 1, 2, 4, 5, 6, 7], [3, 4, 5, 6, 0, 1, 2, 3], 3
                                          ) == [(0, 3), (4, 3), (7, 1)]
    assert shared_segment._neighbour_runs([0, 1], [5, 7], 8) == [(0, 1), (1, 1)]
    for slot in range(6):
        seg.write(slot, KEY_A, slot + 1, pattern(slot + 1))
    copies: list[int] = []

    def copy(dst: Any, src: Any) -> None:
        if not copies:
            seg.payloads[2, :100] = 0  # slot 2, the middle of the first run
        copies.append(len(np.asarray(dst)))
        dst[:] = src

    monkeypatch.setattr(shared_segment, "_copy_chunk", copy)
    outs = np.zeros((6, SLOT), np.uint8)
    got = seg.read_many_into([1, 2, 3, 0, 4, 5], [KEY_A] * 6, [2, 3, 4, 1, 5, 6], outs)
    assert copies == [3, SLOT, 2]  # slots 1-3 at once, slot 0 alone, slots 4-5 at once
    assert got == [True, False, True, True, True, True]
    for row, slot in enumerate([1, 2, 3, 0, 4, 5]):
        if slot != 2:
            assert outs[row].tobytes() == pattern(slot + 1)
    assert seg.counters.as_dict() == {**ReadCounters().as_dict(), "hits": 5, "checksum": 1}
