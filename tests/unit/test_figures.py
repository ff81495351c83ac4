"""The figures README.md and docs quote are what the committed benchmark JSON renders to."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from benchmarks import figures


def test_every_quoted_figure_equals_its_json() -> None:
    assert figures.stale_spans() == [], "run `make bench` or `python -m benchmarks.figures render`"


def test_every_renderer_is_quoted_and_every_benchmark_row_is_rendered() -> None:
    texts = {doc: (figures.REPO / doc).read_text() for doc in figures.DOCUMENTS}
    quoted = {m["name"] for text in texts.values() for m in figures.SPAN.finditer(text)}
    assert quoted == set(figures.RENDERERS)
    # the front page's headline rows, and every benchmark's row in docs/benchmarks.md
    for doc, heading in (("README.md", "## Measured"), ("docs/benchmarks.md", "# Measured")):
        measured = texts[doc].split(heading, 1)[1].split("\n## ", 1)[0]
        rows = [line for line in measured.splitlines() if line.startswith("| ")
                and "`python -m benchmarks." in line]
        assert rows and all("<!-- figures:" in row for row in rows), doc


def test_a_changed_measurement_makes_its_span_stale(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(figures.RESULTS, results)
    data = json.loads((results / "events.json").read_text())
    data["hashes_per_s"] *= 2
    (results / "events.json").write_text(json.dumps(data))
    assert figures.stale_spans(results) == ["README.md:events", "docs/benchmarks.md:events"]


def test_every_result_records_its_date_command_load_and_commit() -> None:
    assert figures.unstamped() == [], "stamp it: `python -m benchmarks.figures stamp FILE -- CMD`"


def test_a_result_without_a_stamp_field_fails_the_check(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(figures.RESULTS, results)
    data = json.loads((results / "gil.json").read_text())
    del data["_measured"]["commit"]
    (results / "gil.json").write_text(json.dumps(data))
    data = json.loads((results / "route.json").read_text())
    data["_measured"]["load_avg"] = ""
    (results / "route.json").write_text(json.dumps(data))
    assert figures.unstamped(results) == ["gil.json: commit", "route.json: load_avg"]


def test_stamp_records_the_commit(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"x": 1}))
    figures.stamp(path, ["bench.py", "--quick"])
    meta = json.loads(path.read_text())["_measured"]
    assert set(figures.STAMP_FIELDS) <= set(meta) and meta["command"] == "bench.py --quick"
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=figures.REPO,
                          capture_output=True, text=True, check=True).stdout.strip()
    assert meta["commit"] in (head, f"{head}+dirty")


def test_a_figure_of_several_runs_names_each_run_where_they_differ() -> None:
    """The hooks span joins six runs made at two loads and from two commits: it says so."""
    text = figures.render_span("hooks")
    assert "separate runs:" in text
    loads = {json.loads((figures.RESULTS / f).read_text())["_measured"]["load_avg"]
             for f in figures.RENDERERS["hooks"][0]}
    assert all(f"load {load}" in text for load in loads)
    same = {"date": "2026-01-01", "load_avg": "1.0", "commit": "abc1234"}
    runs = [(name, {"_measured": dict(same)}) for name in ("a", "b")]
    assert figures.when_runs(*runs) == "2026-01-01, load 1.0"
    runs[1][1]["_measured"]["commit"] = "def5678"
    assert figures.when_runs(*runs) == ("separate runs: a 2026-01-01, load 1.0, commit abc1234; "
                                        "b 2026-01-01, load 1.0, commit def5678")
