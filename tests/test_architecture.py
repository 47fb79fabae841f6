"""The module map stays a map: no import cycles, and ``inference`` never imports ``pipeline``.

Imports are read with ``ast`` from the source files, so the test sees what a
reader sees: module-level imports, the lazy ones inside functions, the ones under
``if TYPE_CHECKING:`` (the type checker follows them, and a ring through them is
a ring in the design) and modules named as strings to ``importlib.import_module``
alike.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGES = ("pipeline", "inference")


def module_files() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = module_files()


def _all_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, wherever it is (module level, functions, ``if TYPE_CHECKING:``)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def _imported_by_name(tree: ast.Module) -> Iterator[ast.Import]:
    """``importlib.import_module("a.b")`` (or ``import_module``, ``__import__``) with a literal
    name, as the import statement it stands for."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        first = node.args[0]
        if called in ("import_module", "__import__") and isinstance(first, ast.Constant):
            if isinstance(first.value, str):
                yield ast.Import(names=[ast.alias(name=first.value)])


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The project modules an import statement loads (a submodule loads its packages too)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".")
            if MODULES[module].name != "__init__.py":
                package = package[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, base] if base else package)
        # "from pkg import mod" depends on mod; "from pkg import name" on pkg itself.
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    out: set[str] = set()
    for name in names:
        # The module the name is (or, for "from pkg.mod import func", the one it lives in).
        # Parent packages load first but are not dependencies of their own submodules'
        # importers, so only the deepest module counts.
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            candidate = ".".join(parts[:i])
            if candidate in MODULES:
                out.add(candidate)
                break
    out.discard(module)
    return out


def import_graph() -> dict[str, set[str]]:
    """Each module's project imports, of every kind."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        nodes = [*_all_imports(tree), *_imported_by_name(tree)]
        graph[module] = set().union(*(_targets(module, n) for n in nodes))
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_the_checker_finds_a_cycle() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_type_checking_and_importlib_imports_count() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import importlib\n"
        "if TYPE_CHECKING:\n"
        "    from pipeline.config import PipelineConfig\n"
        "def make():\n"
        "    return importlib.import_module('pipeline.sources.file')\n"
    )
    tree = ast.parse(source)
    module = "pipeline.sources.schemes"
    nodes = [*_all_imports(tree), *_imported_by_name(tree)]
    found = set().union(*(_targets(module, n) for n in nodes))
    assert found == {"pipeline.config", "pipeline.sources.file"}


GRAPH = import_graph()


def test_no_import_cycles_among_modules() -> None:
    # A lazy import inside a function is still a dependency: a cycle through one is a
    # cycle in the design, even if it does not fail at import time.
    cycles = find_cycles(GRAPH)
    assert cycles == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("inference")))
def test_inference_never_imports_pipeline(module: str) -> None:
    assert not any(t.startswith("pipeline") for t in GRAPH[module])
