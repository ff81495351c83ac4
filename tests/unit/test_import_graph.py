"""The house plan, checked on the source: imports point one way, no module imports itself back.

Reads every module's imports with ``ast`` (top-level and function-level alike), so a lazy
import inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("connector", "offload_tiers", "audit")

# (importer prefix, forbidden imported prefix, why)
FORBIDDEN = [
    ("offload_tiers", "connector", "storage knows nothing of vLLM or the connector"),
    ("offload_tiers", "vllm", "storage knows nothing of vLLM"),
    ("audit", "connector", "the linter stands alone"),
    ("audit", "offload_tiers", "the linter stands alone"),
    ("connector.events", "connector.vllm_connector", "events never depend on the connector"),
    ("connector.events", "connector.daemon", "classify -> index -> daemon, never back"),
    ("connector.events", "connector.demo", "events never depend on the demo"),
    ("connector.events", "vllm", "the event model never imports vLLM"),
    ("connector.daemon", "connector.vllm_connector", "the daemon runs without the connector"),
    ("connector.daemon", "vllm", "the daemon never imports vLLM"),
    ("connector.vllm_connector", "connector.daemon", "the connector never needs the daemon"),
    ("connector.identity", "vllm", "the identity reads vLLM's objects by attribute only"),
    ("connector.identity", "connector.vllm_connector", "both halves use it, it uses neither"),
    ("connector.identity", "connector.native_tier", "both halves use it, it uses neither"),
    ("connector.vllm_connector", "connector.demo", "the connector never needs the demo"),
    *(("connector.lmcache_l2", f"connector.{room}", "the LMCache adapter uses offload_tiers "
        "only") for room in ("vllm_connector", "native_tier", "identity", "events", "daemon",
                             "demo", "cli")),
    ("connector.lmcache_l2", "vllm", "the LMCache adapter never imports vLLM"),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = {m for m in _imports(path)
                       if m in modules or m.split(".")[0] in ("vllm", "lmcache")}
    return graph


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_the_graph_is_not_empty() -> None:
    graph = _graph()
    assert "connector.vllm_connector.remote_store_factory" in graph
    assert "offload_tiers.redis.tier" in graph["connector.vllm_connector.remote_store_factory"]


@pytest.mark.parametrize(("importer", "imported", "why"), FORBIDDEN)
def test_imports_point_one_way(importer: str, imported: str, why: str) -> None:
    bad = sorted(f"{mod} imports {dep}" for mod, deps in _graph().items()
                 if _within(mod, importer) for dep in deps if _within(dep, imported))
    assert not bad, f"{why}: " + "; ".join(bad)


def test_only_the_lmcache_adapter_imports_lmcache() -> None:
    importers = sorted(mod for mod, deps in _graph().items()
                       if any(_within(dep, "lmcache") for dep in deps))
    assert importers == ["connector.lmcache_l2.adapter"]


def test_no_import_cycles_between_modules() -> None:
    graph = {m: {d for d in deps if not d.startswith(("vllm", "lmcache"))}
             for m, deps in _graph().items()}
    # a package's __init__ is not an edge target for its own members' cycles
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if dep not in graph or _within(node, dep):
                continue
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles: " + " | ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize(("importer", "forbidden"), [
    ("rigs", ("tests", "benchmarks")), ("benchmarks", ("tests",))])
def test_rigs_and_benchmarks_never_import_tests(importer: str, forbidden: tuple[str, ...]) -> None:
    """rigs/ (the servers and processes tests and benchmarks share) sits between them and the
    product: tests and benchmarks -> rigs -> connector, offload_tiers."""
    paths = sorted((REPO / importer).rglob("*.py"))
    bad = sorted(f"{_module_name(path)} imports {dep}" for path in paths
                 for dep in _imports(path) if dep.split(".")[0] in forbidden)
    assert paths
    assert not bad, "; ".join(bad)
