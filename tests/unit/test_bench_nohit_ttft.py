"""bench_nohit_ttft's summary: medians, p90 and ratios to vLLM alone (pure arithmetic)."""

from __future__ import annotations

import pytest

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
