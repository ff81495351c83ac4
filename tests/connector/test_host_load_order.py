"""The worker's host-tier load on a weakly ordered CPU (issue 43 item 12): copy, then check.

A real daemon process and real clients, both connector halves in this process over CPU
tensors (no vLLM engine), as in ``test_host_halves.py``. This machine is x86-64, where the
seqlock is sound and the worker checks a shard in place and loads it straight from the
segment; ``KVTIER_SEQLOCK_SOUND=0`` forces the order a weakly ordered CPU (aarch64) gets:
each shard copied out of the segment with its checksum computed over the copy, the load
written from that copy.

A weakly ordered reader can see a writer's payload bytes under a ``seq`` that still looks
unchanged; here that is simulated by writing into a shard's slot without moving its
``seq``, at the two moments that matter: after the check, before the load; and during the
check's copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from connector.vllm_connector.plan import FetchOp
from offload_tiers import shared_segment
from offload_tiers.shared_segment import SEQLOCK_ENV
from rigs.halves import BS, Blk, Halves, Req
from tests.connector.test_host_halves import WAIT_S, Make, daemon, engines

__all__ = ["daemon", "engines"]  # the fixtures this module shares with its neighbour
LATER = 0x5A  # the bytes a write lands in a checked shard's slot


def _stored_then_looked_up(engines: Make, tp: int) -> tuple[Halves, Halves, Req]:
    """Engine 1 stores 3 blocks into the host tier; engine 2 finds them there (an
    asynchronous load) and admits the request into blocks 7, 8, 9."""
    first = engines(tp)
    first.fill(range(1, 4), seed=3)
    first.admit(Req("a", 100), [[Blk(i, i * BS) for i in range(1, 4)]], 0)
    assert [op.to_host for op in first.step({"a": 3 * BS}).plan.saves] == [True] * 3
    for rank in first.ranks:
        assert rank.worker.flush_host(WAIT_S)
    host = first.sched.host
    assert host is not None
    assert host.client.wait_until(lambda c: len(c.mirror) == 3 * tp, WAIT_S)
    second = engines(tp)
    req = Req("b", 100)
    assert second.lookup(req) == (96, True)
    second.admit(req, [[Blk(7), Blk(8), Blk(9), Blk(10)]], 96)
    return first, second, req


def _later_write_after_the_check(second: Halves, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank: once its fetch checked its shards, their slots' bytes become ``LATER``
    with the slots' ``seq`` unmoved, before the load."""
    for rank in second.ranks:
        worker = rank.worker
        assert worker.host is not None and worker.host.segment is not None
        segment = worker.host.segment
        checked = worker._read_host

        def read_then_written(ops: list[FetchOp], checked: Callable[..., dict[int, bool]]
                              = checked, segment: shared_segment.SharedSegment = segment,
                              tp_rank: int = worker.tp_rank) -> dict[int, bool]:
            oks = checked(ops)
            for op in ops:
                slot, _, length = op.shards[tp_rank]
                segment.payloads[slot, :length] = LATER
            return oks

        monkeypatch.setattr(worker, "_read_host", read_then_written)


@pytest.mark.parametrize("tp", [1, 2])
def test_copy_then_checksum_loads_exactly_the_bytes_it_checked(
        engines: Make, tp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forced copy-then-checksum: a write that lands in the shards' slots after their check
    (seq unmoved) changes nothing loaded: every rank's blocks are byte-exact engine 1's."""
    monkeypatch.setenv(SEQLOCK_ENV, "0")
    first, second, _ = _stored_then_looked_up(engines, tp)
    _later_write_after_the_check(second, monkeypatch)
    result = second.step()
    assert result.finished == {"b"} and result.failed == set()
    for r1, r2 in zip(first.ranks, second.ranks, strict=True):
        assert torch.equal(r1.kv["attn0"][[1, 2, 3]], r2.kv["attn0"][[7, 8, 9]])
    assert second.counter("blocks_loaded_host") == [3] * tp
    # the copies came from the segment, checked there; the segment's slots hold LATER now
    for rank in second.ranks:
        assert rank.worker.host is not None and rank.worker.host.segment is not None
        assert rank.worker.host.segment.counters.hits == 3
    snap = second.sched.counters.snapshot()
    assert snap["hit_tokens_host"] == 96 and snap["failed_restores"] == 0


def test_negative_control_checked_in_place_the_later_bytes_are_loaded(
        engines: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same write under the in-place order (``KVTIER_SEQLOCK_SOUND=1``, x86-64's): the
    load reads the slots again after the check and the seqlock, unmoved, passes it: the
    blocks hold ``LATER``. On x86-64 a real writer cannot land there unseen (TSO); on a
    weakly ordered CPU it can, which is why the worker copies first there."""
    monkeypatch.setenv(SEQLOCK_ENV, "1")
    _, second, _ = _stored_then_looked_up(engines, 1)
    _later_write_after_the_check(second, monkeypatch)
    result = second.step()
    assert result.failed == set()
    loaded = second.ranks[0].kv["attn0"][[7, 8, 9]].contiguous().view(torch.uint8)
    assert bool((loaded == LATER).all())


def test_a_shard_changed_during_its_copy_fails_the_load(
        engines: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forced copy-then-checksum: a write lands in the second block's shard's slot (seq
    unmoved) once the fetch began copying, before that shard is copied: its checksum, over
    the copy, does not match, so the fetch fails and vLLM recomputes; nothing is loaded,
    every pin let go."""
    monkeypatch.setenv(SEQLOCK_ENV, "0")
    first, second, req = _stored_then_looked_up(engines, 1)
    host = second.sched.host
    assert host is not None
    slot = host.client.mirror[host.digests(first.key(req, 0, 2 * BS))[0]].slot
    worker = second.ranks[0].worker
    assert worker.host is not None and worker.host.segment is not None
    segment = worker.host.segment
    calls = [0]

    def copy_while_written(dst: Any, src: Any) -> None:
        if calls[0] == 0:  # the first copy of the fetch: the second shard is not copied yet
            segment.payloads[slot] = LATER
        calls[0] += 1
        dst[:] = src

    monkeypatch.setattr(shared_segment, "_copy_chunk", copy_while_written)
    result = second.step()
    assert calls[0] >= 1  # the forced order copied the shards out
    assert result.failed == {"b"}
    assert not second.ranks[0].kv["attn0"][[7, 8, 9]].any()
    counters = segment.counters
    assert (counters.checksum, counters.torn, counters.hits) == (1, 0, 2)
    snap = second.sched.counters.snapshot()
    assert snap["failed_restores"] == 1 and snap["hit_tokens_host"] == 0
    assert host.client._attached is not None
    attached = host.client._attached
    assert int(attached.pins.counts[attached.row].sum()) == 0
