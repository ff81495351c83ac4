"""bench_nohit_ttft's summary (medians, p90 and ratios to vLLM alone) and its turn-taking
over engine instances (pure logic: engines are stand-ins)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import bench_nohit_ttft
from benchmarks.bench_nohit_ttft import summarize


def test_medians_p90_and_ratios_to_none() -> None:
    out = summarize({"none": [0.010, 0.030, 0.020],
                     "kvtier-cpu": [0.020, 0.022, 0.024, 0.026],
                     "kvtier": [0.040] * 10})
    rows = out["rows"]
    assert rows["none"] == {"requests": 3, "median_ms": pytest.approx(20.0),
                            "p90_ms": pytest.approx(30.0)}
    assert rows["kvtier-cpu"]["median_ms"] == pytest.approx(23.0)
    assert out["ratios"] == {"ttft_nohit_kvtier_cpu_vs_none": pytest.approx(1.15),
                             "ttft_nohit_kvtier_vs_none": pytest.approx(2.0)}


class _Engine:
    """An engine stand-in: records the passes it ran (no vLLM; the turn-taking is logic)."""

    def __init__(self, book: dict[str, Any], label: str) -> None:
        self.book, self.label = book, label
        book["alive"] += 1
        book["most_alive"] = max(book["most_alive"], book["alive"])
        book["started"].append(label)

    def run(self, phase: dict[str, Any]) -> dict[str, Any]:
        self.book["ran"].append((self.label, phase["name"]))
        return {"wall_s": 1.0, "requests": []}

    def stop(self) -> None:
        self.book["alive"] -= 1


class _Bench:
    def __init__(self) -> None:
        self.book: dict[str, Any] = {"alive": 0, "most_alive": 0, "started": [], "ran": []}

    def engine(self, label: str, *_: Any) -> _Engine:
        return _Engine(self.book, label)

    def transfer_config(self, config: str) -> dict[str, Any] | None:
        return None if config == "none" else {"redis": config == "kvtier"}


def test_passes_are_spread_over_engine_instances_one_set_alive_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_nohit_ttft.time, "sleep", lambda _s: None)
    bench = _Bench()
    configs = ["none", "kvtier"]
    per_pass = bench_nohit_ttft.take_turns(
        bench, "llama", configs, 4, 0.0,  # type: ignore[arg-type]
        lambda config, engine, phase: engine.run(phase), instances=2)
    book = bench.book
    assert book["started"] == ["none-1", "kvtier-1", "none-2", "kvtier-2"]
    assert book["most_alive"] == len(configs) and book["alive"] == 0
    # each set: a warm-up each, then its half of the passes, the order rotated per pass
    assert book["ran"] == [
        ("kvtier-1", "warmup"), ("none-1", "warmup"),
        ("none-1", "nohit-0"), ("kvtier-1", "nohit-0"),
        ("kvtier-1", "nohit-1"), ("none-1", "nohit-1"),
        ("kvtier-2", "warmup"), ("none-2", "warmup"),
        ("none-2", "nohit-2"), ("kvtier-2", "nohit-2"),
        ("kvtier-2", "nohit-3"), ("none-2", "nohit-3")]
    assert [{c: r["instance"] for c, r in p.items()} for p in per_pass] == [
        {"none": 0, "kvtier": 0}, {"kvtier": 0, "none": 0},
        {"none": 1, "kvtier": 1}, {"kvtier": 1, "none": 1}]
