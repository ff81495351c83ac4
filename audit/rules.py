"""The checker: find presence tests on a KV-cache block's ``block_hash`` and judge their purpose.

One pass per file. Each scope (module, class, function, lambda) gets a :class:`Resolver`
that is filled flow-insensitively before its statements are checked. A candidate is
``R.block_hash``, ``getattr(R, "block_hash", ...)`` or a local alias of one; it is reported
only when it is tested for presence and ``R`` resolves to a block. What the test drives
(counting, selecting, a position, a yes/no on fullness, membership) picks the code.
"""

from __future__ import annotations

import ast
import bisect
from collections.abc import Sequence
from dataclasses import replace

from audit.fixes import suggest
from audit.model import RULES, Candidate, Confidence, Finding
from audit.purpose import (
    CORRECT,
    DEFAULT_BOOKKEEPING_CLASSES,
    HASH_ATTR,
    SCOPES,
    Purpose,
    call_name,
)
from audit.resolve import (
    BLOCK,
    BLOCKS,
    GROUPS,
    KVBLOCKS,
    OTHER,
    UNKNOWN,
    Kind,
    Resolver,
    Vocabulary,
)


class Checker:
    """Checks one parsed module; :meth:`run` returns its findings (unsuppressed)."""

    def __init__(self, path: str, tree: ast.Module, vocab: Vocabulary,
                 bookkeeping: frozenset[str] = DEFAULT_BOOKKEEPING_CLASSES,
                 hash_lines: Sequence[int] | None = None) -> None:
        self.path = path
        self.tree = tree
        # Lines that mention block_hash: statements spanning none of them are skipped.
        self.hash_lines = list(hash_lines) if hash_lines is not None else None
        self.vocab = vocab
        self.bookkeeping = bookkeeping
        self.findings: list[Finding] = []
        self._stack: list[ast.AST] = []
        self._purpose = Purpose(self._stack, bookkeeping)

    # ---------------------------------------------------------------- driving
    def run(self) -> list[Finding]:
        self.vocab = self._with_import_aliases(self.vocab)
        root = Resolver(self.vocab)
        self._collect_producers(root)
        self._prebind(self.tree.body, root)
        self._stack.append(self.tree)
        for child in self.tree.body:
            self._visit(child, root)
        return self.findings

    def _with_import_aliases(self, vocab: Vocabulary) -> Vocabulary:
        """``from ... import KVCacheBlock as Blk``: ``Blk`` names a block type in this file."""
        block, kvblocks = set(vocab.block_types), set(vocab.kvblocks_types)
        todo: list[ast.stmt] = list(self.tree.body)
        while todo:
            node = todo.pop()
            if isinstance(node, ast.If | ast.Try):
                todo.extend(node.body)
                todo.extend(node.orelse)
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.asname and alias.name in vocab.block_types:
                        block.add(alias.asname)
                    elif alias.asname and alias.name in vocab.kvblocks_types:
                        kvblocks.add(alias.asname)
        if len(block) == len(vocab.block_types) and len(kvblocks) == len(vocab.kvblocks_types):
            return vocab
        return replace(vocab, block_types=frozenset(block), kvblocks_types=frozenset(kvblocks))

    def _relevant(self, node: ast.stmt) -> bool:
        if self.hash_lines is None:
            return True
        i = bisect.bisect_left(self.hash_lines, node.lineno)
        return i < len(self.hash_lines) and self.hash_lines[i] <= (node.end_lineno or
                                                                   node.lineno)

    def _collect_producers(self, root: Resolver) -> None:
        todo: list[ast.stmt] = list(self.tree.body)
        while todo:
            node = todo.pop()
            if isinstance(node, ast.ClassDef):
                todo.extend(node.body)
                continue
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                todo.extend(node.body)
            else:
                continue
            if node.returns:
                kind = root.annotation(node.returns)
                if kind is not None and kind.kind in (BLOCK, BLOCKS, GROUPS, KVBLOCKS):
                    root.producers[node.name] = Kind(kind.kind, kind.confidence,
                                                     f"{node.name}() -> {kind.why[10:]}")

    def _visit(self, node: ast.AST, resolver: Resolver) -> None:
        """Depth-first walk with an explicit work list (no recursion limit on deep code)."""
        work: list[tuple[ast.AST | None, Resolver]] = [(node, resolver)]
        while work:
            current, scope = work.pop()
            if current is None:  # leaving a node
                self._stack.pop()
                continue
            if isinstance(current, SCOPES) and not self._relevant(current):
                continue  # no block_hash inside: nothing to resolve or report
            if (isinstance(current, ast.stmt) and len(self._stack) == 1
                    and not scope.aliases and not self._relevant(current)):
                continue  # module-level statement without block_hash (and no module alias)
            if isinstance(current, SCOPES):
                scope = self._enter_scope(current, scope)
            else:
                self._check(current, scope)
            self._stack.append(current)
            work.append((None, scope))
            work.extend((child, scope) for child in reversed(list(ast.iter_child_nodes(current))))

    def _enter_scope(self, node: ast.AST, parent: Resolver) -> Resolver:
        if isinstance(node, ast.ClassDef):
            scope = Resolver(self.vocab, class_name=node.name, parent=parent)
            self._collect_attrs(node, scope)
            return scope
        scope = Resolver(self.vocab, parent=parent)
        args = node.args  # type: ignore[attr-defined]
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            kind = scope.annotation(arg.annotation)
            scope.set(arg.arg, kind if kind is not None else
                      Kind(UNKNOWN, Confidence.LOW, "unannotated parameter"))
        if isinstance(node, ast.Lambda):
            self._bind_lambda(node, parent, scope)
        body = node.body if isinstance(node.body, list) else [node.body]
        self._prebind(body, scope)
        return scope

    @staticmethod
    def _collect_attrs(cls: ast.ClassDef, scope: Resolver) -> None:
        """Class-body field annotations and ``self.x: T`` / ``self.x = KVCacheBlock(...)``."""
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                kind = scope.annotation(stmt.annotation)
                if kind is not None:
                    scope.attrs[stmt.target.id] = kind
        for node in ast.walk(cls):
            target, kind = None, None
            if isinstance(node, ast.AnnAssign):
                target, kind = node.target, scope.annotation(node.annotation)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 \
                    and isinstance(node.value, ast.Call):
                target, kind = node.targets[0], scope.expr(node.value)
            if (kind is not None and isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name) and target.value.id == "self"):
                old = scope.attrs.get(target.attr)
                if old is None or kind.confidence > old.confidence:
                    scope.attrs[target.attr] = kind

    def _bind_lambda(self, node: ast.Lambda, parent: Resolver, scope: Resolver) -> None:
        """``filter(lambda b: ..., blocks)``: ``b`` is an element of ``blocks``."""
        call = self._stack[-1] if self._stack else None
        if not (isinstance(call, ast.Call) and call.args and call.args[0] is node
                and call_name(call) in {"filter", "map", "sorted", "min", "max", "takewhile",
                                         "dropwhile"}
                and len(call.args) >= 2 and node.args.args):
            return
        kind = parent.element_of(call.args[1])
        if kind is not None:
            scope.set(node.args.args[0].arg, kind)

    # ---------------------------------------------------------------- binding
    def _prebind(self, body: list[ast.stmt] | list[ast.expr], scope: Resolver) -> None:
        nodes: list[ast.AST] = []
        todo: list[ast.AST] = list(body)
        while todo:
            node = todo.pop()
            if isinstance(node, SCOPES):
                continue
            nodes.append(node)
            todo.extend(ast.iter_child_nodes(node))
        nodes.reverse()
        for _ in range(2):  # a second pass propagates through chains of assignments
            for node in nodes:
                self._bind(node, scope)

    def _bind(self, node: ast.AST, scope: Resolver) -> None:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                self._bind_value(target, node.value, scope)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            kind = scope.annotation(node.annotation)
            if kind is not None:
                scope.set(node.target.id, kind)
            elif node.value is not None:
                self._bind_value(node.target, node.value, scope)
        elif isinstance(node, ast.NamedExpr):
            self._bind_value(node.target, node.value, scope)
        elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
            scope.bind_target(node.target, node.iter)

    def _bind_value(self, target: ast.expr, value: ast.expr, scope: Resolver) -> None:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) \
                and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts, strict=True):
                self._bind_value(t, v, scope)
            return
        if not isinstance(target, ast.Name):
            return
        source = self._hash_source(value, scope, follow_alias=False)
        if source is not None:
            scope.aliases[target.id] = (source.receiver, source.kind)
            return
        kind = scope.expr(value)
        if kind is not None and (kind.kind == OTHER or kind.confidence > 1
                                 or target.id not in scope.names):
            scope.set(target.id, kind)

    # ------------------------------------------------------------- candidates
    def _hash_source(self, node: ast.AST, scope: Resolver,
                     follow_alias: bool = True) -> Candidate | None:
        receiver: ast.expr | None = None
        if isinstance(node, ast.Attribute) and node.attr == HASH_ATTR \
                and isinstance(node.ctx, ast.Load):
            receiver = node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "getattr" and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value == HASH_ATTR):
            receiver = node.args[0]
        elif follow_alias and isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            found = scope.alias(node.id)
            if found is not None:
                return Candidate(node, found[0], found[1])
            return None
        if receiver is None:
            return None
        kind = scope.expr(receiver)
        if kind is None or kind.kind != BLOCK:
            return None
        return Candidate(node, receiver, kind)

    def _check(self, node: ast.AST, scope: Resolver) -> None:
        if not isinstance(node, ast.Attribute | ast.Call | ast.Name):
            return
        cand = self._hash_source(node, scope)
        if cand is None:
            return
        stack = self._stack
        test, consumer, child, depth = self._presence_test(cand.node, stack)
        if test is None:
            return
        code = self._purpose.classify(cand, test, consumer, child, depth, scope)
        if code == CORRECT:
            return
        self._report(cand, test, code, depth)

    # --------------------------------------------------------- presence tests
    def _presence_test(self, node: ast.expr, stack: list[ast.AST]
                       ) -> tuple[ast.expr | None, ast.AST | None, ast.AST | None, int]:
        """(the test node, its consumer, the consumer's child on the path, stack depth)."""
        i = len(stack) - 1
        cur: ast.AST = node
        while i >= 0 and isinstance(stack[i], ast.NamedExpr) and stack[i].value is cur:
            cur, i = stack[i], i - 1
        if i < 0:
            return None, None, None, 0
        parent = stack[i]
        if isinstance(parent, ast.Compare):
            if len(parent.ops) != 1 or not isinstance(parent.ops[0], ast.Is | ast.IsNot
                                                      | ast.Eq | ast.NotEq):
                return None, None, None, 0
            other = parent.comparators[0] if parent.left is cur else parent.left
            if not (isinstance(other, ast.Constant) and other.value is None):
                return None, None, None, 0
            cur, i = parent, i - 1
        elif not self._truthy_context(cur, parent, stack, i):
            return None, None, None, 0
        test = cur
        # climb the boolean plumbing to the construct that consumes the test
        while i >= 0:
            parent = stack[i]
            if isinstance(parent, ast.BoolOp | ast.NamedExpr) or (
                    isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.Not)) or (
                    isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name)
                    and parent.func.id == "bool") or (
                    isinstance(parent, ast.IfExp) and parent.test is cur):
                cur, i = parent, i - 1
                continue
            break
        if i < 0:
            return None, None, None, 0
        return test, stack[i], cur, i

    @staticmethod
    def _truthy_context(cur: ast.AST, parent: ast.AST, stack: list[ast.AST], i: int) -> bool:
        if isinstance(parent, ast.If | ast.While | ast.IfExp | ast.Assert):
            return parent.test is cur
        if isinstance(parent, ast.UnaryOp):
            return isinstance(parent.op, ast.Not)
        if isinstance(parent, ast.BoolOp):
            return True
        if isinstance(parent, ast.comprehension):
            return cur in parent.ifs
        if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name):
            return parent.func.id == "bool" and cur in parent.args
        if isinstance(parent, ast.Lambda):  # filter(lambda b: b.block_hash, ...)
            return i >= 1 and call_name(stack[i - 1]) in {"filter", "any", "all", "takewhile",
                                                           "dropwhile"}
        if isinstance(parent, ast.GeneratorExp | ast.ListComp) and parent.elt is cur:
            return i >= 1 and call_name(stack[i - 1]) in {"any", "all", "filter"}
        return False

    # ---------------------------------------------------------- classification
    def _report(self, cand: Candidate, test: ast.expr, code: str, depth: int) -> None:
        rule = RULES[code]
        recv = ast.unparse(cand.receiver)
        index, block_size, replacement = suggest(cand, test, self._stack)
        fix = rule.fix.format(recv=recv, index=index or "index",
                              block_size=block_size or "block_size", code=code)
        self.findings.append(Finding(
            path=self.path, line=test.lineno, col=test.col_offset + 1, code=code,
            severity=rule.severity, message=f"{rule.summary} (receiver `{recv}`)", fix=fix,
            confidence=cand.kind.confidence, why=cand.kind.why,
            end_line=test.end_lineno or test.lineno, end_col=(test.end_col_offset or 0) + 1,
            suggestion=replacement,
        ))

