"""``kvtier audit`` / ``python -m audit``: exit 0 clean, 1 findings at/above --fail-on, 2 error."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from audit import config as cfg
from audit import reporters
from audit.engine import RunResult, default_targets, run
from audit.fixes import unified_diff
from audit.model import Finding, Severity

SEVERITIES = ("info", "warning", "error")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvtier audit",
        description="Flag code that treats a KV-cache block's block_hash presence as "
                    "'full block' (use block_hash_num_tokens instead).")
    p.add_argument("paths", nargs="*", type=Path,
                   help="files or directories (default: [tool.kvtier.audit] include, else .)")
    p.add_argument("--format", choices=("text", "json", "sarif", "github"), default="text")
    p.add_argument("--fail-on", choices=(*SEVERITIES, "never"),
                   help="lowest severity that makes the exit code 1 (default: error)")
    p.add_argument("--min-severity", choices=SEVERITIES,
                   help="lowest severity reported (default: warning)")
    p.add_argument("--min-confidence", choices=("low", "medium", "high"),
                   help="lowest receiver confidence reported (default: low)")
    p.add_argument("--statistics", action="store_true", help="print counts per code only")
    p.add_argument("--diff", action="store_true",
                   help="print suggested rewrites as a unified diff (where index and block "
                        "size are in scope)")
    p.add_argument("--no-fixes", action="store_true", help="text format: omit the fix lines")
    p.add_argument("--config", type=Path, help="pyproject.toml to read (default: nearest)")
    p.add_argument("--isolated", action="store_true", help="ignore every pyproject.toml")
    p.add_argument("--select", help="comma-separated codes to report (default: all)")
    p.add_argument("--ignore", help="comma-separated codes not to report")
    p.add_argument("--extend-block-containers", default="",
                   help="comma-separated extra names whose value is a list of blocks")
    p.add_argument("-j", "--jobs", type=int, help="worker processes (default: CPUs)")
    p.add_argument("-o", "--output", type=Path, help="write the report to a file")
    return p


def _settings(args: argparse.Namespace) -> cfg.Settings:
    if args.isolated:
        settings = cfg.Settings()
    else:
        start = args.config or (args.paths[0] if args.paths else Path.cwd())
        if args.config is not None and not args.config.is_file():
            raise cfg.ConfigError(f"--config {args.config}: no such file")
        settings = cfg.load(args.config or cfg.find_pyproject(start))
    overlay: dict[str, object] = {}
    for flag, key in (("fail_on", "fail-on"), ("min_severity", "min-severity"),
                      ("min_confidence", "min-confidence"), ("jobs", "jobs")):
        if getattr(args, flag) is not None:
            overlay[key] = getattr(args, flag)
    for flag in ("select", "ignore"):
        if getattr(args, flag):
            overlay[flag] = [c for c in getattr(args, flag).split(",") if c.strip()]
    if args.extend_block_containers:
        extra = [n.strip() for n in args.extend_block_containers.split(",") if n.strip()]
        overlay["block-containers"] = sorted(settings.vocab.containers | set(extra))
    return cfg.apply(settings, overlay, "command line") if overlay else settings


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point used by ``kvtier audit`` and ``python -m audit``."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # argparse: --help is 0, bad usage is 2
        return int(exc.code or 0)
    try:
        settings = _settings(args)
        paths = list(args.paths) or default_targets(settings)
        missing = [str(p) for p in paths if not p.exists()]
        if missing:
            print(f"kvtier audit: no such file or directory: {', '.join(missing)}",
                  file=sys.stderr)
            return 2
        result = run(paths, settings, keep_sources=args.diff)
        if result.files == 0:
            print("kvtier audit: no Python files found", file=sys.stderr)
    except cfg.ConfigError as exc:
        print(f"kvtier audit: {exc}", file=sys.stderr)
        return 2
    except Exception:  # internal error: report, never a silent pass
        print("kvtier audit: internal error\n" + traceback.format_exc(), file=sys.stderr)
        return 2

    shown = [f for f in result.findings if f.severity >= settings.min_severity
             and (f.confidence is None or f.confidence >= settings.min_confidence)]
    out = _render(args, shown, result)
    if args.output:
        try:
            args.output.write_text(out + ("\n" if out else ""), encoding="utf-8")
        except OSError as exc:
            print(f"kvtier audit: cannot write {args.output}: {exc.strerror or exc}",
                  file=sys.stderr)
            return 2
    elif out:
        print(out)
    if args.format == "text" and not args.statistics and not args.diff:
        summary = f"{len(shown)} finding(s) in {result.files} file(s) ({result.parsed} parsed)"
        if result.skipped:
            summary += f"; {len(result.skipped)} skipped"
        print(summary, file=sys.stderr)
    if any(f.code == "KVT902" for f in result.findings):
        print("kvtier audit: internal error on some files (KVT902 above)", file=sys.stderr)
        return 2
    failing = settings.fail_on
    return 1 if failing is not None and any(f.severity >= failing for f in shown) else 0


def _render(args: argparse.Namespace, shown: list[Finding], result: RunResult) -> str:
    if args.statistics:
        return reporters.statistics(shown, result.files)
    if args.diff:
        by_path: dict[str, list[Finding]] = {}
        for f in shown:
            by_path.setdefault(f.path, []).append(f)
        return "".join(unified_diff(p, result.sources[p], fs) for p, fs in by_path.items()
                       if p in result.sources)
    if args.format == "json":
        return reporters.to_json(shown, result.files, result.parsed)
    if args.format == "sarif":
        return reporters.sarif(shown)
    if args.format == "github":
        return reporters.github(shown)
    return reporters.text(shown, show_fixes=not args.no_fixes)


__all__ = ["main", "build_parser", "Severity"]
