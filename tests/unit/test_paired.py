"""Paired per-round ratios and their 95 % interval (pure arithmetic)."""

from __future__ import annotations

import math

import pytest

from benchmarks.paired import paired_ratio, t975


@pytest.mark.parametrize(("df", "exact"), [(1, 12.706), (10, 2.228), (30, 2.042),
                                           (31, 2.0395), (60, 2.0003), (1000, 1.9623)])
def test_t_quantiles_match_the_tables(df: int, exact: float) -> None:
    assert t975(df) == pytest.approx(exact, abs=1e-3)


def test_no_degrees_of_freedom_is_refused() -> None:
    with pytest.raises(ValueError, match="degrees of freedom"):
        t975(0)


def test_equal_ratios_every_round_give_that_ratio_and_no_width() -> None:
    r = paired_ratio([4.0, 8.0, 6.0], [2.0, 4.0, 3.0])
    assert r["rounds"] == 3
    assert r["geo_mean"] == pytest.approx(2.0)
    assert r["ci95"] == [pytest.approx(2.0), pytest.approx(2.0)]


def test_the_interval_is_t_on_the_logarithms() -> None:
    r = paired_ratio([1.0, 4.0], [2.0, 2.0])  # ratios 0.5 and 2: logs -ln2, +ln2
    half = 12.706 * (math.log(2) * math.sqrt(2)) / math.sqrt(2)
    assert r["geo_mean"] == pytest.approx(1.0)
    assert r["ci95"][0] == pytest.approx(math.exp(-half), rel=1e-3)
    assert r["ci95"][1] == pytest.approx(math.exp(half), rel=1e-3)


def test_rounds_without_two_positive_figures_are_left_out() -> None:
    r = paired_ratio([2.0, 0.0, float("nan"), 3.0], [1.0, 1.0, 1.0, 0.0])
    assert r == {"rounds": 1, "geo_mean": pytest.approx(2.0), "ci95": [None, None]}
    assert paired_ratio([], []) == {"rounds": 0, "geo_mean": None, "ci95": [None, None]}
