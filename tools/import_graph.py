#!/usr/bin/env python3
"""The project's import graph: cycles, and with ``--layers`` the arrows that point the wrong way.

A cycle means neither module can be read, tested or moved without the other, and which one runs
first depends on who imported whom; an upward arrow means a lower layer (the pure policy, the
calibration) cannot be used without dragging in a higher one (the simulator). Both are cheap to
prevent and costly to undo, so this runs as a test.

Every import counts, wherever it sits: one inside a function is still a dependency, only deferred; one
in an ``if TYPE_CHECKING:`` block is one for whoever reads or type-checks the module, so it makes a cycle
as much as any other. A module that imports :mod:`importlib` and names a project module in a string
(``importlib.import_module("sim.commands.simulate")``, or a table of such names) is taken to import it: by name.

The console script's dispatcher (``DISPATCHERS``: impl.cli) is the one place a lower layer names a
higher one, by name only: it loads a subcommand's module when that subcommand is asked for, so
``bidikv router`` never loads the simulator (tests/test_run_time_layers.py checks ``sys.modules``).

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
    # the measurements, their format and the models fitted to them: below both the simulator and what
    # is deployed (the connector's cost model, deploy's instance presets)
    ("calibration", ("calibration", "impl.policy"), None),
    ("impl", None, ("sim",)),  # what is deployed runs without the simulator
    ("sim", None, ()),  # may import impl and calibration: the layers below it
)

# Modules whose by-name imports (the subcommand each loads when asked for) are exempt from the layer
# rules; their ordinary imports are not.
DISPATCHERS = ("impl.cli",)


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    kind: str = "import"  # "import" (runs), "type" (under TYPE_CHECKING), "by_name" (a string to importlib)


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
    """(import statement, kind): "type" inside the body of ``if TYPE_CHECKING:`` (not its else), else
    "import"."""
    stack = [(tree, "import")]
    while stack:
        node, kind = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, kind
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend((child, "type") for child in node.body)
            stack.extend((child, kind) for child in node.orelse)
            continue
        stack.extend((child, kind) for child in ast.iter_child_nodes(node))


def _uses_importlib(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "importlib" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "importlib" and not node.level:
            return True
        if isinstance(node, ast.Name) and node.id == "__import__":
            return True
    return False


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _by_name(tree: ast.AST, known: dict[str, Path]):
    """(line, module) of every string that is exactly a project module's name, in a module that uses
    importlib: what it can load by name."""
    if not _uses_importlib(tree):
        return
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        # a dotted name: a bare "impl" or "sim" is as often an extra's or a directory's name
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value
                and node.value in known and id(node) not in docstrings):
            yield node.lineno, node.value


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
        for line, target in _by_name(tree, known):
            if target != name:
                found[Edge(name, target, line, "by_name")] = None
        for node, kind in _imports(tree):
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
                    found[Edge(name, resolved, node.lineno, kind)] = None
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
        if edge.kind == "by_name" and edge.source in DISPATCHERS:
            continue
        for layer, allowed, forbidden in LAYERS:
            if not _within(edge.source, layer):
                continue
            if allowed is not None and not any(_within(edge.target, p) for p in allowed):
                bad.append(edge)
            elif forbidden and any(_within(edge.target, p) for p in forbidden):
                bad.append(edge)
            break
    return bad


def _kind(kind: str) -> str:
    return "" if kind == "import" else f" ({kind})"


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
    kinds = {kind: len({(e.source, e.target) for e in found if e.kind == kind}) for kind in ("type", "by_name")}
    print(f"{len(graph)} modules, {len({(e.source, e.target) for e in found})} arrows "
          f"({kinds['type']} type-only, {kinds['by_name']} by name), {len(components)} cycles")
    for component in components:
        failed = True
        members = set(component)
        print(f"cycle of {len(component)}: {' '.join(component)}")
        inside = {(e.source, e.target, e.kind) for e in found if e.source in members and e.target in members}
        for source, target, kind in sorted(inside):
            print(f"  {source} -> {target}{_kind(kind)}")
    if args.layers:
        bad = violations(found)
        print(f"{len(bad)} layer violations")
        for edge in sorted(bad, key=lambda e: (e.source, e.line)):
            failed = True
            print(f"  {edge.source}:{edge.line} -> {edge.target}{_kind(edge.kind)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
