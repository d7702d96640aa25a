#!/usr/bin/env python3
"""The project's import graph: cycles, and with ``--layers`` the arrows that point the wrong way.

A cycle means neither module can be read, tested or moved without the other, and which one runs
first depends on who imported whom; an upward arrow means a lower layer (the pure policy, the
calibration) cannot be used without dragging in a higher one (the simulator). Both are cheap to
prevent and costly to undo, so this runs as a test.

Every import counts, wherever it sits: one inside a function is still a dependency, only deferred.
The one exception is an ``if TYPE_CHECKING:`` block, which never runs.

Usage: ``python tools/import_graph.py [--layers] [--root DIR]``; exit 1 on a cycle or a violation.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("impl", "sim", "calibration")

# (layer, the project prefixes it may import, the prefixes it must not). A module belongs to the
# first layer whose prefix it has; an import is checked against that layer only.
LAYERS = (
    ("impl.policy", ("impl.policy",), None),  # pure decisions: nothing else of the project
    ("calibration", None, ("sim",)),  # the simulator is built on calibration, never the other way
    ("impl", None, ("sim",)),  # what is deployed runs without the simulator
    ("sim", None, ()),  # may import impl.policy and calibration: the layers below it
)


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            found[module_name(root, path)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Import statements that run, skipping the bodies of ``if TYPE_CHECKING:`` (not their else)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _known(name: str, known: dict[str, Path]) -> str | None:
    """The most specific project module ``import name`` loads."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def edges(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[Edge]:
    known = modules(root, packages)
    found: dict[Edge, None] = {}  # ordered, and ``from x import a, b`` of one module is one arrow
    for name, path in known.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                # ``from x import y`` loads the submodule x.y when there is one, else a name in x
                targets = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in known else stem
                           for alias in node.names]
            for target in targets:
                resolved = _known(target, known)
                if resolved is not None and resolved != name:
                    found[Edge(name, resolved, node.lineno)] = None
    return list(found)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(found: list[Edge]) -> list[Edge]:
    bad = []
    for edge in found:
        for layer, allowed, forbidden in LAYERS:
            if not _within(edge.source, layer):
                continue
            if allowed is not None and not any(_within(edge.target, p) for p in allowed):
                bad.append(edge)
            elif forbidden and any(_within(edge.target, p) for p in forbidden):
                bad.append(edge)
            break
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", action="store_true", help="also check the layering rules")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="the repository (default: the one holding this script)")
    args = parser.parse_args(argv)
    found = edges(args.root)
    graph: dict[str, set[str]] = {name: set() for name in modules(args.root)}
    for edge in found:
        graph[edge.source].add(edge.target)
    failed = False
    components = cycles(graph)
    print(f"{len(graph)} modules, {len({(e.source, e.target) for e in found})} arrows, "
          f"{len(components)} cycles")
    for component in components:
        failed = True
        members = set(component)
        print(f"cycle of {len(component)}: {' '.join(component)}")
        for edge in sorted({(e.source, e.target) for e in found if e.source in members and e.target in members}):
            print(f"  {edge[0]} -> {edge[1]}")
    if args.layers:
        bad = violations(found)
        print(f"{len(bad)} layer violations")
        for edge in sorted(bad, key=lambda e: (e.source, e.line)):
            failed = True
            print(f"  {edge.source}:{edge.line} -> {edge.target}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
