"""bench_e2e's no-hit comparisons: passes paired by name, and the spread of the pairs."""

from __future__ import annotations

import pytest

from benchmarks.bench_e2e import _paired, _paired_with, _spread


def _runs(**walls: list[float]) -> dict[str, dict[str, dict[str, float]]]:
    return {c: {f"nohit-{i}": {"wall_s": w} for i, w in enumerate(ws)} | {"cold": {"wall_s": 9.0}}
            for c, ws in walls.items()}


def test_passes_pair_by_name_and_only_no_hit_passes_count() -> None:
    runs = _runs(none=[1.0, 2.0, 4.0], kvtier=[1.1, 2.0, 3.0], native=[1.0, 2.5])
    assert _paired(runs, "kvtier", "wall_s") == pytest.approx([1.1, 1.0, 0.75])
    # kvtier against native directly: only the passes both ran
    assert _paired_with(runs, "kvtier", "native", "wall_s") == pytest.approx([1.1, 0.8])
    assert _paired_with(runs, "kvtier", "absent", "wall_s") == []


def test_the_spread_is_the_quartiles_and_range_of_the_pairs() -> None:
    spread = _spread([0.8, 1.0, 1.1, 1.2, 1.5])
    assert spread == pytest.approx({"q1": 1.0, "median": 1.1, "q3": 1.2, "min": 0.8,
                                    "max": 1.5})
    assert _spread([1.0]) is None
