"""No module writes another module's private state or calls its private methods: an assignment to
``x._name``, or a call of ``x._name(...)`` (x not ``self`` or ``cls``), is only of an attribute or method
a class or function of the same module defines (a copy of its own kind, a field of its own dataclass).
What crosses modules goes through a public method or attribute (``Cluster.client_exited``,
``DecodeNode.advance_retention``), so a class can change its insides without breaking a caller it never
heard of.

The exceptions are a library's insides that the simulator drives for speed, where the module says why:
simpy's state (``env._now``, ``event._ok`` ...) in sim/engine/instant.py and the jump it describes in
sim/engine/prefill.py; ``random.Random._randbelow`` in sim/workload/distributions.py (what ``randint`` draws,
held to the same draws by tests/workload/test_distributions.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIMPY_STATE = {"_now", "_ok", "_value", "_queue"}
SIMPY_DRIVERS = {"sim/engine/instant.py", "sim/engine/prefill.py"}
LIBRARY_CALLS = {("sim/workload/distributions.py", "_randbelow")}


def _own_attributes(tree: ast.AST) -> set[str]:
    """Private names a class of this module defines: in its body, or on ``self`` in its methods."""
    own = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                own.add(node.target.id)
            elif isinstance(node, ast.Assign):
                own.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                own.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_"):
                own.add(node.value)  # __slots__ entries
    return own


def _foreign(attr: ast.Attribute, own: set[str]) -> bool:
    name = attr.attr
    if not name.startswith("_") or name.startswith("__") or name in own:
        return False
    return not (isinstance(attr.value, ast.Name) and attr.value.id in ("self", "cls"))


def foreign_private_calls(path: str, source: str) -> list[str]:
    tree = ast.parse(source)
    functions = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    own = _own_attributes(tree) | functions
    return [f"{path}:{node.lineno}: {ast.unparse(node.func)}" for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _foreign(node.func, own)
            and (path, node.func.attr) not in LIBRARY_CALLS]


def foreign_private_writes(path: str, source: str) -> list[str]:
    tree = ast.parse(source)
    own = _own_attributes(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for attr in (t for t in ast.walk(target) if isinstance(t, ast.Attribute)):
                if not _foreign(attr, own) or (attr.attr in SIMPY_STATE and path in SIMPY_DRIVERS):
                    continue
                found.append(f"{path}:{node.lineno}: {ast.unparse(target)}")
    return found


def test_the_check_finds_a_write_to_another_classes_private_attribute():
    source = ("class Client:\n"
              "    def __init__(self, cluster):\n"
              "        self._cluster = cluster\n"
              "    def exit(self):\n"
              "        self._cluster._live_clients -= 1\n"  # Cluster's, defined elsewhere
              "        self._cluster.heartbeats = 0\n")  # public: fine
    assert foreign_private_writes("sim/c.py", source) == ["sim/c.py:5: self._cluster._live_clients"]
    own = "class D:\n    __slots__ = ('_h',)\n    def copy(self):\n        other = D()\n        other._h = 1\n"
    assert foreign_private_writes("impl/d.py", own) == []
    assert foreign_private_writes("sim/other.py", "def f(env):\n    env._now = 3\n") == ["sim/other.py:2: env._now"]


def test_the_check_finds_a_call_of_another_classes_private_method():
    source = ("class Cluster:\n"
              "    def _sample(self, now):\n"
              "        self._tick(now)\n"  # its own
              "        for d in self.decode:\n"
              "            d._advance_retention(now)\n")  # DecodeNode's, defined elsewhere
    assert foreign_private_calls("sim/c.py", source) == ["sim/c.py:5: d._advance_retention"]


def test_no_module_writes_another_modules_private_state_or_calls_its_private_methods():
    found = []
    for package in ("impl", "sim", "calibration"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name, source = str(path.relative_to(ROOT)), path.read_text()
            found += foreign_private_writes(name, source) + foreign_private_calls(name, source)
    assert found == []
