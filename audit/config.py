"""``[tool.kvtier.audit]`` in the audited project's ``pyproject.toml``, merged with CLI flags."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from audit.model import Severity
from audit.purpose import DEFAULT_BOOKKEEPING_CLASSES
from audit.resolve import (
    DEFAULT_BLOCK_TYPES,
    DEFAULT_CONTAINERS,
    DEFAULT_KVBLOCKS_TYPES,
    DEFAULT_SINGLE,
    Vocabulary,
)

DEFAULT_EXCLUDE_DIRS = frozenset({
    ".git", ".hg", ".svn", ".venv", "venv", "__pycache__", "node_modules", ".tox", ".nox",
    ".mypy_cache", ".ruff_cache", ".pytest_cache", "build", "dist", ".eggs",
})
KNOWN_KEYS = frozenset({
    "include", "exclude", "fail-on", "min-severity", "min-confidence", "block-containers",
    "block-producers", "block-types", "bookkeeping-classes", "max-file-size", "jobs",
    "select", "ignore", "per-file-ignores",
})


SEVERITIES = tuple(str(s) for s in Severity)  # info, warning, error


class ConfigError(ValueError):
    """A bad ``[tool.kvtier.audit]`` table or flag value (exit code 2)."""


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything one run needs; picklable so worker processes receive it."""

    root: Path = field(default_factory=Path.cwd)
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    fail_on: Severity | None = Severity.ERROR  # None: never fail on findings
    min_severity: Severity = Severity.WARNING
    min_confidence: int = 1
    vocab: Vocabulary = field(default_factory=Vocabulary)
    bookkeeping: frozenset[str] = DEFAULT_BOOKKEEPING_CLASSES
    max_file_size: int = 2_000_000
    select: frozenset[str] = frozenset()  # empty: every code
    ignore: frozenset[str] = frozenset()
    per_file_ignores: tuple[tuple[str, frozenset[str]], ...] = ()  # (glob, codes)
    jobs: int = 0  # 0: one per CPU
    source: Path | None = None  # the pyproject.toml the settings came from


def find_pyproject(start: Path) -> Path | None:
    """Nearest ``pyproject.toml`` at or above ``start`` (a file or directory)."""
    here = start.resolve()
    if not here.is_dir():
        here = here.parent
    for directory in (here, *here.parents):
        candidate = directory / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


def load(pyproject: Path | None) -> Settings:
    """Settings from ``pyproject``'s ``[tool.kvtier.audit]`` (defaults when absent)."""
    if pyproject is None:
        return Settings()
    try:
        with pyproject.open("rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{pyproject}: cannot read configuration: {exc}") from exc
    table: object = data
    for key in ("tool", "kvtier", "audit"):
        table = table.get(key, {}) if isinstance(table, dict) else None
        if not isinstance(table, dict):
            raise ConfigError(f"{pyproject}: [tool.kvtier.audit] must be a table "
                              f"(`{key}` is not)")
    unknown = sorted(set(table) - KNOWN_KEYS)
    if unknown:
        raise ConfigError(f"{pyproject}: unknown [tool.kvtier.audit] key(s): "
                          f"{', '.join(unknown)} (known: {', '.join(sorted(KNOWN_KEYS))})")
    return apply(Settings(root=pyproject.parent, source=pyproject), table, str(pyproject))


def apply(settings: Settings, table: dict[str, object], origin: str) -> Settings:
    """Overlay a config table (same keys as pyproject) on ``settings``."""
    changes: dict[str, object] = {}
    vocab = settings.vocab
    try:
        for key, value in table.items():
            if key in {"include", "exclude"}:
                changes[key] = tuple(_strings(key, value))
            elif key == "fail-on":
                level = _one_of(key, value, (*SEVERITIES, "never"))
                changes["fail_on"] = None if level == "never" else Severity.parse(level)
            elif key == "min-severity":
                changes["min_severity"] = Severity.parse(_one_of(key, value, SEVERITIES))
            elif key == "min-confidence":
                levels = {"low": 1, "medium": 2, "high": 3}
                if value not in levels:
                    raise ConfigError(f"min-confidence must be low, medium or high, "
                                      f"got {value!r}")
                changes["min_confidence"] = levels[str(value)]
            elif key == "block-containers":
                vocab = replace(vocab, containers=DEFAULT_CONTAINERS | set(_strings(key, value)))
            elif key == "block-producers":
                vocab = replace(vocab, single=DEFAULT_SINGLE | set(_strings(key, value)))
            elif key == "block-types":
                vocab = replace(vocab, block_types=DEFAULT_BLOCK_TYPES | set(_strings(key, value)),
                                kvblocks_types=DEFAULT_KVBLOCKS_TYPES)
            elif key == "bookkeeping-classes":
                changes["bookkeeping"] = DEFAULT_BOOKKEEPING_CLASSES | set(_strings(key, value))
            elif key in {"select", "ignore"}:
                changes[key] = frozenset(_codes(key, value))
            elif key == "per-file-ignores":
                if not isinstance(value, dict):
                    raise ConfigError(f"per-file-ignores must be a table of glob = [codes], "
                                      f"got {value!r}")
                changes["per_file_ignores"] = tuple(
                    (str(glob), frozenset(_codes(f"per-file-ignores.{glob}", codes)))
                    for glob, codes in value.items())
            elif key in {"max-file-size", "jobs"}:
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ConfigError(f"{key} must be a non-negative integer, got {value!r}")
                changes[key.replace("-", "_")] = value
    except ValueError as exc:
        raise ConfigError(f"{origin}: {exc}") from None
    return replace(settings, vocab=vocab, **changes)


def _one_of(key: str, value: object, allowed: tuple[str, ...]) -> str:
    """``value`` when it is one of ``allowed``, else an error naming the option and every
    allowed value."""
    if not isinstance(value, str) or value.strip().lower() not in allowed:
        raise ConfigError(f"{key}: unknown value {value!r} (allowed: {', '.join(allowed)})")
    return value.strip().lower()


def _codes(key: str, value: object) -> list[str]:
    from audit.model import RULES

    codes = [c.strip().upper() for c in _strings(key, value)]
    unknown = [c for c in codes if c not in RULES]
    if unknown:
        raise ConfigError(f"{key}: unknown code(s) {', '.join(unknown)} "
                          f"(known: {', '.join(sorted(RULES))})")
    return codes


def _strings(key: str, value: object) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key} must be a list of strings, got {value!r}")
    return list(value)
