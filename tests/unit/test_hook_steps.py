"""benchmarks/hook_steps.py: worker and scheduler steps rebuilt from recorded hook calls."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import hook_steps
from benchmarks.peers.timed_hooks import CALL_RECORD, HOOKS


def _call(name: str, start: float, wall: float, cpu_start: float = 0.0,
          cpu: float = 0.0, tokens: int = 0, requests: int = 0) -> bytes:
    return CALL_RECORD.pack(start, cpu_start, wall, cpu, float(HOOKS.index(name)), tokens,
                            requests)


def _worker_step(t: float, cpu0: float, forward: float, forward_cpu: float) -> bytes:
    """One step as vLLM's worker calls the hooks when no load is synchronous:
    ``handle_preemptions`` (1 ms), the forward (``forward`` s, of which the thread ran
    ``forward_cpu``), then ``start_load_kv`` and the rest (2 ms of hooks)."""
    after = t + 0.001 + forward
    return b"".join([
        _call("handle_preemptions", t, 0.001, cpu0, 0.001),
        _call("start_load_kv", after, 0.0005, cpu0 + 0.001 + forward_cpu, 0.0005),
        _call("wait_for_save", after + 0.0005, 0.001),
        _call("get_transfer_results", after + 0.0015, 0.0004),
        _call("build_connector_worker_meta", after + 0.0019, 0.0001),
    ])


def test_a_worker_step_is_split_into_hooks_forward_and_the_forwards_time_off_cpu(
        tmp_path: Path) -> None:
    (tmp_path / "1.calls").write_bytes(
        _worker_step(100.0, 5.0, forward=0.004, forward_cpu=0.003)
        + _worker_step(100.1, 6.0, forward=0.010, forward_cpu=0.002)
        + _call("handle_preemptions", 100.2, 0.001)[:17])  # a record cut short at exit
    steps = hook_steps.worker_steps(hook_steps.read_calls(tmp_path / "1.calls"))
    assert steps.shape == (2, 5)
    assert steps[:, 0] == pytest.approx([100.0, 100.1])
    assert steps[:, 1] == pytest.approx([0.001, 0.001])  # pre: handle_preemptions
    assert steps[:, 2] == pytest.approx([0.004, 0.010])  # forward
    assert steps[:, 3] == pytest.approx([0.003, 0.002])  # its thread CPU
    assert steps[:, 4] == pytest.approx([0.002, 0.002])  # post: start_load_kv .. last hook


def test_summaries_keep_only_the_windows_steps_and_split_the_slowest(tmp_path: Path) -> None:
    worker = b"".join(_worker_step(10.0 + i * 0.01, i * 0.01, forward=0.002,
                                   forward_cpu=0.002) for i in range(99))
    worker += _worker_step(11.0, 1.0, forward=0.012, forward_cpu=0.002)  # slow, off-CPU
    worker += _worker_step(50.0, 2.0, forward=0.5, forward_cpu=0.5)  # outside the window
    (tmp_path / "7.calls").write_bytes(worker)
    (tmp_path / "8.calls").write_bytes(b"".join(
        _call("build_connector_meta", 10.0 + i, 0.0002)
        + _call("update_connector_output", 10.5 + i, 0.0003) for i in range(3)))
    out = hook_steps.summarize(tmp_path, [(9.0, 11.9), (20.0, 30.0)])
    worker_out = out["worker"]
    assert worker_out["steps"] == 100
    assert worker_out["forward_ms"]["max"] == pytest.approx(12.0)
    slow = worker_out["slowest_1pct"]
    assert slow["steps"] == 1
    assert slow["forward_off_cpu_ms"] == pytest.approx(10.0)
    assert slow["step_ms"] == pytest.approx(15.0)
    assert out["scheduler"]["steps"] == 2  # build_connector_meta at 10 and 11; 12 is after
    assert out["scheduler"]["hooks_ms"]["max"] == pytest.approx(0.5)
    assert any("forward off-CPU" in line for line in hook_steps.render({"kvtier": out}))


def test_engine_steps_are_compared_by_what_was_scheduled_in_them(tmp_path: Path) -> None:
    """From one build_connector_meta to the next is one engine step, sorted by its work:
    one token per request (decode), a long prefill chunk along (chunk), or a short one."""
    sizes = [(3, 3), (258, 3), (42, 3), (3, 3), (256, 2), (1, 1)]  # (tokens, requests)
    starts = [10.0, 10.002, 10.018, 10.023, 10.026, 10.042]
    (tmp_path / "8.calls").write_bytes(b"".join(
        _call("build_connector_meta", t, 0.0002, tokens=n, requests=r)
        + _call("update_connector_output", t + 0.001, 0.0001)
        for t, (n, r) in zip(starts, sizes, strict=True)))
    steps = hook_steps.engine_steps(hook_steps.read_calls(tmp_path / "8.calls"))
    assert steps[:, 1] == pytest.approx([0.002, 0.016, 0.005, 0.003, 0.016])
    assert list(hook_steps.step_kind(steps[:, 2], steps[:, 3])) == [
        "decode", "chunk", "mixed", "decode", "chunk"]
    engine = hook_steps.summarize(tmp_path, [(9.0, 10.03)])["engine_steps"]
    assert {k: v["steps"] for k, v in engine.items()} == {"decode": 2, "mixed": 1, "chunk": 2}
    assert engine["decode"]["max"] == pytest.approx(3.0)
    assert engine["chunk"]["p50"] == pytest.approx(16.0)
    lines = hook_steps.render({"native": {"engine_steps": engine}})
    assert any("engine step, chunk" in line for line in lines)
