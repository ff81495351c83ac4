"""Findings, severities and the rule table of ``kvtier audit`` (one code, one job)."""

from __future__ import annotations

import ast
import enum
from dataclasses import asdict, dataclass, field


class Severity(enum.IntEnum):
    """How much a finding matters; ordered so thresholds compare with ``>=``."""

    INFO = 1
    WARNING = 2
    ERROR = 3

    @classmethod
    def parse(cls, text: str) -> Severity:
        try:
            return cls[text.strip().upper()]
        except KeyError:
            names = ", ".join(s.name.lower() for s in cls)
            raise ValueError(f"unknown severity {text!r} (expected one of: {names})") from None

    def __str__(self) -> str:
        return self.name.lower()


class Confidence(enum.IntEnum):
    """How sure the engine is that the receiver is a vLLM ``KVCacheBlock``."""

    LOW = 1  # naming only (``blk``, ``gpu_block``)
    MEDIUM = 2  # a known block container or producer (``req_to_blocks``, ``.blocks``)
    HIGH = 3  # an annotation or a constructor call (``KVCacheBlock``)

    def __str__(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class Kind:
    """What an expression is, how sure we are, and the evidence."""

    kind: str
    confidence: Confidence
    why: str


@dataclass(slots=True)
class Candidate:
    """A hash expression whose receiver resolved to a block."""

    node: ast.expr  # the hash expression (attribute, getattr call, alias name)
    receiver: ast.expr
    kind: Kind


@dataclass(frozen=True, slots=True)
class Rule:
    """One code: what it means, how bad it is by default, and how to fix it."""

    code: str
    name: str
    severity: Severity
    summary: str
    fix: str

    @property
    def help(self) -> str:
        """The fix with the reader's generic names filled in (``block``, ``i``, ``block_size``),
        for rule-level text such as SARIF's ``help``; a finding fills in its own names."""
        return self.fix.format(recv="block", index="i", block_size="block_size", code=self.code)


FIX_FULL = (
    "decide fullness from the hash's coverage: "
    "`{recv}.block_hash_num_tokens == ({index} + 1) * {block_size}` "
    "(or `is_full_block({recv}.block_hash_num_tokens, {index}, {block_size})`)"
)
FIX_REVIEW = (
    "if this means 'full/computed', compare `{recv}.block_hash_num_tokens` with the block's "
    "end position `({index} + 1) * {block_size}`; if it means 'is cached', suppress with "
    "`# kvtier: ignore[{code}]`"
)

RULES: dict[str, Rule] = {
    r.code: r
    for r in (
        Rule("KVT001", "count-by-hash-presence", Severity.ERROR,
             "counts blocks or tokens by block_hash presence; partial entries are counted "
             "as full", FIX_FULL),
        Rule("KVT002", "select-by-hash-presence", Severity.ERROR,
             "chooses blocks to load/receive/store/transfer by block_hash presence; a "
             "partial entry is treated as a full block", FIX_FULL),
        Rule("KVT003", "position-by-hash-presence", Severity.ERROR,
             "derives a start index or size from block_hash presence; a partial entry "
             "moves the boundary by up to a whole block", FIX_FULL),
        Rule("KVT004", "presence-means-full", Severity.ERROR,
             "decides 'full / computed / complete' from block_hash presence; partial "
             "entries have a hash too", FIX_FULL),
        Rule("KVT005", "presence-test-unclear", Severity.WARNING,
             "tests block_hash presence on a KV-cache block; a hash no longer means the "
             "block is full", FIX_REVIEW),
        Rule("KVT006", "presence-for-membership", Severity.INFO,
             "tests block_hash presence for cache membership (bookkeeping, writability, "
             "guard before using the hash); correct for partial entries",
             "none needed; keep fullness decisions on block_hash_num_tokens"),
        Rule("KVT900", "unparsable-file", Severity.WARNING,
             "file could not be parsed and was skipped", "fix the syntax error"),
        Rule("KVT902", "internal-error", Severity.ERROR,
             "kvtier audit failed on this file (a bug in the audit; the run exits 2)",
             "report it with the file; other files were still audited"),
        Rule("KVT901", "skipped-file", Severity.INFO,
             "file was skipped (binary, undecodable or larger than max-file-size)",
             "raise max-file-size or exclude the file"),
    )
}


@dataclass(frozen=True, slots=True)
class Finding:
    """One reported location. ``line``/``col`` are 1-based like ruff's."""

    path: str
    line: int
    col: int
    code: str
    severity: Severity
    message: str
    fix: str = ""
    confidence: Confidence | None = None
    why: str = ""  # how the receiver was recognised as a block
    end_line: int = 0
    end_col: int = 0
    suggestion: tuple[int, int, int, str] | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["severity"] = str(self.severity)
        data["confidence"] = str(self.confidence) if self.confidence else None
        data.pop("suggestion")
        return data
