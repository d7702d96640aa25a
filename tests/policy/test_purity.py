"""impl.policy must import in an interpreter that has none of the heavy parts, and import only stdlib."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

POLICY = pathlib.Path(__file__).resolve().parents[2] / "impl" / "policy"


def test_policy_imports_only_stdlib():
    std = set(sys.stdlib_module_names) | {"__future__", "impl"}
    offenders = []
    for path in POLICY.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] not in std]
    assert offenders == []


def test_policy_imports_with_heavy_packages_blocked():
    # Block every non-stdlib top-level import, then import the package: proves no hidden dependency.
    code = (
        "import sys, importlib.abc\n"
        "std = set(sys.stdlib_module_names) | {'impl'}\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] not in std: raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import impl.policy\n"
        "assert not any(m.split('.')[0] in {'vllm','simpy','numpy','aiohttp','torch'} for m in sys.modules)\n"
    )
    root = POLICY.parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
