"""Output formats: ruff-like text, JSON, SARIF 2.1.0, GitHub annotations, statistics."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

from audit.model import RULES, Finding, Severity

TOOL_NAME = "kvtier-audit"
TOOL_VERSION = "0.1.0"
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
_SARIF_LEVEL = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "note"}
_GITHUB_LEVEL = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "notice"}


def _confidence(f: Finding) -> str:
    return f" [confidence: {f.confidence}, {f.why}]" if f.confidence else ""


def text(findings: Sequence[Finding], show_fixes: bool = True) -> str:
    """``path:line:col: CODE [severity] message`` per finding, the fix indented below."""
    lines = []
    for f in findings:
        lines.append(f"{f.path}:{f.line}:{f.col}: {f.code} [{f.severity}] {f.message}"
                     f"{_confidence(f)}")
        if show_fixes and f.fix:
            lines.append(f"    fix: {f.fix}")
    return "\n".join(lines)


def to_json(findings: Sequence[Finding], files: int, parsed: int) -> str:
    """``{"findings": [...], "files": n, "parsed": n, "counts": {code: n}}``."""
    counts = Counter(f.code for f in findings)
    return json.dumps({"findings": [f.to_dict() for f in findings], "files": files,
                       "parsed": parsed, "counts": dict(sorted(counts.items()))}, indent=2)


def sarif(findings: Sequence[Finding]) -> str:
    """A SARIF 2.1.0 log with one run; rules carry their default level and help."""
    codes = sorted(RULES)
    rules = [{
        "id": code, "name": RULES[code].name,
        "shortDescription": {"text": RULES[code].summary},
        "fullDescription": {"text": RULES[code].summary},
        "help": {"text": RULES[code].help},
        "defaultConfiguration": {"level": _SARIF_LEVEL[RULES[code].severity]},
    } for code in codes]
    results = []
    for f in findings:
        region = {"startLine": f.line, "startColumn": f.col}
        if f.end_line:
            region |= {"endLine": f.end_line, "endColumn": max(f.end_col, 1)}
        result = {
            "ruleId": f.code, "ruleIndex": codes.index(f.code),
            "level": _SARIF_LEVEL[f.severity],
            "message": {"text": f"{f.message}. Fix: {f.fix}" if f.fix else f.message},
            "locations": [{"physicalLocation": {
                "artifactLocation": _artifact(f.path),
                "region": region}}],
        }
        if f.confidence:
            result["properties"] = {"confidence": str(f.confidence), "evidence": f.why}
        results.append(result)
    log = {"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [{
        "tool": {"driver": {"name": TOOL_NAME, "version": TOOL_VERSION,
                            "informationUri": "https://github.com/kvtier/kvtier",
                            "rules": rules}},
        "results": results,
    }]}
    return json.dumps(log, indent=2)


def _artifact(path: str) -> dict[str, str]:
    """A SARIF artifact location: relative to the working directory when possible."""
    p = Path(path)
    if p.is_absolute():
        try:
            p = p.relative_to(Path.cwd())
        except ValueError:
            return {"uri": p.as_uri()}
    text = p.as_posix()
    return {"uri": quote(text[2:] if text.startswith("./") else text),
            "uriBaseId": "%SRCROOT%"}


def _gh_escape(value: str, prop: bool = False) -> str:
    value = value.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return value.replace(":", "%3A").replace(",", "%2C") if prop else value


def github(findings: Sequence[Finding]) -> str:
    """GitHub Actions workflow commands: ``::error file=..,line=..,col=..::message``."""
    out = []
    for f in findings:
        props = (f"file={_gh_escape(f.path, True)},line={f.line},col={f.col},"
                 f"endLine={f.end_line or f.line},title={f.code}")
        out.append(f"::{_GITHUB_LEVEL[f.severity]} {props}::"
                   f"{_gh_escape(f'{f.code} {f.message}. Fix: {f.fix}')}")
    return "\n".join(out)


def statistics(findings: Sequence[Finding], files: int | None = None) -> str:
    """Counts per code, most frequent first, like ``ruff --statistics``; a clean run says
    ``0 findings`` (in how many files, when known) rather than printing nothing."""
    counts = Counter(f.code for f in findings)
    if not counts:
        return "    0  findings" + (f" in {files} file(s)" if files is not None else "")
    return "\n".join(f"{n:>5}  {code}  [{RULES[code].severity}] {RULES[code].name}"
                     for code, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
