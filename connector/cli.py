"""The ``kvtier`` command: ``kvtier daemon|audit|demo|bench ...``, ``kvtier --version``.

Each subcommand owns its own argument parser; this module only dispatches, importing
the subcommand's module lazily so that ``kvtier audit`` never pays for vLLM or Redis.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "daemon": ("connector.daemon.cli", "Subscribe to vLLM KV events; serve prefix look-ups."),
    "audit": ("audit.cli", "Flag code that treats block_hash presence as 'full block'."),
    "demo": ("connector.demo.cli", "Run a real vLLM CPU engine with kvtier; print a hit table."),
    "bench": ("connector.demo.bench_cli", "Run the benchmarks in benchmarks/ side by side."),
}


def version() -> str:
    """kvtier's version: the installed package's metadata, else pyproject.toml's (a checkout
    run without installing it)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("kvtier")
    except PackageNotFoundError:
        import tomllib
        from pathlib import Path

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        try:
            return str(tomllib.loads(pyproject.read_text())["project"]["version"])
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"


def _usage() -> str:
    lines = ["usage: kvtier [--version] <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {doc}" for name, (_, doc) in SUBCOMMANDS.items()]
    lines += ["", "Run 'kvtier <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help"}:
        print(_usage())
        return 0 if args else 2
    if args[0] in {"-V", "--version"}:
        print(f"kvtier {version()}")
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"kvtier: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    entry: Callable[[list[str]], int] = module.main
    return int(entry(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
