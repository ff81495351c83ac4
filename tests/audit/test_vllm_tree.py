"""kvtier audit on the installed vLLM source: the findings verified by reading the code.

vLLM is located with ``find_spec`` (a top-level spec does not run the package) and never
imported. Each pinned finding is anchored on its source line text, not its number.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from audit.config import Settings
from audit.engine import RunResult, run
from audit.model import Severity

# Real errors: hash presence decides computed/fetch/start on vLLM 0.32 (see docs/audit.md).
VERIFIED_ERRORS = {
    ("distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py", "KVT001",
     "block.block_hash is not None and not block.is_null"),
    ("distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py", "KVT003",
     "if not block.is_null and block.block_hash is None:"),
    ("v1/core/kv_cache_manager.py", "KVT002",
     "return [block.block_id for block in self.blocks[0] if block.block_hash is None]"),
    ("v1/core/kv_cache_manager.py", "KVT002",
     "if block.block_hash is None and not block.is_null"),
}
# Errors by the rule that reading showed to be safe today (documented, kept visible).
REVIEWED_SAFE_ERRORS = {
    ("v1/simple_kv_offload/manager.py", "KVT002", "bhash is not None"),
    ("v1/simple_kv_offload/manager.py", "KVT002", "if gpu_block.block_hash is None:"),
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


@pytest.fixture(scope="module")
def tree() -> tuple[Path, RunResult]:
    root = _vllm_dir()
    return root, run([root], Settings(min_severity=Severity.INFO))


def _rel(root: Path, path: str) -> str:
    return Path(path).relative_to(root).as_posix()


def _line(path: str, line: int) -> str:
    return Path(path).read_text(encoding="utf-8").splitlines()[line - 1].strip()


def test_whole_tree_is_audited_without_crash(tree) -> None:
    root, result = tree
    assert result.files > 2000
    assert result.parsed >= 20  # every file that mentions block_hash
    assert not [f for f in result.findings if f.code == "KVT900"]


def test_errors_are_exactly_the_verified_and_reviewed_ones(tree) -> None:
    root, result = tree
    errors = [f for f in result.findings if f.severity is Severity.ERROR]
    pinned = VERIFIED_ERRORS | REVIEWED_SAFE_ERRORS
    matched = set()
    for f in errors:
        rel, text = _rel(root, f.path), _line(f.path, f.line)
        hits = {p for p in pinned if p[0] == rel and p[1] == f.code and p[2] in text}
        assert len(hits) == 1, f"unexpected error {rel}:{f.line} {f.code}: {text}"
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


def test_verified_errors_resolve_their_receiver_with_high_confidence(tree) -> None:
    root, result = tree
    for f in result.findings:
        rel = _rel(root, f.path)
        if any(rel == p[0] and f.code == p[1] for p in VERIFIED_ERRORS):
            assert str(f.confidence) == "high", (rel, f.why)
            assert "block_hash_num_tokens" in f.fix


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
