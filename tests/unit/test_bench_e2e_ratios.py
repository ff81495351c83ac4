"""bench_e2e's no-hit comparisons: passes paired by name, and the spread of the pairs."""

from __future__ import annotations

import pytest

from benchmarks.bench_e2e import _by_instance, _paired, _paired_with, _spread, split_passes


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


def test_the_passes_split_into_contiguous_runs_one_per_engine_instance() -> None:
    assert split_passes(6, 2) == [[0, 1, 2], [3, 4, 5]]
    assert split_passes(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_passes(4, 1) == [[0, 1, 2, 3]]
    assert split_passes(3, 3) == [[0], [1], [2]]
    with pytest.raises(ValueError):
        split_passes(2, 3)  # an instance with no pass would measure nothing
    with pytest.raises(ValueError):
        split_passes(2, 0)


def test_paired_ratios_are_summarized_per_engine_instance() -> None:
    runs = _runs(none=[1.0, 2.0, 1.0, 1.0], kvtier=[1.1, 2.4, 1.0, 0.9])
    for config in runs.values():
        for i in range(4):
            config[f"nohit-{i}"]["instance"] = i // 2
    # instance 0 ran passes 0 and 1 (ratios 1.1, 1.2); instance 1 passes 2 and 3 (1.0, 0.9)
    assert _by_instance(runs, "kvtier", "none", "wall_s") == pytest.approx([1.15, 0.95])
    # results recorded without an instance (older JSON) count as instance 0
    plain = _runs(none=[1.0, 2.0], kvtier=[1.1, 2.4])
    assert _by_instance(plain, "kvtier", "none", "wall_s") == pytest.approx([1.15])
    assert _by_instance(plain, "absent", "none", "wall_s") == []
