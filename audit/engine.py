"""Run the checker over files: discovery, skipping, suppression comments, parallelism."""

from __future__ import annotations

import ast
import multiprocessing
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from fnmatch import fnmatch
from pathlib import Path

from audit.config import DEFAULT_EXCLUDE_DIRS, Settings
from audit.model import RULES, Finding
from audit.rules import Checker

TOKEN = b"block_hash"  # a file without it cannot hold a finding: skip the parse
_NOQA = re.compile(r"#\s*noqa(?::\s*(?P<codes>[A-Z]+\d+(?:[\s,]+[A-Z]+\d+)*))?", re.I)
_IGNORE = re.compile(r"#\s*kvtier:\s*ignore(?:\[(?P<codes>[^\]]*)\])?", re.I)
# Candidate files (those mentioning block_hash) below which an automatic process pool costs
# more than it saves (pool start ~0.1-0.2 s vs ~8 ms parse+check per file). --jobs N forces it.
_PARALLEL_MIN = 64


@dataclass(slots=True)
class FileResult:
    """What auditing one file produced."""

    path: str
    findings: list[Finding] = field(default_factory=list)
    source: str | None = None  # kept only when a diff is wanted
    parsed: bool = False


@dataclass(slots=True)
class RunResult:
    """A whole run: findings (sorted), file counts and per-file sources for ``--diff``."""

    findings: list[Finding]
    files: int = 0
    parsed: int = 0
    skipped: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)


# ----------------------------------------------------------------- discovery
def discover(paths: Sequence[Path], settings: Settings) -> Iterator[Path]:
    """Python files under ``paths``; explicit files always, walked ones filtered by excludes."""
    seen: set[Path] = set()
    for path in paths:
        if path.is_file():
            if path not in seen:
                seen.add(path)
                yield path
            continue
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if d not in DEFAULT_EXCLUDE_DIRS
                                 and not d.endswith(".egg-info")
                                 and not _excluded(Path(dirpath, d), settings))
            for name in sorted(filenames):
                if not name.endswith((".py", ".pyi")):
                    continue
                file = Path(dirpath, name)
                if file not in seen and not _excluded(file, settings):
                    seen.add(file)
                    yield file


def _excluded(path: Path, settings: Settings) -> bool:
    if not settings.exclude:
        return False
    try:
        rel = path.resolve().relative_to(settings.root.resolve()).as_posix()
    except ValueError:
        rel = path.as_posix()
    return any(fnmatch(rel, pat) or fnmatch(path.name, pat) or fnmatch(rel, pat.rstrip("/")
               + "/*") for pat in settings.exclude)


def default_targets(settings: Settings) -> list[Path]:
    """What ``kvtier audit`` without PATH audits: ``include`` globs, else the project root."""
    if not settings.include:
        return [settings.root]
    targets: list[Path] = []
    for pattern in settings.include:
        matches = sorted(settings.root.glob(pattern))
        targets.extend(matches)
    return targets


# --------------------------------------------------------------- one file
def audit_source(source: str | bytes, path: str = "<string>",
                 settings: Settings | None = None) -> list[Finding]:
    """Findings for one module's text (suppressions applied, thresholds not)."""
    settings = settings or Settings()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences etc. are not ours
            tree = ast.parse(source, filename=path)
    except (RecursionError, MemoryError) as exc:
        rule = RULES["KVT900"]
        return [Finding(path, 1, 1, rule.code, rule.severity,
                        f"{rule.summary}: nested too deeply ({type(exc).__name__})", rule.fix)]
    except (SyntaxError, ValueError) as exc:
        line = getattr(exc, "lineno", None) or 1
        col = getattr(exc, "offset", None) or 1
        msg = getattr(exc, "msg", None) or str(exc)
        rule = RULES["KVT900"]
        return [Finding(path, line, col, rule.code, rule.severity,
                        f"{rule.summary}: {msg}", rule.fix)]
    raw = source if isinstance(source, bytes) else source.encode("utf-8", "surrogatepass")
    hash_lines = [i for i, line in enumerate(raw.splitlines(), 1) if TOKEN in line]
    if not hash_lines:
        return []
    try:
        findings = Checker(path, tree, settings.vocab, settings.bookkeeping, hash_lines).run()
    except RecursionError:
        rule = RULES["KVT900"]
        return [Finding(path, 1, 1, rule.code, rule.severity,
                        "file was not audited: nested too deeply to check", rule.fix)]
    if not findings:
        return findings
    lines = raw.decode("utf-8", "replace").splitlines()
    byte_lines = raw.splitlines()
    return [_char_columns(f, byte_lines) for f in findings if not _suppressed(f, lines)]


def _char_columns(finding: Finding, byte_lines: list[bytes]) -> Finding:
    """ast columns count UTF-8 bytes; report characters, like ruff."""
    def chars(line: int, col: int) -> int:
        if not 0 < line <= len(byte_lines) or byte_lines[line - 1].isascii():
            return col
        return len(byte_lines[line - 1][: col - 1].decode("utf-8", "replace")) + 1

    col, end_col = chars(finding.line, finding.col), chars(finding.end_line, finding.end_col)
    if (col, end_col) == (finding.col, finding.end_col):
        return finding
    return replace(finding, col=col, end_col=end_col)


def _suppressed(finding: Finding, lines: list[str]) -> bool:
    for lineno in {finding.line, finding.end_line or finding.line}:
        if not 0 < lineno <= len(lines):
            continue
        line = lines[lineno - 1]
        if "#" not in line:
            continue
        for pattern in (_NOQA, _IGNORE):
            match = pattern.search(line)
            if match is None:
                continue
            codes = match.group("codes")
            if codes is None or not codes.strip():
                return True
            if finding.code in {c.upper() for c in re.split(r"[\s,]+", codes) if c}:
                return True
    return False


def audit_file(path: str, settings: Settings, keep_source: bool = False) -> FileResult:
    """Audit one file on disk; binary, undecodable and huge files become a KVT901 skip."""
    result = FileResult(path)
    rule = RULES["KVT901"]
    try:
        size = os.path.getsize(path)
        if settings.max_file_size and size > settings.max_file_size:
            result.findings.append(Finding(path, 1, 1, rule.code, rule.severity,
                                           f"{rule.summary}: {size} bytes", rule.fix))
            return result
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        result.findings.append(Finding(path, 1, 1, rule.code, rule.severity,
                                       f"{rule.summary}: {exc.strerror or exc}", rule.fix))
        return result
    if TOKEN not in data:
        return result
    if b"\x00" in data[:8192]:
        result.findings.append(Finding(path, 1, 1, rule.code, rule.severity,
                                       f"{rule.summary}: binary content", rule.fix))
        return result
    result.parsed = True
    try:
        result.findings = audit_source(data, path, settings)
    except Exception as exc:  # a bug of ours on this file: say so, keep auditing the rest
        bug = RULES["KVT902"]
        result.findings = [Finding(path, 1, 1, bug.code, bug.severity,
                                   f"{bug.summary}: {type(exc).__name__}: {exc}", bug.fix)]
    if keep_source and result.findings:
        result.source = data.decode("utf-8", "replace")
    return result


def _audit_chunk(args: tuple[list[str], Settings, bool]) -> list[FileResult]:
    paths, settings, keep = args
    return [audit_file(p, settings, keep) for p in paths]


# ------------------------------------------------------------------ whole run
def run(paths: Sequence[Path], settings: Settings, keep_sources: bool = False) -> RunResult:
    """Audit every discovered file, in parallel when it pays; findings sorted by location."""
    files = [str(p) for p in discover(paths, settings)]
    candidates, results = _prefilter(files, settings)
    jobs = settings.jobs or os.cpu_count() or 1
    wanted = len(candidates) >= (2 if settings.jobs else _PARALLEL_MIN)
    if jobs > 1 and wanted:
        chunks = [candidates[i::jobs * 4] for i in range(jobs * 4)]
        ctx = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            for chunk in pool.map(_audit_chunk, [(c, settings, keep_sources) for c in chunks
                                                 if c]):
                results.extend(chunk)
    else:
        results.extend(audit_file(p, settings, keep_sources) for p in candidates)
    out = RunResult(findings=[], files=len(files))
    for res in results:
        out.parsed += res.parsed
        for f in res.findings:
            if f.code == "KVT901":
                out.skipped.append(f.path)
        out.findings.extend(res.findings)
        if res.source is not None:
            out.sources[res.path] = res.source
    out.findings = [f for f in out.findings if _selected(f, settings)]
    out.findings.sort(key=lambda f: (f.path, f.line, f.col, f.code))
    return out


def _selected(finding: Finding, settings: Settings) -> bool:
    """``select`` / ``ignore`` / ``per-file-ignores`` from the configuration or flags."""
    if settings.select and finding.code not in settings.select:
        return False
    if finding.code in settings.ignore:
        return False
    if settings.per_file_ignores:
        path = Path(finding.path)
        try:
            rel = path.resolve().relative_to(settings.root.resolve()).as_posix()
        except ValueError:
            rel = path.as_posix()
        for glob, codes in settings.per_file_ignores:
            if finding.code in codes and (fnmatch(rel, glob) or fnmatch(path.name, glob)):
                return False
    return True


def _prefilter(files: list[str], settings: Settings) -> tuple[list[str], list[FileResult]]:
    """Files that mention ``block_hash`` (cheap byte search), and skips found on the way."""
    candidates: list[str] = []
    skipped: list[FileResult] = []
    for path in files:
        try:
            size = os.path.getsize(path)
            if settings.max_file_size and size > settings.max_file_size:
                skipped.append(audit_file(path, settings))
                continue
            with open(path, "rb") as fh:
                if TOKEN in fh.read():
                    candidates.append(path)
        except OSError:
            skipped.append(audit_file(path, settings))
    return candidates, skipped
