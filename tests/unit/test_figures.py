"""The figures README.md and docs quote are what the committed benchmark JSON renders to."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from benchmarks import figures


def test_every_quoted_figure_equals_its_json() -> None:
    assert figures.stale_spans() == [], "run `make bench` or `python -m benchmarks.figures render`"


def test_every_renderer_is_quoted_and_every_benchmark_row_is_rendered() -> None:
    texts = {doc: (figures.REPO / doc).read_text() for doc in figures.DOCUMENTS}
    quoted = {m["name"] for text in texts.values() for m in figures.SPAN.finditer(text)}
    assert quoted == set(figures.RENDERERS)
    measured = texts["README.md"].split("## Measured", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in measured.splitlines() if line.startswith("| ")
            and "`python benchmarks/" in line]
    assert rows and all("<!-- figures:" in row for row in rows)


def test_a_changed_measurement_makes_its_span_stale(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(figures.RESULTS, results)
    data = json.loads((results / "events.json").read_text())
    data["hashes_per_s"] *= 2
    (results / "events.json").write_text(json.dumps(data))
    assert figures.stale_spans(results) == ["README.md:events"]
