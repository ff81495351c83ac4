"""kvtier audit on the installed vLLM source: the findings verified by reading the code.

vLLM is located with ``find_spec`` (a top-level spec does not run the package) and never
imported. Each pinned finding is anchored on its source line text, not its number.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from audit.config import Settings
from audit.engine import RunResult, run
from audit.model import Severity

_PULL = "distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py"
_OFFLOAD = "distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"
_MANAGER = "v1/core/kv_cache_manager.py"
_SIMPLE = "v1/simple_kv_offload/manager.py"

# Per vLLM release (major.minor of the audited tree's ``vllm/_version.py``): the errors that
# reading the code showed to be real, each (file, code, line text, receiver confidence), and
# the errors by the rule that reading showed to be safe today (documented, kept visible).
# See docs/audit.md for the 0.32 verdicts.
# Unchanged between releases: the pull scheduler's count, get_unhashed_block_ids, and the
# two simple_kv_offload reviews.
_PULL_COUNT = (_PULL, "KVT001", "block.block_hash is not None and not block.is_null", "high")
_UNHASHED = (_MANAGER, "KVT002", "return [block.block_id for block in self.blocks[0] "
             "if block.block_hash is None]", "high")
_SIMPLE_SAFE = {(_SIMPLE, "KVT002", "bhash is not None"),
                (_SIMPLE, "KVT002", "if gpu_block.block_hash is None:")}
# Maps each hit block to its hash or None (positions kept, nothing selected): a guard before
# using the hash value; the blocks are _LookupBlockPool's, one per whole-unit hit, so no
# partial entry can occur (0.33, 0.34).
_UMBP_SAFE = ("distributed/kv_transfer/kv_connector/v1/umbp/scheduler.py", "KVT002",
              "if block.is_null or block.block_hash is None")
EXPECTED: dict[str, dict[str, set[tuple[str, ...]]]] = {
    "0.32": {
        "verified": {
            _PULL_COUNT, _UNHASHED,
            (_OFFLOAD, "KVT003", "if not block.is_null and block.block_hash is None:", "high"),
            (_MANAGER, "KVT002", "if block.block_hash is None and not block.is_null", "high"),
        },
        "reviewed_safe": set(_SIMPLE_SAFE),
    },
    "0.33": {
        "verified": {
            _PULL_COUNT, _UNHASHED,
            # Still real on the async path: a partial entry is skipped as "already here",
            # so the load starts a block late; a sync load now matches by position.
            (_OFFLOAD, "KVT003",
             "if not block.is_null and (sync_load or block.block_hash is None):", "high"),
            # Same code as 0.32, now iterating ``trim_null_head(group)``: a helper of
            # another file, so the receiver is known by its name only.
            (_MANAGER, "KVT002", "if block.block_hash is None and not block.is_null", "low"),
        },
        "reviewed_safe": _SIMPLE_SAFE | {_UMBP_SAFE},
    },
    # 0.34.0 (read from the wheel): the same seven, each re-read in its new place. The pull
    # scheduler's count now sizes each group's DCP slice start (a partial entry counted as
    # computed still shifts it); the offloading scheduler's async scan is unchanged beside
    # a longer comment; kv_cache_manager, umbp and simple_kv_offload are the same code.
    "0.34": {
        "verified": {
            _PULL_COUNT, _UNHASHED,
            (_OFFLOAD, "KVT003",
             "if not block.is_null and (sync_load or block.block_hash is None):", "high"),
            (_MANAGER, "KVT002", "if block.block_hash is None and not block.is_null", "low"),
        },
        "reviewed_safe": _SIMPLE_SAFE | {_UMBP_SAFE},
    },
}
# Files whose block_hash presence tests are on non-block objects only (events, plans,
# request metadata, plain hash lists): nothing may be reported there.
NON_BLOCK_FILES = (
    "distributed/kv_transfer/kv_connector/v1/offloading/events.py",
    "distributed/kv_events.py",
    "distributed/kv_transfer/kv_connector/v1/lmcache_integration/multi_process_adapter.py",
    "distributed/kv_transfer/kv_connector/v1/mooncake/store/worker.py",
    "distributed/kv_transfer/kv_connector/v1/mooncake/store/data.py",
    "distributed/kv_transfer/kv_connector/v1/mooncake/store/coordinator.py",
    "distributed/aux_output_connector/connector.py",
    "v1/request.py",
)
# The block pool's own hash-map bookkeeping and the block's own setter.
BOOKKEEPING_FILES = ("v1/core/block_pool.py", "v1/core/kv_cache_utils.py")


def _vllm_dir() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("vllm is not installed in this venv; run scripts/bootstrap.sh")
    return Path(next(iter(spec.submodule_search_locations)))


def _release(root: Path) -> str:
    """major.minor of the tree's ``_version.py``, read as text (vLLM is never imported)."""
    text = (root / "_version.py").read_text(encoding="utf-8")
    found = re.search(r"^__version__ = version = '(\d+)\.(\d+)", text, re.M)
    assert found, f"no version in {root / '_version.py'}"
    return f"{found[1]}.{found[2]}"


@pytest.fixture(scope="module")
def tree() -> tuple[Path, RunResult]:
    root = _vllm_dir()
    return root, run([root], Settings(min_severity=Severity.INFO))


@pytest.fixture(scope="module")
def expected(tree) -> dict[str, set[tuple[str, ...]]]:
    release = _release(tree[0])
    if release not in EXPECTED:
        pytest.fail(f"vLLM {release}: no expected findings yet; audit the tree and add them "
                    f"(known: {', '.join(sorted(EXPECTED))})")
    return EXPECTED[release]


def _pinned(root: Path, f, entries: set[tuple[str, ...]]) -> set[tuple[str, ...]]:
    rel, text = _rel(root, f.path), _line(f.path, f.line)
    return {p for p in entries if p[0] == rel and p[1] == f.code and p[2] in text}


def _rel(root: Path, path: str) -> str:
    return Path(path).relative_to(root).as_posix()


def _line(path: str, line: int) -> str:
    return Path(path).read_text(encoding="utf-8").splitlines()[line - 1].strip()


def test_whole_tree_is_audited_without_crash(tree) -> None:
    root, result = tree
    assert result.files > 2000
    assert result.parsed >= 20  # every file that mentions block_hash
    assert not [f for f in result.findings if f.code == "KVT900"]


def test_errors_are_exactly_the_verified_and_reviewed_ones(tree, expected) -> None:
    root, result = tree
    errors = [f for f in result.findings if f.severity is Severity.ERROR]
    pinned = expected["verified"] | expected["reviewed_safe"]
    matched = set()
    for f in errors:
        hits = _pinned(root, f, pinned)
        assert len(hits) == 1, (
            f"unexpected error {_rel(root, f.path)}:{f.line} {f.code}: {_line(f.path, f.line)}")
        matched |= hits
    assert matched == pinned


def test_no_warnings_and_every_info_is_hash_membership(tree) -> None:
    """Below the pinned errors: no warning at all, and only KVT006 (hash presence as "is
    cached", bookkeeping) at INFO; how many is printed by ``kvtier audit --isolated
    --min-severity info --statistics <vllm dir>``."""
    _, result = tree
    rest = [f for f in result.findings if f.severity is not Severity.ERROR]
    assert rest, "the bookkeeping tests were not seen at all"
    assert {(f.severity, f.code) for f in rest} == {(Severity.INFO, "KVT006")}


def test_verified_errors_resolve_their_receiver_with_the_pinned_confidence(
        tree, expected) -> None:
    root, result = tree
    seen = 0
    for f in result.findings:
        for pin in _pinned(root, f, expected["verified"]):
            assert str(f.confidence) == pin[3], (_rel(root, f.path), f.line, f.why)
            assert "block_hash_num_tokens" in f.fix
            seen += 1
    assert seen == len(expected["verified"])


def test_offloading_start_index_gets_a_rewrite(tree) -> None:
    root, result = tree
    (finding,) = [f for f in result.findings
                  if _rel(root, f.path).endswith("offloading/scheduler.py")]
    assert finding.suggestion is not None
    assert finding.suggestion[3] == (
        "block.block_hash_num_tokens != (i + 1) * tokens_per_block")


def test_block_pool_bookkeeping_is_membership_not_error(tree) -> None:
    root, result = tree
    for name in BOOKKEEPING_FILES:
        found = [f for f in result.findings if _rel(root, f.path) == name]
        assert found, f"{name}: the bookkeeping tests were not seen at all"
        assert {f.code for f in found} == {"KVT006"}
        assert all(f.severity is Severity.INFO for f in found)
    pool = [f for f in result.findings if _rel(root, f.path) == "v1/core/block_pool.py"]
    texts = [_line(f.path, f.line) for f in pool]
    assert any("is_null and block.ref_cnt == 1 and block.block_hash is None" in t
               for t in texts)  # writability
    assert any("block.block_hash is None or not self.enable_caching" in t
               for t in texts)  # eviction order


def test_partial_aware_code_is_not_reported(tree) -> None:
    """block_pool.cache_full_blocks checks block_hash_num_tokens right after presence."""
    root, result = tree
    for f in result.findings:
        text = _line(f.path, f.line)
        assert text != "if blk.block_hash is not None:", (_rel(root, f.path), f.line)


def test_non_block_objects_are_never_reported(tree) -> None:
    root, result = tree
    reported = {_rel(root, f.path) for f in result.findings}
    for name in NON_BLOCK_FILES:
        assert (root / name).is_file(), name
        assert "block_hash" in (root / name).read_text(encoding="utf-8")
        assert name not in reported, name
    manager = [f for f in result.findings if _rel(root, f.path).endswith("manager.py")]
    for f in manager:
        assert "block_hash is None or block_hash == primary_block_hash" not in _line(
            f.path, f.line)
