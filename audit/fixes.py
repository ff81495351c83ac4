"""Suggested rewrites: replace a presence test by a coverage test where index and size are known.

A rewrite is offered only when both the block's index (an ``enumerate`` index, or the
``range`` index the block was taken with) and a block-size name are in scope, and the test
sits on one line. The replacement is ``R.block_hash_num_tokens == (i + 1) * block_size``
(``!=`` for a negated test): full means the hash covers the block's end position.
"""

from __future__ import annotations

import ast
import difflib
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from audit.model import Candidate, Finding

_BLOCK_SIZE = re.compile(r"^_?(block_size|tokens_per_block|\w+_block_size|page_size)$")


def suggest(cand: Candidate, test: ast.expr, stack: list[ast.AST]
            ) -> tuple[str | None, str | None, tuple[int, int, int, str] | None]:
    """(index text, block-size text, (line, col0, col1, replacement) or None)."""
    func = next((n for n in reversed(stack)
                 if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)), None)
    index = _index_for(cand.receiver, stack, func)
    block_size = _block_size_in(func) if func is not None else None
    if index is None or block_size is None:
        return index, block_size, None
    if isinstance(cand.node, ast.Name):  # an alias: the receiver may be out of reach here
        return index, block_size, None
    node, negated = _outermost_test(test, stack)
    if node.lineno != node.end_lineno:
        return index, block_size, None
    recv = ast.unparse(cand.receiver)
    op = "!=" if negated else "=="
    text = f"{recv}.block_hash_num_tokens {op} ({index} + 1) * {block_size}"
    return index, block_size, (node.lineno, node.col_offset, node.end_col_offset or 0, text)


def _outermost_test(test: ast.expr, stack: list[ast.AST]) -> tuple[ast.expr, bool]:
    """The node to replace and whether it asks 'no hash' (``is None`` / ``not h``)."""
    if isinstance(test, ast.Compare):
        negated = isinstance(test.ops[0], ast.Is | ast.Eq)
        return test, negated
    # truthiness: absorb a directly enclosing ``not``
    for node in reversed(stack):
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) \
                and node.operand is test:
            return node, True
    return test, False


def _index_for(receiver: ast.expr, stack: list[ast.AST], func: ast.AST | None) -> str | None:
    """The loop index that positions ``receiver`` in its request's block list."""
    base = receiver.id if isinstance(receiver, ast.Name) else None
    if isinstance(receiver, ast.Subscript) and isinstance(receiver.slice, ast.Name):
        return receiver.slice.id
    loops: list[ast.For | ast.comprehension] = []
    for node in stack:
        if isinstance(node, ast.For):
            loops.append(node)
        elif isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
            loops.extend(node.generators)  # the element is not below them in the tree
    for loop in reversed(loops):
        it, target = loop.iter, loop.target
        if (isinstance(it, ast.Call) and isinstance(it.func, ast.Name)
                and it.func.id == "enumerate" and isinstance(target, ast.Tuple)
                and len(target.elts) == 2 and isinstance(target.elts[0], ast.Name)
                and isinstance(target.elts[1], ast.Name) and target.elts[1].id == base):
            sliced = it.args and isinstance(it.args[0], ast.Subscript) and isinstance(
                it.args[0].slice, ast.Slice)
            has_start = len(it.args) > 1 or any(k.arg == "start" for k in it.keywords)
            if sliced and not has_start:
                return None  # index relative to a slice: not the block's position
            return target.elts[0].id
        if (isinstance(target, ast.Name) and isinstance(it, ast.Call)
                and isinstance(it.func, ast.Name) and it.func.id == "range"
                and base is not None and func is not None
                and _assigned_from_index(func, base, target.id)):
            return target.id
    return None


def _assigned_from_index(func: ast.AST, name: str, index: str) -> bool:
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets):
            value = node.value
            if isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Name) \
                    and value.slice.id == index:
                return True
    return False


def _block_size_in(func: ast.AST) -> str | None:
    names: list[str] = []
    attrs: list[str] = []
    for node in ast.walk(func):
        if isinstance(node, ast.arg) and _BLOCK_SIZE.match(node.arg):
            names.append(node.arg)
        elif isinstance(node, ast.Name) and _BLOCK_SIZE.match(node.id):
            names.append(node.id)
        elif isinstance(node, ast.Attribute) and _BLOCK_SIZE.match(node.attr):
            attrs.append(ast.unparse(node))
    if names:
        return sorted(names, key=lambda n: (n != "block_size", n))[0]
    return attrs[0] if attrs else None


def unified_diff(path: str, source: str, findings: Iterable[Finding]) -> str:
    """A unified diff applying every single-line suggestion of ``findings`` to ``source``."""
    lines = source.splitlines(keepends=True)
    edits: dict[int, list[tuple[int, int, str]]] = {}
    for finding in findings:
        if finding.suggestion is not None:
            line, col0, col1, text = finding.suggestion
            edits.setdefault(line, []).append((col0, col1, text))
    if not edits:
        return ""
    new = list(lines)
    for line, spans in edits.items():
        raw = lines[line - 1].encode("utf-8")
        for col0, col1, text in sorted(set(spans), reverse=True):  # byte offsets, right first
            raw = raw[:col0] + text.encode("utf-8") + raw[col1:]
        new[line - 1] = raw.decode("utf-8")
    return "".join(difflib.unified_diff(lines, new, fromfile=f"a/{path.lstrip('/')}",
                                          tofile=f"b/{path.lstrip('/')}"))
