"""The command: exit codes, formats, configuration, suppression, skips, parallelism, --diff."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path

import pytest

from audit.cli import main
from audit.config import Settings
from audit.engine import run

REPO = Path(__file__).resolve().parents[2]

BAD = """
def count(blocks: list[KVCacheBlock], block_size: int) -> int:
    n = 0
    for i, blk in enumerate(blocks):
        if blk.block_hash is not None:
            n += 1
    return n
"""
UNCLEAR = """
def f(blk: KVCacheBlock) -> None:
    if blk.block_hash is not None:
        log("x")
"""
INFO = """
def is_block_writable(block: KVCacheBlock) -> bool:
    return block.ref_cnt == 1 and block.block_hash is None
"""
CLEAN = """
def count(blocks: list[KVCacheBlock], block_size: int) -> int:
    return sum(b.block_hash_num_tokens == (i + 1) * block_size for i, b in enumerate(blocks))
"""


def write(root: Path, name: str, text: str) -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def audit(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_exit_codes_clean_findings_and_usage(tmp_path: Path, capsys) -> None:
    clean = write(tmp_path, "clean.py", CLEAN)
    bad = write(tmp_path, "bad.py", BAD)
    assert audit(capsys, "--isolated", str(clean))[0] == 0
    rc, out, _ = audit(capsys, "--isolated", str(bad))
    assert rc == 1
    first = out.splitlines()[0]
    assert first.startswith(f"{bad}:5:12: KVT001 [error] counts blocks")
    assert "confidence: high" in first
    assert out.splitlines()[1].strip().startswith("fix: decide fullness")
    assert audit(capsys, "--isolated", "--bogus-flag", str(bad))[0] == 2
    assert audit(capsys, "--isolated", str(tmp_path / "missing.py"))[0] == 2
    assert audit(capsys, "--isolated", "--fail-on", "nope", str(bad))[0] == 2


def test_fail_on_and_min_severity(tmp_path: Path, capsys) -> None:
    warn = write(tmp_path, "warn.py", UNCLEAR)
    info = write(tmp_path, "info.py", INFO)
    rc, out, _ = audit(capsys, "--isolated", str(warn))
    assert rc == 0 and "KVT005 [warning]" in out  # reported, but below the default fail-on
    assert audit(capsys, "--isolated", "--fail-on", "warning", str(warn))[0] == 1
    rc, out, _ = audit(capsys, "--isolated", str(info))
    assert rc == 0 and out == ""  # info hidden by default
    rc, out, _ = audit(capsys, "--isolated", "--min-severity", "info", "--fail-on", "info",
                       str(info))
    assert rc == 1 and "KVT006 [info]" in out
    bad = write(tmp_path, "bad.py", BAD)
    assert audit(capsys, "--isolated", "--fail-on", "never", str(bad))[0] == 0


def test_json_sarif_github_statistics(tmp_path: Path, capsys) -> None:
    bad = write(tmp_path, "bad.py", BAD)
    write(tmp_path, "warn.py", UNCLEAR)
    rc, out, _ = audit(capsys, "--isolated", "--format", "json", str(tmp_path))
    data = json.loads(out)
    assert rc == 1 and data["files"] == 2 and data["counts"] == {"KVT001": 1, "KVT005": 1}
    first = data["findings"][0]
    assert first["path"] == str(bad) and first["severity"] == "error"
    assert first["confidence"] == "high" and first["fix"]

    _, out, _ = audit(capsys, "--isolated", "--format", "sarif", str(tmp_path))
    log = json.loads(out)
    assert log["version"] == "2.1.0"
    (run_,) = log["runs"]
    rule_ids = [r["id"] for r in run_["tool"]["driver"]["rules"]]
    levels = sorted(r["level"] for r in run_["results"])
    assert levels == ["error", "warning"]
    for result in run_["results"]:
        assert rule_ids[result["ruleIndex"]] == result["ruleId"]
        region = result["locations"][0]["physicalLocation"]["region"]
        assert region["startLine"] >= 1 and region["startColumn"] >= 1

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        _, out, _ = audit(capsys, "--isolated", "--format", "sarif", ".")
    finally:
        os.chdir(cwd)
    uris = {r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
            for r in json.loads(out)["runs"][0]["results"]}
    assert uris == {"bad.py", "warn.py"}
    outside = json.loads(audit(capsys, "--isolated", "--format", "sarif", str(bad))[1])
    uri = outside["runs"][0]["results"][0]["locations"][0]["physicalLocation"][
        "artifactLocation"]["uri"]
    assert uri == bad.as_uri() or not uri.startswith("/")

    _, out, _ = audit(capsys, "--isolated", "--format", "github", str(tmp_path))
    lines = out.splitlines()
    assert lines[0].startswith(f"::error file={bad},line=5,col=12,")
    assert "title=KVT001::" in lines[0]
    assert lines[1].startswith("::warning ")

    _, out, _ = audit(capsys, "--isolated", "--statistics", str(tmp_path))
    assert out.split() == ["1", "KVT001", "[error]", "count-by-hash-presence",
                           "1", "KVT005", "[warning]", "presence-test-unclear"]


def test_sarif_rules_carry_no_unfilled_template(tmp_path: Path, capsys) -> None:
    """Rule-level texts are read by people (code scanning's rule help): no ``{recv}``-style
    placeholder left for a finding to fill."""
    write(tmp_path, "bad.py", BAD)
    log = json.loads(audit(capsys, "--isolated", "--format", "sarif", str(tmp_path))[1])
    rules = log["runs"][0]["tool"]["driver"]["rules"]
    assert {r["id"] for r in rules} >= {"KVT001", "KVT005", "KVT006"}
    for rule in rules:
        for field in ("shortDescription", "fullDescription", "help"):
            text = rule[field]["text"]
            assert text and not re.search(r"\{[^{}]*\}", text), (rule["id"], field, text)
    by_id = {r["id"]: r["help"]["text"] for r in rules}
    assert "`block.block_hash_num_tokens == (i + 1) * block_size`" in by_id["KVT001"]
    assert "`# kvtier: ignore[KVT005]`" in by_id["KVT005"]


def test_statistics_on_a_clean_tree_says_zero(tmp_path: Path, capsys) -> None:
    write(tmp_path, "clean.py", CLEAN)
    write(tmp_path, "other.py", "x = 1\n")
    rc, out, _ = audit(capsys, "--isolated", "--statistics", str(tmp_path))
    assert rc == 0 and out.split() == ["0", "findings", "in", "2", "file(s)"]


def test_output_file(tmp_path: Path, capsys) -> None:
    bad = write(tmp_path, "bad.py", BAD)
    report = tmp_path / "out" / "report.json"
    report.parent.mkdir()
    rc, out, _ = audit(capsys, "--isolated", "--format", "json", "-o", str(report), str(bad))
    assert rc == 1 and out == ""
    assert json.loads(report.read_text())["counts"] == {"KVT001": 1}
    rc, _, err = audit(capsys, "--isolated", "-o", str(tmp_path / "no" / "dir.txt"), str(bad))
    assert rc == 2 and "cannot write" in err


def test_pyproject_configuration(tmp_path: Path, capsys) -> None:
    write(tmp_path, "pyproject.toml", """
        [tool.kvtier.audit]
        include = ["pkg"]
        exclude = ["pkg/generated/*"]
        fail-on = "warning"
        block-containers = ["my_block_list"]
    """)
    write(tmp_path, "pkg/warn.py", UNCLEAR)
    write(tmp_path, "pkg/generated/bad.py", BAD)
    write(tmp_path, "other/bad.py", BAD)
    write(tmp_path, "pkg/custom.py", """
        def f(mgr):
            return sum(b.block_hash is not None for b in mgr.my_block_list)
    """)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        rc, out, _ = audit(capsys, "--format", "json")  # no PATH: the include list
    finally:
        os.chdir(cwd)
    data = json.loads(out)
    paths = sorted(Path(f["path"]).as_posix() for f in data["findings"])
    assert paths == [f"{(tmp_path / 'pkg/custom.py').as_posix()}",
                     f"{(tmp_path / 'pkg/warn.py').as_posix()}"]
    custom = next(f for f in data["findings"] if f["path"].endswith("custom.py"))
    assert custom["code"] == "KVT001" and custom["confidence"] == "medium"
    assert rc == 1  # fail-on = warning from the config
    # The same tree audited explicitly: exclude still applies, include does not.
    rc, out, _ = audit(capsys, "--format", "json", str(tmp_path))
    found = {Path(f["path"]).relative_to(tmp_path).as_posix()
             for f in json.loads(out)["findings"]}
    assert found == {"pkg/warn.py", "pkg/custom.py", "other/bad.py"}
    # The command line overrides the config.
    assert audit(capsys, "--fail-on", "error", str(tmp_path / "pkg"))[0] == 1
    assert audit(capsys, "--fail-on", "never", str(tmp_path / "pkg"))[0] == 0


@pytest.mark.parametrize(("table", "message"), [
    ('colour = "red"', "unknown [tool.kvtier.audit] key"),
    ('fail-on = "fatal"',
     "fail-on: unknown value 'fatal' (allowed: info, warning, error, never)"),
    ('min-severity = "never"',
     "min-severity: unknown value 'never' (allowed: info, warning, error)"),
    ("block-containers = \"x\"", "must be a list of strings"),
    ("max-file-size = -1", "non-negative integer"),
])
def test_bad_configuration_is_a_usage_error(tmp_path: Path, capsys, table, message) -> None:
    write(tmp_path, "pyproject.toml", f"[tool.kvtier.audit]\n{table}\n")
    write(tmp_path, "a.py", BAD)
    rc, _, err = audit(capsys, str(tmp_path / "a.py"))
    assert rc == 2 and message in err


def test_broken_toml_is_a_usage_error(tmp_path: Path, capsys) -> None:
    write(tmp_path, "pyproject.toml", "[tool.kvtier.audit\n")
    write(tmp_path, "a.py", BAD)
    rc, _, err = audit(capsys, str(tmp_path / "a.py"))
    assert rc == 2 and "cannot read configuration" in err


def test_unparsable_binary_and_huge_files_are_reported_and_skipped(tmp_path: Path,
                                                                    capsys) -> None:
    write(tmp_path, "broken.py", "def f(:\n    x.block_hash is None\n")
    (tmp_path / "blob.py").write_bytes(b"\x00\x01block_hash\x00" * 10)
    write(tmp_path, "huge.py", BAD + "# block_hash\n" * 2000)
    write(tmp_path, "bad.py", BAD)
    write(tmp_path, "pyproject.toml", "[tool.kvtier.audit]\nmax-file-size = 10000\n")
    rc, out, err = audit(capsys, "--format", "json", "--min-severity", "info", str(tmp_path))
    data = json.loads(out)
    by_file = {Path(f["path"]).name: f["code"] for f in data["findings"]}
    assert by_file == {"broken.py": "KVT900", "blob.py": "KVT901", "huge.py": "KVT901",
                       "bad.py": "KVT001"}
    assert rc == 1 and data["files"] == 4
    rc, out, err = audit(capsys, str(tmp_path))  # text: the parse error is a warning
    assert "broken.py:1:7: KVT900 [warning]" in out and "2 skipped" in err


def test_parallel_run_matches_serial(tmp_path: Path) -> None:
    for i in range(40):
        write(tmp_path, f"m{i:02d}.py", BAD if i % 3 else UNCLEAR)
    serial = run([tmp_path], Settings(jobs=1))
    parallel = run([tmp_path], Settings(jobs=2))
    assert serial.findings == parallel.findings
    assert len(serial.findings) == 40 and serial.parsed == 40


def test_diff_suggests_rewrite_only_where_index_and_size_are_known(tmp_path: Path,
                                                                     capsys) -> None:
    bad = write(tmp_path, "bad.py", BAD)
    rc, out, _ = audit(capsys, "--isolated", "--diff", str(bad))
    assert rc == 1
    assert f"--- a/{str(bad).lstrip('/')}" in out
    assert "-        if blk.block_hash is not None:" in out
    assert "+        if blk.block_hash_num_tokens == (i + 1) * block_size:" in out
    no_size = write(tmp_path, "nosize.py", BAD.replace(", block_size: int", ""))
    rc, out, _ = audit(capsys, "--isolated", "--diff", str(no_size))
    assert rc == 1 and out == ""


def test_diff_negated_truthiness(tmp_path: Path, capsys) -> None:
    src = write(tmp_path, "neg.py", """
        def f(blocks: list[KVCacheBlock], block_size: int) -> list[KVCacheBlock]:
            out = []
            for i, blk in enumerate(blocks):
                if not blk.block_hash:
                    out.append(blk)
            return out
    """)
    _, out, _ = audit(capsys, "--isolated", "--diff", str(src))
    assert "+        if blk.block_hash_num_tokens != (i + 1) * block_size:" in out


def test_python_dash_m_and_kvtier_entry_point(tmp_path: Path) -> None:
    bad = write(tmp_path, "bad.py", BAD)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    mod = subprocess.run([sys.executable, "-m", "audit", "--isolated", str(bad)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert mod.returncode == 1 and "KVT001" in mod.stdout
    kvtier = Path(sys.executable).with_name("kvtier")
    cli = subprocess.run([str(kvtier), "audit", "--isolated", str(bad)], capture_output=True,
                         text=True, timeout=120)
    assert cli.returncode == 1 and cli.stdout == mod.stdout


def test_runs_in_a_bare_python_without_site_packages(tmp_path: Path) -> None:
    """-S -I: no site-packages, no user env; importing audit must pull nothing heavy."""
    bad = write(tmp_path, "bad.py", BAD)
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from audit.cli import main; "
            f"rc = main(['--isolated', {str(bad)!r}]); heavy = [m for m in ('vllm', 'torch', "
            "'connector', 'offload_tiers', 'msgspec') if m in sys.modules]; "
            "print('HEAVY', heavy); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-S", "-I", "-c", code], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "KVT001" in proc.stdout and "HEAVY []" in proc.stdout


#: A comment that would suppress an audit finding: ``kvtier: ignore``, a bare ``noqa``, or a
#: ``noqa`` naming a KVT code.
_HIDES = re.compile(r"kvtier:\s*ignore|noqa(?!\s*:)|noqa\s*:[^#]*\bKVT", re.I)


def test_kvtier_passes_its_own_audit(capsys) -> None:
    """No finding at any severity or confidence, with no configuration and no suppression
    comment that could hide one."""
    roots = [REPO / "connector", REPO / "offload_tiers", REPO / "audit"]
    rc, out, _ = audit(capsys, "--isolated", "--format", "json", "--min-severity", "info",
                       "--min-confidence", "low", "--fail-on", "info", *map(str, roots))
    data = json.loads(out)
    assert data["findings"] == [] and data["counts"] == {}, out
    assert rc == 0
    assert data["parsed"] >= 10 and data["files"] > data["parsed"]  # it really looked
    hiding = [f"{path}:{tok.start[0]}" for root in roots for path in sorted(root.rglob("*.py"))
              for tok in tokenize.generate_tokens(io.StringIO(path.read_text("utf-8")).readline)
              if tok.type == tokenize.COMMENT and _HIDES.search(tok.string)]
    assert hiding == [], hiding


def test_pre_commit_hook_definition() -> None:
    text = (REPO / ".pre-commit-hooks.yaml").read_text()
    assert "id: kvtier-audit" in text and "entry: scripts/kvtier_audit_hook.py" in text
    assert "types: [python]" in text  # the rest: tests/audit/test_hook.py


def test_hostile_inputs_are_reported_not_crashes(tmp_path: Path, capsys) -> None:
    head = "def f(blk: KVCacheBlock):\n    return "
    write(tmp_path, "deep_expr.py", head + " + ".join(["1"] * 2500)
          + " + (blk.block_hash is not None)\n")
    write(tmp_path, "too_deep.py", head + " + ".join(["1"] * 20000) + " + blk.block_hash\n")
    (tmp_path / "bad_utf8.py").write_bytes(b'x = "\xff\xfe"  # block_hash\n')
    (tmp_path / "late_nul.py").write_bytes(b"a = 1\n" * 5000 + b"\x00 block_hash\n")
    (tmp_path / "empty.py").write_bytes(b"")
    rc, out, _ = audit(capsys, "--isolated", "--format", "json", "--min-severity", "info",
                       str(tmp_path))
    by_file = {Path(f["path"]).name: f["code"] for f in json.loads(out)["findings"]}
    assert by_file == {"deep_expr.py": "KVT005", "too_deep.py": "KVT900",
                       "bad_utf8.py": "KVT900", "late_nul.py": "KVT900"}
    assert rc == 0  # warnings only


@pytest.mark.parametrize("toml", ["[tool]\nkvtier = 1\n", "[tool.kvtier]\naudit = [1]\n"])
def test_config_of_the_wrong_shape_is_a_usage_error(tmp_path: Path, capsys, toml) -> None:
    write(tmp_path, "pyproject.toml", toml)
    write(tmp_path, "a.py", BAD)
    rc, _, err = audit(capsys, str(tmp_path / "a.py"))
    assert rc == 2 and "must be a table" in err


def test_internal_error_on_one_file_exits_2_and_audits_the_rest(tmp_path: Path, capsys,
                                                                   monkeypatch) -> None:
    from audit import rules

    write(tmp_path, "a_bad.py", BAD)
    write(tmp_path, "b_boom.py", BAD)
    real_run = rules.Checker.run

    def flaky_run(self):  # fault injection: the checker breaks on one file
        if self.path.endswith("b_boom.py"):
            raise KeyError("injected")
        return real_run(self)

    monkeypatch.setattr(rules.Checker, "run", flaky_run)
    rc, out, err = audit(capsys, "--isolated", "--jobs", "1", str(tmp_path))
    assert rc == 2
    assert "a_bad.py:5:12: KVT001" in out
    assert "b_boom.py:1:1: KVT902 [error]" in out and "KeyError" in out
    assert "internal error" in err


def test_vanished_file_is_skipped(tmp_path: Path) -> None:
    from audit.engine import audit_file

    result = audit_file(str(tmp_path / "gone.py"), Settings())
    assert [f.code for f in result.findings] == ["KVT901"]


def test_empty_directory_says_so(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    rc, out, err = audit(capsys, "--isolated", str(tmp_path / "empty"))
    assert rc == 0 and out == "" and "no Python files found" in err


def test_select_ignore_and_per_file_ignores(tmp_path: Path, capsys) -> None:
    write(tmp_path, "pkg/bad.py", BAD)
    write(tmp_path, "pkg/warn.py", UNCLEAR)
    write(tmp_path, "tests/test_x.py", BAD)

    def codes(*argv: str) -> list[tuple[str, str]]:
        out = audit(capsys, "--format", "json", *argv, str(tmp_path))[1]
        return sorted((Path(f["path"]).name, f["code"]) for f in json.loads(out)["findings"])

    write(tmp_path, "pyproject.toml", "[tool.kvtier.audit]\n")
    everything = [("bad.py", "KVT001"), ("test_x.py", "KVT001"), ("warn.py", "KVT005")]
    assert codes() == everything
    assert codes("--select", "KVT005") == [("warn.py", "KVT005")]
    assert codes("--ignore", "KVT005,KVT001") == []
    write(tmp_path, "pyproject.toml", '[tool.kvtier.audit]\nignore = ["KVT005"]\n'
          '[tool.kvtier.audit.per-file-ignores]\n"tests/*" = ["KVT001"]\n')
    assert codes() == [("bad.py", "KVT001")]
    write(tmp_path, "pyproject.toml", '[tool.kvtier.audit]\nselect = ["KVT999"]\n')
    rc, _, err = audit(capsys, str(tmp_path))
    assert rc == 2 and "unknown code(s) KVT999" in err
