"""Static receiver resolution: is this expression a vLLM ``KVCacheBlock``, and how sure are we?

Evidence, strongest first: an annotation or a constructor call naming a block type (high);
iteration over or indexing into a known block container or producer (medium); the
variable's name (low, last resort). Objects resolved to another type (events, plans,
request metadata) are never treated as blocks, whatever their name.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from audit.model import Confidence, Kind

BLOCK = "block"  # one KVCacheBlock
BLOCKS = "blocks"  # a sequence of KVCacheBlock
GROUPS = "groups"  # a sequence of block sequences (per KV-cache group)
KVBLOCKS = "kvblocks"  # a KVCacheBlocks object: ``.blocks`` is GROUPS
REQMAP = "reqmap"  # request id -> block sequence (``req_to_blocks``)
BLOCKMAP = "blockmap"  # key -> one block
OTHER = "other"  # resolved to something that is not a block
UNKNOWN = "unknown"  # a parameter without annotation: shadows outer names, naming decides

DEFAULT_BLOCK_TYPES = frozenset({"KVCacheBlock"})
DEFAULT_KVBLOCKS_TYPES = frozenset({"KVCacheBlocks"})
# Attributes / methods whose value (or call result) is a sequence of blocks.
DEFAULT_CONTAINERS = frozenset({
    "req_to_blocks", "get_new_blocks", "get_cached_block", "get_all_free_blocks",
    "iter_blocks_after", "popleft_n", "new_computed_blocks", "computed_blocks",
    "new_full_blocks", "get_blocks", "allocate_new_blocks", "find_longest_cache_hit",
})
# Attributes / methods whose value is a single block.
DEFAULT_SINGLE = frozenset({"null_block", "popleft", "fake_free_list_head",
                            "fake_free_list_tail", "prev_free_block", "next_free_block"})
_CONTAINER_GENERICS = frozenset({
    "list", "List", "Sequence", "MutableSequence", "Iterable", "Iterator", "Collection",
    "tuple", "Tuple", "set", "Set", "frozenset", "deque", "Generator", "Reversible",
})
_WRAPPERS = frozenset({"Optional", "Union", "Annotated", "Final", "ClassVar", "Required"})
_SCALAR_NAMES = frozenset({"int", "str", "bytes", "bool", "float", "None", "Any", "object"})
_SAME_KIND_CALLS = frozenset({"list", "tuple", "sorted", "reversed", "iter", "set", "deque"})

_BLOCK_NAME = re.compile(r"^_?(blk|block|\w+_blk|\w+_block|block_\w+_?blk)$")
_BLOCKS_NAME = re.compile(r"^_?(blks|blocks|\w+_blocks|\w+_blks)$")
_NOT_BLOCK_NAME = re.compile(r"(^|_)(num|n|count|ids?|idx|index|size|mask|table|hash|hashes|"
                             r"meta|event|plan|spec|req|request|op|key|keys|len|tokens)(_|$)")


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """Names that identify blocks; extended from ``[tool.kvtier.audit]``."""

    block_types: frozenset[str] = DEFAULT_BLOCK_TYPES
    kvblocks_types: frozenset[str] = DEFAULT_KVBLOCKS_TYPES
    containers: frozenset[str] = DEFAULT_CONTAINERS
    single: frozenset[str] = DEFAULT_SINGLE


def _weaker(a: Confidence, b: Confidence) -> Confidence:
    return a if a < b else b


def _name_of(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


class Resolver:
    """Resolves expressions in one scope chain (module → class → function → nested)."""

    def __init__(self, vocab: Vocabulary, class_name: str | None = None,
                 parent: Resolver | None = None) -> None:
        self.vocab = vocab
        self.class_name = class_name
        self.parent = parent
        self.names: dict[str, Kind] = {}
        self.attrs: dict[str, Kind] = {}  # class scopes: ``self.<attr>`` annotations
        self.aliases: dict[str, tuple[ast.expr, Kind]] = {}  # h = blk.block_hash
        # Functions of this file annotated to return blocks: name -> kind.
        self.producers: dict[str, Kind] = parent.producers if parent else {}

    # ----------------------------------------------------------------- lookups
    def lookup(self, name: str) -> Kind | None:
        scope: Resolver | None = self
        while scope is not None:
            if name in scope.names:
                return scope.names[name]
            scope = scope.parent
        return None

    def alias(self, name: str) -> tuple[ast.expr, Kind] | None:
        scope: Resolver | None = self
        while scope is not None:
            if name in scope.aliases:
                return scope.aliases[name]
            if name in scope.names:
                return None  # shadowed by a non-alias binding
            scope = scope.parent
        return None

    def self_attr(self, attr: str) -> Kind | None:
        """Kind of ``self.<attr>`` from the nearest enclosing class's annotations."""
        scope: Resolver | None = self
        while scope is not None:
            if scope.class_name is not None:
                return scope.attrs.get(attr)
            scope = scope.parent
        return None

    def _in_class(self, names: frozenset[str]) -> bool:
        scope: Resolver | None = self
        while scope is not None:
            if scope.class_name is not None:
                return scope.class_name in names
            scope = scope.parent
        return False

    # ------------------------------------------------------------- annotations
    def annotation(self, node: ast.expr | None) -> Kind | None:
        """Kind named by a type annotation, or OTHER for a non-block type."""
        if node is None:
            return None
        depth = self._ann_depth(node)
        if depth is None:
            return None
        if depth == -1:
            return Kind(KVBLOCKS, Confidence.HIGH, "annotated KVCacheBlocks")
        if depth == -3:
            return Kind(REQMAP, Confidence.HIGH, "annotated mapping of KVCacheBlock lists")
        if depth == -4:
            return Kind(BLOCKMAP, Confidence.HIGH, "annotated mapping of KVCacheBlock")
        if depth == -2:
            text = ast.unparse(node) if not isinstance(node, ast.Constant) else str(node.value)
            return Kind(OTHER, Confidence.HIGH, f"annotated {text}")
        kind = (BLOCK, BLOCKS, GROUPS)[min(depth, 2)]
        return Kind(kind, Confidence.HIGH, "annotated " + ("KVCacheBlock" if depth == 0 else
                                                         "container of KVCacheBlock"))

    def _ann_depth(self, node: ast.expr) -> int | None:
        """0 block, 1 blocks, 2 groups, -1 KVCacheBlocks, -2 another type, -3 mapping of
        block lists, -4 mapping of blocks, None unknown."""
        if isinstance(node, ast.Constant):
            if not isinstance(node.value, str):
                return None if node.value is not None else -2
            try:
                parsed = ast.parse(node.value, mode="eval").body
            except SyntaxError:
                return None
            return self._ann_depth(parsed)
        name = _name_of(node)
        if name is not None:
            if name in self.vocab.block_types:
                return 0
            if name in self.vocab.kvblocks_types:
                return -1
            if name in _SCALAR_NAMES or name[:1].isupper():
                return -2
            return None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return self._union(self._ann_depth(node.left), self._ann_depth(node.right))
        if isinstance(node, ast.Subscript):
            base = _name_of(node.value)
            args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if base in _WRAPPERS:
                depth: int | None = None
                for arg in args:
                    depth = self._union(depth, self._ann_depth(arg))
                return depth
            if base in _CONTAINER_GENERICS and args:
                inner = self._ann_depth(args[0])
                return inner + 1 if inner is not None and inner >= 0 else (
                    -2 if inner == -2 else None)
            if base in {"dict", "Dict", "Mapping", "MutableMapping", "defaultdict"}:
                value = self._ann_depth(args[1]) if len(args) == 2 else None
                return {0: -4, 1: -3}.get(value, -2) if value is not None else -2
            return -2 if base and base[:1].isupper() else None
        return None

    @staticmethod
    def _union(a: int | None, b: int | None) -> int | None:
        for value in (a, b):
            if value is not None and value >= 0:
                return value
        for special in (-1, -3, -4):
            if special in (a, b):
                return special
        return a if a is not None else b

    # ------------------------------------------------------------- expressions
    def expr(self, node: ast.expr) -> Kind | None:
        """Kind of an expression, from the strongest evidence available."""
        if isinstance(node, ast.Name):
            found = self.lookup(node.id)
            if found is not None and found.kind != UNKNOWN:
                return found
            if node.id == "self" and self._in_class(self.vocab.block_types):
                return Kind(BLOCK, Confidence.HIGH, "self in KVCacheBlock")
            return self._by_name(node.id)
        if isinstance(node, ast.Attribute):
            return self._attribute(node)
        if isinstance(node, ast.Subscript):
            return self._subscript(node)
        if isinstance(node, ast.Call):
            return self._call(node)
        if isinstance(node, ast.IfExp):
            return self.expr(node.body) or self.expr(node.orelse)
        if isinstance(node, ast.BoolOp):
            for value in node.values:
                found = self.expr(value)
                if found is not None:
                    return found
            return None
        if isinstance(node, ast.NamedExpr):
            return self.expr(node.value)
        if isinstance(node, ast.Starred):
            return self.expr(node.value)
        if isinstance(node, ast.List | ast.Tuple) and node.elts:
            inner = self.expr(node.elts[0])
            if inner is not None and inner.kind == BLOCK:
                return Kind(BLOCKS, inner.confidence, "literal of " + inner.why)
        return None

    def _by_name(self, name: str) -> Kind | None:
        if _NOT_BLOCK_NAME.search(name):
            return None
        if _BLOCK_NAME.match(name):
            return Kind(BLOCK, Confidence.LOW, f"named {name!r}")
        if _BLOCKS_NAME.match(name):
            return Kind(BLOCKS, Confidence.LOW, f"named {name!r}")
        return None

    def _attribute(self, node: ast.Attribute) -> Kind | None:
        attr = node.attr
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            known = self.self_attr(attr)
            if known is not None:
                return known
        if attr == "blocks":
            owner = self.expr(node.value)
            if owner is not None and owner.kind == KVBLOCKS:
                return Kind(GROUPS, owner.confidence, "KVCacheBlocks.blocks")
            if (isinstance(node.value, ast.Name) and node.value.id == "self"
                    and self._in_class(self.vocab.kvblocks_types)):
                return Kind(GROUPS, Confidence.HIGH, "KVCacheBlocks.blocks")
            if owner is not None and owner.kind == OTHER:
                return None
            return Kind(BLOCKS, Confidence.MEDIUM, "BlockPool.blocks")
        if attr == "req_to_blocks":
            return Kind(REQMAP, Confidence.MEDIUM, "req_to_blocks")
        if attr in self.vocab.containers:
            return Kind(BLOCKS, Confidence.MEDIUM, attr)
        if attr in self.vocab.single:
            return Kind(BLOCK, Confidence.MEDIUM, attr)
        return self._by_name(attr)

    def _subscript(self, node: ast.Subscript) -> Kind | None:
        owner = self.expr(node.value)
        if owner is None:
            return None
        is_slice = isinstance(node.slice, ast.Slice)
        step = {BLOCKS: BLOCK, GROUPS: BLOCKS, REQMAP: BLOCKS, BLOCKMAP: BLOCK}.get(owner.kind)
        if step is None:
            return None
        if is_slice and owner.kind not in (REQMAP, BLOCKMAP):
            return owner
        return Kind(step, owner.confidence, f"element of {owner.why}")

    def _call(self, node: ast.Call) -> Kind | None:
        func = node.func
        name = _name_of(func)
        if name is None:
            return None
        if name in self.vocab.block_types:
            return Kind(BLOCK, Confidence.HIGH, f"constructed {name}(...)")
        if name in self.vocab.kvblocks_types:
            return Kind(KVBLOCKS, Confidence.HIGH, f"constructed {name}(...)")
        if name in self.producers and isinstance(func, ast.Name | ast.Attribute):
            return self.producers[name]
        if name in self.vocab.containers:
            return Kind(BLOCKS, Confidence.MEDIUM, f"{name}(...)")
        if name in self.vocab.single:
            return Kind(BLOCK, Confidence.MEDIUM, f"{name}()")
        if name in {"get", "pop", "setdefault", "values"} and isinstance(func, ast.Attribute):
            owner = self.expr(func.value)
            if owner is None or owner.kind not in (REQMAP, BLOCKMAP):
                return None
            if name == "values":
                kind = GROUPS if owner.kind == REQMAP else BLOCKS
            else:
                kind = BLOCKS if owner.kind == REQMAP else BLOCK
            return Kind(kind, owner.confidence, f"{owner.why}.{name}(...)")
        if name in _SAME_KIND_CALLS and node.args:
            return self.expr(node.args[0])
        if isinstance(func, ast.Name) and name[:1].isupper() and name not in {"Optional"}:
            return Kind(OTHER, Confidence.MEDIUM, f"constructed {name}(...)")
        return None

    # ---------------------------------------------------------------- bindings
    def element_of(self, iterable: ast.expr) -> Kind | None:
        """Kind of one element when iterating ``iterable``."""
        if isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Name):
            fname = iterable.func.id
            if fname in {"reversed", "sorted", "list", "tuple", "iter"} and iterable.args:
                return self.element_of(iterable.args[0])
        owner = self.expr(iterable)
        if owner is None:
            return None
        step = {BLOCKS: BLOCK, GROUPS: BLOCKS}.get(owner.kind)
        if step is None:
            return None
        why = owner.why if owner.why.startswith("iterating") else f"iterating {owner.why}"
        return Kind(step, owner.confidence, why)

    def bind_target(self, target: ast.expr, iterable: ast.expr) -> None:
        """Bind a ``for`` / comprehension target over ``iterable``."""
        if isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Name):
            fname = iterable.func.id
            if fname == "enumerate" and iterable.args and isinstance(target, ast.Tuple) \
                    and len(target.elts) == 2:
                self.bind_target(target.elts[1], iterable.args[0])
                return
            if fname == "zip" and isinstance(target, ast.Tuple) \
                    and len(target.elts) == len(iterable.args):
                for elt, arg in zip(target.elts, iterable.args, strict=True):
                    self.bind_target(elt, arg)
                return
        if (isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Attribute)
                and iterable.func.attr == "items" and isinstance(target, ast.Tuple)
                and len(target.elts) == 2 and isinstance(target.elts[1], ast.Name)):
            owner = self.expr(iterable.func.value)
            if owner is not None and owner.kind in (REQMAP, BLOCKMAP):
                kind = BLOCKS if owner.kind == REQMAP else BLOCK
                self.set(target.elts[1].id, Kind(kind, owner.confidence, f"{owner.why}.items()"))
            return
        if isinstance(target, ast.Name):
            kind = self.element_of(iterable)
            if kind is not None:
                self.set(target.id, kind)

    def set(self, name: str, kind: Kind) -> None:
        old = self.names.get(name)
        if old is None or old.kind == UNKNOWN or kind.confidence > old.confidence:
            self.names[name] = kind
