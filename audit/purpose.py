"""What a presence test drives: a count, a selection, a position, a yes/no, or membership.

Given the test's place in the tree (the ancestor stack) and its consumer, :class:`Purpose`
picks the rule code. Signals are read from the "region" the test decides: the ``if`` body and
``else``, plus the rest of the block after an early ``continue``/``return``/``break`` (nested
loops are not part of it).
"""

from __future__ import annotations

import ast
import re
from typing import TYPE_CHECKING

from audit.resolve import Resolver

if TYPE_CHECKING:
    from audit.model import Candidate

HASH_ATTR = "block_hash"
NUM_TOKENS_ATTR = "block_hash_num_tokens"

COUNT, SELECT, INDEX, DECIDE, UNCLEAR, MEMBER, CORRECT = (
    "KVT001", "KVT002", "KVT003", "KVT004", "KVT005", "KVT006", "")

DEFAULT_BOOKKEEPING_CLASSES = frozenset({
    "BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock", "BlockHashToBlockMap",
})
_MEMBER_FUNC = re.compile(r"writable|set_block_hash|reset_hash|insert_block_hash|"
                          r"remove_cached|evict|touch|free_blocks|hash_to_block|"
                          r"^_?(is|was|has)_(cached|hashed)$", re.I)
_TRANSFER_FUNC = re.compile(r"load|store|save|recv|receive|send|transfer|offload|fetch|"
                            r"pull|push|select|pick|choose|prefetch|copy|sched", re.I)
_DECIDE_NAME = re.compile(r"full|computed|complete|ready|loaded|filled|done|finished", re.I)
_COUNT_NAME = re.compile(r"num|count|total|tokens|blocks|len|(^|_)n(_|$)|size|hit|computed",
                         re.I)
_COLLECT_METHODS = frozenset({"append", "add", "extend", "insert", "appendleft", "put",
                              "put_nowait", "setdefault", "update"})
_TERMINAL = (ast.Continue, ast.Return, ast.Break, ast.Raise)
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


class Purpose:
    """Classifies presence tests found while walking one module (shares the walk's stack)."""

    def __init__(self, stack: list[ast.AST], bookkeeping: frozenset[str]) -> None:
        self._stack = stack
        self.bookkeeping = bookkeeping

    def classify(self, cand: Candidate, test: ast.expr, consumer: ast.AST, child: ast.AST,
                  depth: int, scope: Resolver) -> str:
        stack = self._stack
        func = _enclosing(stack, depth, ast.FunctionDef | ast.AsyncFunctionDef)
        func_name = func.name if func is not None else ""
        cls = _enclosing(stack, depth, ast.ClassDef)
        region = self._region(consumer, child, depth)
        if _consults_num_tokens([child, *region]):
            return CORRECT
        if (cls is not None and cls.name in self.bookkeeping) or _MEMBER_FUNC.search(func_name):
            return MEMBER
        outer = stack[depth - 1] if depth >= 1 else None
        if isinstance(consumer, ast.comprehension):
            return self._in_comprehension(outer, depth, scope)
        if isinstance(consumer, ast.GeneratorExp | ast.ListComp | ast.SetComp):
            call = call_name(outer) if outer is not None else ""
            return {"sum": COUNT, "len": COUNT, "any": DECIDE, "all": DECIDE,
                    "next": INDEX}.get(call, SELECT)
        if isinstance(consumer, ast.Lambda):
            named = _binding_name(outer)
            if named:  # ``is_cached=lambda i: ...`` / ``is_full = lambda b: ...``
                return MEMBER if _MEMBER_FUNC.search(named) else (
                    DECIDE if _DECIDE_NAME.search(named) else UNCLEAR)
            call = call_name(outer) if outer is not None else ""
            if call == "map" and depth >= 2 and call_name(stack[depth - 2]) == "sum":
                return COUNT
            return {"filter": SELECT, "map": SELECT, "any": DECIDE, "all": DECIDE,
                    "takewhile": INDEX, "dropwhile": INDEX}.get(call, UNCLEAR)
        if isinstance(consumer, ast.Call):
            call = call_name(consumer)
            return {"sum": COUNT, "len": COUNT, "any": DECIDE, "all": DECIDE,
                    "filter": SELECT}.get(call, UNCLEAR)
        if isinstance(consumer, ast.AugAssign):
            return COUNT
        if isinstance(consumer, ast.Assert):
            return MEMBER
        if isinstance(consumer, ast.Return):
            if _DECIDE_NAME.search(func_name):
                return DECIDE
            return UNCLEAR
        if isinstance(consumer, ast.Assign | ast.AnnAssign):
            targets = consumer.targets if isinstance(consumer, ast.Assign) else [consumer.target]
            names = " ".join(_target_text(t) for t in targets)
            if _MEMBER_FUNC.search(names):
                return MEMBER
            if _DECIDE_NAME.search(names):
                return DECIDE
            return UNCLEAR
        if isinstance(consumer, ast.If | ast.While):
            return self._classify_region(cand, consumer, region, func_name, scope)
        return UNCLEAR

    def _in_comprehension(self, comp: ast.AST | None, depth: int, scope: Resolver) -> str:
        """A test in a comprehension's ``if``: by the call that consumes the comprehension,
        else by what it yields (only hashes: membership)."""
        call = call_name(self._stack[depth - 2]) if depth >= 2 else ""
        if call in {"sum", "len"}:
            return COUNT
        if call in {"any", "all"}:
            return DECIDE
        if call == "next":
            return INDEX
        elt = getattr(comp, "elt", None) or getattr(comp, "value", None)
        if elt is not None and self._is_hash_only(elt, scope):
            return MEMBER
        return SELECT

    def _region(self, consumer: ast.AST, child: ast.AST, depth: int) -> list[ast.AST]:
        """Statements (or expressions) whose execution the test decides."""
        if isinstance(consumer, ast.comprehension):
            comp = self._stack[depth - 1] if depth >= 1 else None
            parts: list[ast.AST] = list(consumer.ifs)
            for attr in ("elt", "key", "value"):
                if getattr(comp, attr, None) is not None:
                    parts.append(getattr(comp, attr))
            return parts
        if not isinstance(consumer, ast.If | ast.While) or consumer.test is not child:
            return [consumer] if isinstance(consumer, ast.stmt) else []
        region: list[ast.AST] = [*consumer.body, *consumer.orelse]
        if isinstance(consumer, ast.If) and consumer.body \
                and isinstance(consumer.body[-1], _TERMINAL) and depth >= 1:
            holder = self._stack[depth - 1]
            for field in ("body", "orelse", "finalbody"):
                stmts = getattr(holder, field, None)
                if isinstance(stmts, list) and consumer in stmts:
                    region.extend(stmts[stmts.index(consumer) + 1:])
                    break
        return region

    def _classify_region(self, cand: Candidate, stmt: ast.If | ast.While,
                         region: list[ast.AST], func_name: str, scope: Resolver) -> str:
        loop_vars = self._loop_vars(stmt)
        base = _base_name(cand.receiver)
        watched = loop_vars | ({base} if base else set())
        signals: set[str] = set()
        for node in _flat(region):
            if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add | ast.Sub) \
                    and _COUNT_NAME.search(_target_text(node.target)):
                signals.add(COUNT)
            elif isinstance(node, ast.Break):
                signals.add(INDEX)
            elif isinstance(node, ast.Assign) and _mentions(node.value, loop_vars - {base}) \
                    and not isinstance(node.value, ast.Subscript):
                signals.add(INDEX)
            elif isinstance(node, ast.Return) and node.value is not None:
                if _mentions(node.value, loop_vars - {base}):
                    signals.add(INDEX)
                elif _TRANSFER_FUNC.search(func_name):
                    signals.add(SELECT)
                elif _DECIDE_NAME.search(func_name):
                    signals.add(DECIDE)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in _COLLECT_METHODS:
                if any(_mentions(a, watched) and not self._is_hash_only(a, scope)
                       for a in node.args):
                    signals.add(SELECT)
            elif isinstance(node, ast.Yield | ast.YieldFrom):
                signals.add(SELECT)
            elif isinstance(node, ast.Call) and _MEMBER_FUNC.search(call_name(node)):
                signals.add(MEMBER)  # evict / remove_cached / touch ... the cache entry
        if isinstance(stmt, ast.While) and COUNT not in signals and any(
                isinstance(n, ast.AugAssign) for n in _flat(region)):
            signals.add(INDEX)
        for code in (COUNT, INDEX, SELECT, DECIDE):
            if code in signals:
                return code
        if MEMBER in signals or any(self._is_hash_only(n, scope) for n in _flat(region)):
            return MEMBER
        if _TRANSFER_FUNC.search(func_name) and isinstance(stmt, ast.If) and stmt.body \
                and isinstance(stmt.body[-1], ast.Continue | ast.Return):
            return SELECT
        return UNCLEAR

    def _loop_vars(self, stmt: ast.AST) -> set[str]:
        """Names bound by the enclosing ``for`` loops of this function (indices, elements)."""
        names: set[str] = set()
        for node in reversed(self._stack):
            if isinstance(node, ast.For | ast.AsyncFor):
                names |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
            if isinstance(node, SCOPES):
                break
        return names

    def _is_hash_only(self, node: ast.AST, scope: Resolver) -> bool:
        if isinstance(node, ast.Attribute) and node.attr == HASH_ATTR:
            return True
        return isinstance(node, ast.Name) and scope.alias(node.id) is not None

    # -------------------------------------------------------------- reporting


# ------------------------------------------------------------------ helpers
def call_name(node: ast.AST | None) -> str:
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Name):
            return node.func.id
        if isinstance(node.func, ast.Attribute):
            return node.func.attr
    return ""


def _binding_name(node: ast.AST | None) -> str:
    """The name a value is bound to: a keyword argument or a single assignment target."""
    if isinstance(node, ast.keyword):
        return node.arg or ""
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        return _target_text(node.targets[0])
    return ""


def _enclosing(stack: list[ast.AST], depth: int, kind: type | tuple[type, ...]):
    for node in reversed(stack[: depth + 1]):
        if isinstance(node, kind):
            return node
    return None


def _target_text(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):
        return _target_text(node.value)
    return ""


def _base_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _mentions(node: ast.AST, names: set[str]) -> bool:
    if not names:
        return False
    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(node))


def _flat(region: list[ast.AST]) -> list[ast.AST]:
    """Every node of the region, descending into if/with/try but not into loops or defs."""
    out: list[ast.AST] = []
    todo = list(reversed(region))
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, SCOPES):
            continue
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.For | ast.AsyncFor | ast.While):
            children = [node.iter] if isinstance(node, ast.For | ast.AsyncFor) else [node.test]
        todo.extend(reversed(children))
    return out


def _consults_num_tokens(region: list[ast.AST]) -> bool:
    """True when ``block_hash_num_tokens`` feeds the decision beyond a None check."""
    for node in _flat(region):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and any(
                isinstance(x, ast.Constant) and x.value is None
                for x in (node.left, *node.comparators)):
            continue  # ``num_tokens is not None`` alone says nothing about fullness
        for sub in ast.iter_child_nodes(node):
            if isinstance(sub, ast.Attribute) and sub.attr == NUM_TOKENS_ATTR:
                return True
    return False
