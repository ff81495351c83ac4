"""Table of positive and negative snippets: every syntactic form, every receiver kind."""

from __future__ import annotations

import textwrap

import pytest

from audit import audit_source
from audit.model import Confidence, Severity

# (id, snippet, expected codes in order of line; [] means "no finding at all")
CASES: list[tuple[str, str, list[str]]] = [
    # ---- forms of the presence test (receiver annotated: high confidence) ----
    ("is-not-none-sum", """
        def f(blocks: list[KVCacheBlock]) -> int:
            return sum(b.block_hash is not None for b in blocks)
     """, ["KVT001"]),
    ("is-none-comprehension-select", """
        def f(blocks: list[KVCacheBlock]) -> list[int]:
            return [b.block_id for b in blocks if b.block_hash is None]
     """, ["KVT002"]),
    ("ne-none-if-append", """
        def f(blocks: list[KVCacheBlock]) -> list[int]:
            out = []
            for b in blocks:
                if b.block_hash != None:
                    out.append(b.block_id)
            return out
     """, ["KVT002"]),
    ("eq-none-break-index", """
        def f(blocks: list[KVCacheBlock]) -> int:
            start = len(blocks)
            for i, b in enumerate(blocks):
                if b.block_hash == None:
                    start = i
                    break
            return start
     """, ["KVT003"]),
    ("truthy-if-count", """
        def f(blocks: list[KVCacheBlock]) -> int:
            num_computed = 0
            for b in blocks:
                if b.block_hash:
                    num_computed += 1
            return num_computed
     """, ["KVT001"]),
    ("truthy-while-index", """
        def f(blocks: list[KVCacheBlock]) -> int:
            i = 0
            while i < len(blocks) and blocks[i].block_hash:
                i += 1
            return i
     """, ["KVT003"]),
    ("not-if-select", """
        def f(blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
            to_load = []
            for blk in blocks:
                if not blk.block_hash:
                    to_load.append(blk)
            return to_load
     """, ["KVT002"]),
    ("bool-call-decide", """
        def f(blk: KVCacheBlock) -> None:
            is_full = bool(blk.block_hash)
            use(is_full)
     """, ["KVT004"]),
    ("and-count", """
        def f(blocks: list[KVCacheBlock]) -> int:
            n_computed = 0
            for blk in blocks:
                if blk.block_hash and not blk.is_null:
                    n_computed += 1
            return n_computed
     """, ["KVT001"]),
    ("or-continue-select", """
        def f(blocks: list[KVCacheBlock]) -> list[int]:
            ids = []
            for blk in blocks:
                if blk.is_null or blk.block_hash is None:
                    continue
                ids.append(blk.block_id)
            return ids
     """, ["KVT002"]),
    ("ternary-in-sum", """
        def f(blocks: list[KVCacheBlock]) -> int:
            return sum(1 if b.block_hash else 0 for b in blocks)
     """, ["KVT001"]),
    ("ternary-augassign", """
        def f(blocks: list[KVCacheBlock]) -> int:
            n = 0
            for b in blocks:
                n += 1 if b.block_hash is not None else 0
            return n
     """, ["KVT001"]),
    ("comprehension-truthy-filter", """
        def f(blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
            return [b for b in blocks if b.block_hash]
     """, ["KVT002"]),
    ("set-comprehension-filter", """
        def f(blocks: list[KVCacheBlock]) -> set[int]:
            return {b.block_id for b in blocks if b.block_hash is not None}
     """, ["KVT002"]),
    ("len-of-filtered-list", """
        def f(blocks: list[KVCacheBlock]) -> int:
            return len([b for b in blocks if b.block_hash is not None])
     """, ["KVT001"]),
    ("any-decide", """
        def f(blocks: list[KVCacheBlock]) -> bool:
            return any(b.block_hash is None for b in blocks)
     """, ["KVT004"]),
    ("all-truthy-decide", """
        def f(blocks: list[KVCacheBlock]) -> bool:
            return all(b.block_hash for b in blocks)
     """, ["KVT004"]),
    ("filter-lambda", """
        def f(blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
            return list(filter(lambda b: b.block_hash is not None, blocks))
     """, ["KVT002"]),
    ("filter-lambda-truthy", """
        def f(blocks: list[KVCacheBlock]):
            return filter(lambda b: b.block_hash, blocks)
     """, ["KVT002"]),
    ("filter-lambda-over-named-blocks", """
        def f(blocks):
            return list(filter(lambda b: b.block_hash is not None, blocks))
     """, ["KVT002"]),
    ("sum-map-lambda", """
        def f(blocks: list[KVCacheBlock]) -> int:
            return sum(map(lambda b: b.block_hash is not None, blocks))
     """, ["KVT001"]),
    ("next-first-missing", """
        def f(blocks: list[KVCacheBlock]) -> int:
            return next((i for i, b in enumerate(blocks) if b.block_hash is None), len(blocks))
     """, ["KVT003"]),
    ("takewhile-prefix", """
        import itertools

        def f(blocks: list[KVCacheBlock]) -> int:
            return len(list(itertools.takewhile(lambda b: b.block_hash is not None, blocks)))
     """, ["KVT003"]),
    ("break-then-count-after", """
        def f(blocks: list[KVCacheBlock]) -> int:
            num_cached = 0
            for blk in blocks:
                if blk.block_hash is None:
                    break
                num_cached += 1
            return num_cached
     """, ["KVT001"]),
    ("elif-select", """
        def f(blocks: list[KVCacheBlock]) -> list[int]:
            out = []
            for blk in blocks:
                if blk.is_null:
                    pass
                elif blk.block_hash is None:
                    out.append(blk.block_id)
            return out
     """, ["KVT002"]),
    ("walrus", """
        def f(blocks: list[KVCacheBlock]) -> int:
            num_full = 0
            for blk in blocks:
                if (h := blk.block_hash) is not None:
                    num_full += 1
            return num_full
     """, ["KVT001"]),
    ("local-alias", """
        def f(blocks: list[KVCacheBlock]) -> int:
            num_computed_blocks = 0
            for blk in blocks:
                h = blk.block_hash
                if h is not None:
                    num_computed_blocks += 1
            return num_computed_blocks
     """, ["KVT001"]),
    ("getattr-default", """
        def f(blocks: list[KVCacheBlock]) -> list[int]:
            to_send = []
            for blk in blocks:
                if getattr(blk, "block_hash", None) is not None:
                    to_send.append(blk.block_id)
            return to_send
     """, ["KVT002"]),
    ("return-in-is-computed", """
        def is_computed(block: KVCacheBlock) -> bool:
            return block.block_hash is not None
     """, ["KVT004"]),
    ("return-loop-index", """
        def first_missing(blocks: list[KVCacheBlock]) -> int:
            for i, b in enumerate(blocks):
                if b.block_hash is None:
                    return i
            return len(blocks)
     """, ["KVT003"]),
    ("transfer-function-return", """
        def pick_block_to_store(block: KVCacheBlock) -> int | None:
            if block.block_hash is None:
                return None
            return block.block_id
     """, ["KVT002"]),
    ("unclear-purpose", """
        def f(blk: KVCacheBlock) -> None:
            if blk.block_hash is not None:
                log("has a hash")
     """, ["KVT005"]),
    # ---- receiver resolution ----
    ("constructor", """
        def f() -> int:
            num = 0
            blk = KVCacheBlock(0)
            if blk.block_hash is not None:
                num += 1
            return num
     """, ["KVT001"]),
    ("req-to-blocks", """
        class Mgr:
            def f(self, rid: str) -> list[int]:
                return [b.block_id for b in self.req_to_blocks[rid] if b.block_hash is None]
     """, ["KVT002"]),
    ("get-new-blocks", """
        def f(pool) -> int:
            return sum(b.block_hash is not None for b in pool.get_new_blocks(3))
     """, ["KVT001"]),
    ("kvcacheblocks-groups", """
        def f(blocks: KVCacheBlocks) -> tuple[int, ...]:
            return tuple(sum(b.block_hash is not None for b in g) for g in blocks.blocks)
     """, ["KVT001"]),
    ("param-named-block", """
        def f(gpu_block) -> bool:
            return gpu_block.block_hash is not None and gpu_block.ref_cnt == 0 or ready()
     """, ["KVT005"]),
    ("string-annotation", """
        def f(blocks: "Sequence[KVCacheBlock]") -> int:
            return sum(1 for b in blocks if b.block_hash is not None)
     """, ["KVT001"]),
    ("optional-annotation", """
        def is_full(blk: "KVCacheBlock | None") -> bool:
            return blk is not None and blk.block_hash is not None
     """, ["KVT004"]),
    ("import-alias", """
        from vllm.v1.core.kv_cache_utils import KVCacheBlock as Blk

        def f(blocks: list[Blk]) -> int:
            return sum(b.block_hash is not None for b in blocks)
     """, ["KVT001"]),
    ("config-free-custom-container-is-unknown", """
        def f(mgr) -> int:
            return sum(b.block_hash is not None for b in mgr.my_block_list)
     """, []),
    ("self-attribute-annotated", """
        class Sched:
            def __init__(self) -> None:
                self._pending: dict[str, list[KVCacheBlock]] = {}

            def count(self, rid: str) -> int:
                return sum(b.block_hash is not None for b in self._pending[rid])
     """, ["KVT001"]),
    ("dataclass-field-and-items", """
        class State:
            held: "dict[str, list[KVCacheBlock]]"

            def ready(self) -> list[str]:
                out = []
                for rid, blocks in self.held.items():
                    for blk in blocks:
                        if blk.block_hash is None:
                            out.append(rid)
                return out
     """, ["KVT002"]),
    ("req-to-blocks-values", """
        class Mgr:
            def f(self) -> int:
                n = 0
                for blocks in self.req_to_blocks.values():
                    n += sum(1 for b in blocks if b.block_hash)
                return n
     """, ["KVT001"]),
    ("self-attribute-not-block", """
        class Plan:
            def __init__(self) -> None:
                self.block: TransferSpec = TransferSpec()

            def f(self) -> int:
                n = 0
                if self.block.block_hash is not None:
                    n += 1
                return n
     """, []),
    # ---- negatives: not a block ----
    ("event-annotated", """
        def f(event: BlockStored) -> int:
            n = 0
            if event.block_hash is not None:
                n += 1
            return n
     """, []),
    ("plan-constructed", """
        def f(plans) -> int:
            n = 0
            plan = TransferPlan(1)
            if plan.block_hash is not None:
                n += 1
            return n
     """, []),
    ("metadata-untyped", """
        def f(req_meta, op, request) -> int:
            return sum(x is not None for x in (req_meta.block_hash, op.block_hash,
                                                request.block_hash))
     """, []),
    ("dataclass-self-not-block", """
        class TransferPlan:
            def ready(self) -> bool:
                return self.block_hash is not None
     """, []),
    ("bare-local-hash", """
        def f(hashes) -> int:
            n = 0
            for block_hash in hashes:
                if block_hash is not None:
                    n += 1
            return n
     """, []),
    ("events-of-blocks-named-event", """
        def f(events: list[BlockStored]) -> int:
            return sum(e.block_hash is not None for e in events)
     """, []),
    # ---- negatives: not a presence test / partial-aware ----
    ("compare-to-other-hash", """
        def f(blk: KVCacheBlock, h) -> bool:
            return blk.block_hash == h
     """, []),
    ("membership-in", """
        def f(blk: KVCacheBlock, seen: set) -> bool:
            return blk.block_hash in seen
     """, []),
    ("value-use-only", """
        def f(blk: KVCacheBlock):
            h = blk.block_hash
            return blk.block_hash, h
     """, []),
    ("num-tokens-attribute", """
        def f(blocks: list[KVCacheBlock]) -> int:
            return sum(b.block_hash_num_tokens is not None for b in blocks)
     """, []),
    ("consults-num-tokens", """
        def f(blocks: list[KVCacheBlock], block_size: int) -> int:
            n = 0
            for i, b in enumerate(blocks):
                if b.block_hash is not None and b.block_hash_num_tokens == (i + 1) * block_size:
                    n += 1
            return n
     """, []),
    # ---- membership: info, never error ----
    ("block-pool-eviction", """
        class BlockPool:
            def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
                first, last = [], []
                for block in blocks:
                    if block.block_hash is None:
                        first.append(block)
                    else:
                        last.append(block)
     """, ["KVT006"]),
    ("assert-before-set", """
        def cache(blk: KVCacheBlock, h) -> None:
            assert blk.block_hash is None
            blk.set_block_hash(h)
     """, ["KVT006"]),
    ("guard-then-use-hash", """
        def record(blocks: list[KVCacheBlock], cached: set) -> None:
            for blk in blocks:
                if blk.block_hash is None:
                    continue
                cached.add(blk.block_hash)
     """, ["KVT006"]),
    ("writability", """
        def is_block_writable(block: KVCacheBlock) -> bool:
            return block.ref_cnt == 1 and block.block_hash is None
     """, ["KVT006"]),
    ("collect-hashes", """
        def hashes(blocks: list[KVCacheBlock]) -> list:
            return [b.block_hash for b in blocks if b.block_hash is not None]
     """, ["KVT006"]),
    ("lambda-keyword-is-cached", """
        def f(blocks: list[KVCacheBlock]):
            return plan(is_null=lambda i: blocks[i].is_null,
                        is_cached=lambda i: blocks[i].block_hash is not None)
     """, ["KVT006"]),
    ("lambda-assigned-is-full", """
        def f(blocks: list[KVCacheBlock]):
            is_full = lambda blk: blk.block_hash is not None  # noqa: E731
            return [b for b in blocks if is_full(b)]
     """, ["KVT004"]),
    ("lambda-param-shadows-outer-block", """
        def f(blocks: list[KVCacheBlock], events):
            for b in blocks:
                pass
            return list(filter(lambda b: b.block_hash is not None, events))
     """, []),
    ("evict-on-allocate", """
        def allocate(pool, n: int) -> list[KVCacheBlock]:
            blocks = pool.popleft_n(n)
            for block in blocks:
                if block.block_hash is not None:
                    pool._evict_cached_block(block)
                block.ref_cnt = 1
            return blocks
     """, ["KVT006"]),
    ("count-in-num-cached-blocks-is-error", """
        def get_num_cached_blocks(blocks: list[KVCacheBlock]) -> int:
            return sum(1 for b in blocks if b.block_hash is not None)
     """, ["KVT001"]),
    ("is-cached-function", """
        def is_cached(block: KVCacheBlock) -> bool:
            return block.block_hash is not None
     """, ["KVT006"]),
    ("has-cached-flag", """
        def f(blk: KVCacheBlock) -> None:
            is_cached = blk.block_hash is not None
            use(is_cached)
     """, ["KVT006"]),
    # ---- suppression ----
    ("noqa-code", """
        def f(blocks: list[KVCacheBlock]) -> int:
            return sum(b.block_hash is not None for b in blocks)  # noqa: KVT001
     """, []),
    ("noqa-bare", """
        def f(blocks: list[KVCacheBlock]) -> int:
            return sum(b.block_hash is not None for b in blocks)  # noqa
     """, []),
    ("kvtier-ignore-code", """
        def f(blocks: list[KVCacheBlock]) -> list[int]:
            return [b.block_id for b in blocks if b.block_hash is None]  # kvtier: ignore[KVT002]
     """, []),
    ("noqa-other-code-does-not-suppress", """
        def f(blocks: list[KVCacheBlock]) -> int:
            return sum(b.block_hash is not None for b in blocks)  # noqa: KVT002, E501
     """, ["KVT001"]),
    ("kvtier-ignore-other-code", """
        def f(blocks: list[KVCacheBlock]) -> int:
            return sum(b.block_hash is not None for b in blocks)  # kvtier: ignore[KVT003]
     """, ["KVT001"]),
]


def _codes(snippet: str) -> list[str]:
    return [f.code for f in audit_source(textwrap.dedent(snippet), "t.py")]


@pytest.mark.parametrize(("snippet", "expected"), [(s, e) for _, s, e in CASES],
                         ids=[c[0] for c in CASES])
def test_case(snippet: str, expected: list[str]) -> None:
    assert _codes(snippet) == expected


def test_table_covers_every_rule_code() -> None:
    seen = {code for _, _, codes in CASES for code in codes}
    assert {"KVT001", "KVT002", "KVT003", "KVT004", "KVT005", "KVT006"} <= seen


def test_confidence_levels_follow_the_evidence() -> None:
    annotated = audit_source("def f(b: KVCacheBlock):\n    return b.block_hash is not None\n"
                             "def g(blocks: list[KVCacheBlock]):\n"
                             "    return sum(b.block_hash is not None for b in blocks)\n")
    container = audit_source("def f(pool):\n"
                             "    return sum(b.block_hash is not None for b in pool.blocks)\n")
    named = audit_source("def f(blocks):\n"
                         "    return sum(b.block_hash is not None for b in blocks)\n")
    assert [f.confidence for f in annotated] == [Confidence.HIGH, Confidence.HIGH]
    assert [f.confidence for f in container] == [Confidence.MEDIUM]
    assert [f.confidence for f in named] == [Confidence.LOW]
    assert all("annotated" in f.why for f in annotated)


def test_error_findings_carry_reason_and_fix_with_names_in_scope() -> None:
    src = textwrap.dedent("""
        def f(blocks: list[KVCacheBlock], block_size: int) -> int:
            n = 0
            for i, blk in enumerate(blocks):
                if blk.block_hash is not None:
                    n += 1
            return n
    """)
    (finding,) = audit_source(src)
    assert finding.severity is Severity.ERROR
    assert (finding.line, finding.col) == (5, 12)
    assert "partial" in finding.message
    assert "blk.block_hash_num_tokens == (i + 1) * block_size" in finding.fix
    assert finding.suggestion == (5, 11, 37, "blk.block_hash_num_tokens == (i + 1) * block_size")


def test_syntax_error_is_a_finding_not_a_crash() -> None:
    (finding,) = audit_source("def f(:\n    block_hash\n", "bad.py")
    assert finding.code == "KVT900"
    assert finding.line == 1


def test_rewrite_inside_a_comprehension_uses_its_enumerate_index() -> None:
    src = ("def f(blocks: list[KVCacheBlock], block_size: int) -> int:\n"
           "    return sum(b.block_hash is not None for i, b in enumerate(blocks))\n")
    (finding,) = audit_source(src)
    assert finding.suggestion is not None
    assert finding.suggestion[3] == "b.block_hash_num_tokens == (i + 1) * block_size"


def test_no_rewrite_for_an_index_relative_to_a_slice() -> None:
    src = ("def f(blocks: list[KVCacheBlock], k: int, block_size: int) -> int:\n"
           "    return sum(b.block_hash is not None for i, b in enumerate(blocks[k:]))\n")
    (finding,) = audit_source(src)
    assert finding.code == "KVT001" and finding.suggestion is None
    assert "(index + 1) * block_size" in finding.fix


def test_columns_count_characters_not_bytes() -> None:
    src = ("def f(blocks: list[KVCacheBlock]) -> int:\n"
           "    x = 'éé'; return sum(b.block_hash is not None for b in blocks)\n")
    plain = src.replace("'éé'", "'ee'")
    (accented,) = audit_source(src)
    (ascii_,) = audit_source(plain)
    assert (accented.col, accented.end_col) == (ascii_.col, ascii_.end_col) == (26, 50)
