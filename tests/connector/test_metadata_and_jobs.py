"""What the halves tell each other (StepPlan, WorkerReport) and the scheduler's JobBook."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from connector.vllm_connector.connector import TieredConnectorMetadata, TieredWorkerMetadata
from connector.vllm_connector.jobs import JobBook
from connector.vllm_connector.plan import (
    MIXED_SAVES,
    FetchFrom,
    FetchOp,
    LoadFrom,
    LoadOp,
    ProbeOp,
    SaveOp,
    StepPlan,
    WorkerReport,
    plan_from_wire,
    report_from_wire,
    to_wire,
)
from offload_tiers.keys import BlockKey, BlockKind

K1 = BlockKey("ab" * 16, 0, b"h0", 32, BlockKind.FULL)
K2 = BlockKey("ab" * 16, 1, b"h1", 48, BlockKind.PARTIAL)


def test_merge_sums_every_job_over_ranks() -> None:
    rank0 = WorkerReport(saves={1: [1, 1, 0], 2: [1, 1, 0]}, fetches={5: [1, 1]},
                         probes={9: ([7, 0, 5], 1)}, redis_up={0: 1})
    rank1 = WorkerReport(saves={1: [0, 1, 1], 3: [1, 1, 0]}, fetches={5: [0, 1]},
                         probes={9: ([7, 3, 6], 1)}, redis_up={1: 0})
    merged = rank0.merge(rank1)
    assert merged is rank0
    assert merged.saves == {1: [1, 2, 1], 2: [1, 1, 0], 3: [1, 1, 0]}
    assert merged.fetches == {5: [1, 2]}
    # a save id survives only where both ranks read the same save
    assert merged.probes == {9: ([7, MIXED_SAVES, MIXED_SAVES], 2)}
    assert merged.redis_up == {0: 1, 1: 0}  # each rank's word, by rank
    rank2 = WorkerReport(saves={1: [1, 1, 0]})
    assert merged.merge(rank2).saves[1] == [2, 3, 1]


def test_merge_copies_and_never_aliases_the_other_report() -> None:
    other = WorkerReport(saves={1: [1, 1, 0]}, probes={2: ([1], 1)})
    merged = WorkerReport().merge(other)
    merged.merge(WorkerReport(saves={1: [1, 1, 0]}, probes={2: ([1], 1)}))
    assert other.saves == {1: [1, 1, 0]} and other.probes == {2: ([1], 1)}


def test_redis_up_merges_each_ranks_word_by_rank() -> None:
    def up(*words: dict[int, int]) -> dict[int, int]:
        report = WorkerReport()
        for word in words:
            report.merge(WorkerReport(redis_up=word))
        return report.redis_up

    assert up() == {} and up({}, {}) == {}  # no rank has news (or Redis configured)
    assert up({}, {1: 1}) == {1: 1} and up({0: 0}, {}) == {0: 0}
    assert up({0: 1}, {1: 0}) == {0: 1, 1: 0}


def test_empty_report_is_false_and_health_alone_is_true() -> None:
    assert not WorkerReport()
    assert WorkerReport(redis_up={0: 0}) and WorkerReport(redis_up={1: 1})
    assert WorkerReport(saves={1: [1, 1, 0]}) and WorkerReport(probes={1: ([], 1)})
    assert not StepPlan()
    assert StepPlan(async_reqs=["r"]) and StepPlan(probes=[ProbeOp(1, (K1,))])


def test_plan_and_report_pickle() -> None:
    """The halves run in different processes: vLLM serialises both."""
    plan = StepPlan(loads=[LoadOp("r", 0, 3, 1, K1),
                           LoadOp("r", 1, 4, 2, K2, LoadFrom.FETCHED_SLOT)],
                    fetches=[FetchOp(7, "r", 2, K2)],
                    saves=[SaveOp(8, "r", 0, 5, 3, K1, to_redis=True)],
                    probes=[ProbeOp(9, (K1, K2))], async_reqs=["r"])
    again = pickle.loads(pickle.dumps(plan))  # noqa: S301 - our own bytes
    assert again == plan
    report = WorkerReport(saves={8: [1, 1, 0]}, fetches={7: [1, 1]}, probes={9: ([1, 1], 1)},
                          redis_up={0: 1})
    assert pickle.loads(pickle.dumps(report)) == report  # noqa: S301


def test_a_quiet_steps_metadata_pickles_small_and_keeps_layout_known_and_idle() -> None:
    """vLLM pickles the metadata into every step's broadcast; most plans are empty."""
    for known in (False, True):
        for idle in (False, True):
            quiet = TieredConnectorMetadata(StepPlan(layout_known=known, idle=idle))
            blob = pickle.dumps(quiet)
            again = pickle.loads(blob)  # noqa: S301 - our own bytes
            assert isinstance(again, TieredConnectorMetadata)
            assert again.plan == StepPlan(layout_known=known, idle=idle)
            assert len(blob) < 120


def test_busy_metadata_and_reports_cross_processes_as_typed_msgpack() -> None:
    plan = StepPlan(loads=[LoadOp("r", 0, 3, 1, K1),
                           LoadOp("r", 1, 4, 2, K2, LoadFrom.FETCHED_SLOT)],
                    fetches=[FetchOp(7, "r", None, K2, FetchFrom.HOST, 5, ((1, 2, 3), (4, 5, 6)))],
                    saves=[SaveOp(8, "r", 0, 5, 3, K1, to_redis=True, save_id=9)],
                    probes=[ProbeOp(9, (K1, K2))], async_reqs=["r"], tail_reqs=["t"],
                    layout_known=True, idle=True)
    again = pickle.loads(pickle.dumps(TieredConnectorMetadata(plan)))  # noqa: S301
    assert again.plan == plan and again.plan.saves[0].key.kind is BlockKind.FULL
    assert isinstance(again.plan.probes[0].keys, tuple)
    report = WorkerReport(saves={8: [1, 1, 0]}, fetches={7: [1, 1]}, probes={9: ([1, 0], 1)},
                          redis_up={1: 0}, rank0_layout="L")
    back = pickle.loads(pickle.dumps(TieredWorkerMetadata(report)))  # noqa: S301
    assert back.report == report


def test_ops_cross_as_arrays_without_field_names() -> None:
    """Plans travel every step: each op is a short array, where it reads a small int."""
    wire = to_wire(StepPlan(loads=[LoadOp("r", 0, 3, None, K1, LoadFrom.HOST)],
                            fetches=[FetchOp(7, "r", 2, K2, FetchFrom.REDIS, 5)],
                            saves=[SaveOp(8, "r", 0, 5, None, K1, to_redis=True)],
                            probes=[ProbeOp(9, (K1,))]))
    for name in (b"req_id", b"block_id", b"slot", b"source", b"save_id", b"to_redis", b"job"):
        assert name not in wire
    again = plan_from_wire(wire)
    assert again.loads[0].source is LoadFrom.HOST and again.saves[0].slot is None


def test_a_plan_off_the_wire_is_validated() -> None:
    good = to_wire(StepPlan(saves=[SaveOp(8, "r", 0, 5, 3, K1, to_redis=True)]))
    bad = good.replace(b"num_tokens\x20", b"num_tokens\x00")  # K1 covers 32 tokens -> 0
    assert bad != good
    with pytest.raises(msgspec.ValidationError, match="num_tokens must be positive"):
        plan_from_wire(bad)
    with pytest.raises(msgspec.ValidationError):
        report_from_wire(msgspec.msgpack.encode([1, 2]))  # not a report


def test_a_job_is_done_after_every_rank_reported_and_ok_only_if_all_were() -> None:
    book = JobBook(world_size=2)
    save = book.open_save(K1, 3, "r", (0, 0, 32), True)
    fetch = book.open_fetch(K2, 4, "r")
    assert save != fetch and len(book) == 2
    assert book.report(save, ok=1, reports=1) is None
    done = book.report(save, ok=0, reports=1, gather_failed=1)
    assert done is not None
    entry, all_ok = done
    assert not all_ok and entry.gather_failed
    assert (entry.key, entry.slot, entry.req_id, entry.mark, entry.to_redis) == (
        K1, 3, "r", (0, 0, 32), True)
    assert book.report(save, ok=1, reports=1) is None  # done jobs are forgotten
    merged = book.report(fetch, ok=2, reports=2)  # both ranks in one merged report
    assert merged is not None and merged[1] and not merged[0].gather_failed
    assert len(book) == 0
    assert book.report(12345, ok=1, reports=1) is None  # unknown job


def test_one_rank_of_one_is_every_rank() -> None:
    book = JobBook(world_size=1)
    job = book.open_fetch(K1, 0, "r")
    done = book.report(job, ok=1, reports=1)
    assert done is not None and done[1]


def test_probe_save_ids_are_merged_until_every_rank_answered() -> None:
    book = JobBook(world_size=2)
    job = book.open_probe((K1, K2))
    assert book.report_probe(job, [4, 4], 1) is None
    assert book.report_probe(job, [4, 0], 1) == ((K1, K2), [4, MIXED_SAVES])
    assert book.report_probe(job, [1, 1], 1) is None and len(book) == 0
    assert book.report(job, ok=1, reports=1) is None  # probes and slot jobs are apart


def test_job_ids_are_unique_across_kinds() -> None:
    book = JobBook(world_size=1)
    ids = [book.open_save(K1, 0, "r", None, False), book.open_fetch(K1, 1, "r"),
           book.open_probe((K1,)), book.open_save(K2, 2, "r", None, True)]
    assert len(set(ids)) == 4 and ids == sorted(ids)
