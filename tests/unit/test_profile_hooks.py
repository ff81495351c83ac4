"""profile_hooks' summary: per process, hook costs per call and per engine step."""

from __future__ import annotations

from benchmarks.profile_hooks import summarize


def test_a_process_is_a_worker_by_its_hooks_and_costs_add_up_per_step() -> None:
    engine = {"pid": 1, "hooks": {"build_connector_meta": [100, 3_000_000, 2_000_000],
                                  "take_events": [100, 200_000, 100_000]}}
    worker = {"pid": 2, "hooks": {"start_load_kv": [50, 1_000_000, 500_000],
                                  "wait_for_save": [50, 2_000_000, 1_500_000],
                                  "build_connector_meta": [0, 0, 0]}}
    out = summarize([engine, worker])
    core = out["engine core"]
    assert core["steps"] == 100 and core["cpu_ms"] == 2.1
    assert abs(core["cpu_us_per_step"] - 21.0) < 1e-9
    assert core["hooks"]["build_connector_meta"]["wall_us_per_call"] == 30.0
    rank = out["worker 2"]
    assert rank["steps"] == 50 and abs(rank["cpu_us_per_step"] - 40.0) < 1e-9
    assert "build_connector_meta" not in rank["hooks"]  # never called: no row
