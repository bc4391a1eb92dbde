"""
The packages' import rules: the server, the node and the Router share only
what lives outside all three (L{kcoral.common}, L{kcoral.web} ...), and no
modules import each other in a circle, type-checking imports included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kcoral

ROOT = Path(kcoral.__file__).parent

#: (importer's package, imported package) pairs that must not occur.
FORBIDDEN = {("server", "router"), ("server", "node"), ("node", "server"), ("router", "server"),
             ("router", "node"), ("common", "server"), ("common", "node"), ("common", "router")}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every kcoral module and the kcoral modules it imports."""
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            found.update(t for t in targets if t in modules and t != name)
        graph[name] = found
    return graph


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else None


def test_no_import_crosses_between_server_node_and_router():
    """No module of the server, the node, the Router or the shared package
    imports one of a component it must not know."""
    crossing = sorted((m, t) for m, targets in _imports().items() for t in targets
                      if (_package(m), _package(t)) in FORBIDDEN)
    assert crossing == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of C{graph} with more than one
    vertex (Tarjan's): each a set of vertices that reach each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_modules_import_each_other_in_a_circle():
    """The import graph of kcoral has no cycle (Tarjan's strongly connected components)."""
    cycles = _cycles(_imports())
    assert cycles == []


def test_no_packages_import_each_other_in_a_circle():
    """Seen package by package (kcoral.protocol, kcoral.models, a top-level module as its own),
    kcoral's imports have no cycle: each package builds on others, never back."""
    packages: dict[str, set[str]] = {}
    for module, targets in _imports().items():
        home = module.split(".")[1] if "." in module else module
        packages.setdefault(home, set()).update(
            t.split(".")[1] for t in targets if "." in t and t.split(".")[1] != home)
    for targets in list(packages.values()):
        for target in targets:
            packages.setdefault(target, set())
    cycles = _cycles(packages)
    assert cycles == []
