"""tools/import_graph.py: on synthetic trees (so it can be seen to fail), then on this repository."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "import_graph.py"

_spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
import_graph = importlib.util.module_from_spec(_spec)
sys.modules["import_graph"] = import_graph  # dataclasses look their module up by name
_spec.loader.exec_module(import_graph)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _run(root: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root), *flags],
                          capture_output=True, text=True, timeout=120)


def test_a_cycle_through_a_submodule_and_a_relative_import_is_found(tmp_path):
    root = _tree(tmp_path, {
        "sim/__init__.py": "",
        "sim/a.py": "from sim import b\n",  # the submodule sim.b, not a name in sim
        "sim/b.py": "def f():\n    from . import c\n",  # lazy and relative: still an arrow
        "sim/c.py": "import sim.a\n",
        "sim/d.py": "from sim.a import thing\n",  # into the cycle, not part of it
    })
    graph = {name: set() for name in import_graph.modules(root)}
    for edge in import_graph.edges(root):
        graph[edge.source].add(edge.target)
    assert graph["sim.a"] == {"sim.b"} and graph["sim.b"] == {"sim.c"} and graph["sim.c"] == {"sim.a"}
    assert import_graph.cycles(graph) == [["sim.a", "sim.b", "sim.c"]]
    done = _run(root)
    assert done.returncode == 1 and "cycle of 3: sim.a sim.b sim.c" in done.stdout


def test_type_checking_imports_are_arrows_of_their_own_kind_and_make_cycles(tmp_path):
    # sim.b names sim.a's types only for a type checker: a reader of b must still read a, and a of b
    root = _tree(tmp_path, {
        "sim/__init__.py": "",
        "sim/a.py": "import sim.b\n",
        "sim/b.py": "import typing\nif typing.TYPE_CHECKING:\n    import sim.a\nelse:\n    import sim.c\n",
        "sim/c.py": "",
    })
    assert {(e.source, e.target, e.kind) for e in import_graph.edges(root)} == {
        ("sim.a", "sim.b", "import"), ("sim.b", "sim.a", "type"), ("sim.b", "sim.c", "import")}
    done = _run(root)
    assert done.returncode == 1 and "cycle of 2: sim.a sim.b" in done.stdout and "sim.b -> sim.a (type)" in done.stdout


def test_a_module_named_to_importlib_is_an_arrow_by_name(tmp_path):
    root = _tree(tmp_path, {
        "sim/__init__.py": "", "sim/s.py": "",
        "impl/__init__.py": "", "impl/router/__init__.py": "", "impl/router/cli.py": "",
        # a table of names, as impl/cli.py keeps; a docstring naming a module, or a bare package name, is none
        "impl/cli.py": '"""Loads sim.s when asked."""\nimport importlib\nTABLE = {"a": "sim.s", "b": "impl.router.cli"}\n'
                       'EXTRA = "impl"\n',
        "impl/x.py": '"""No importlib here."""\nNAME = "sim.s"\n',
    })
    arrows = {(e.source, e.target, e.kind) for e in import_graph.edges(root)}
    assert arrows == {("impl.cli", "sim.s", "by_name"), ("impl.cli", "impl.router.cli", "by_name")}
    # the dispatcher may name the simulator's modules; another impl module naming one by name may not
    assert _run(root, "--layers").returncode == 0
    (root / "impl/router/cli.py").write_text('import importlib\nimportlib.import_module("sim.s")\n')
    done = _run(root, "--layers")
    assert done.returncode == 1 and "impl.router.cli:2 -> sim.s (by_name)" in done.stdout


@pytest.mark.parametrize("source,text", [
    ("impl/policy/p.py", "from impl.router import r\n"),  # policy imports only policy
    ("calibration/c.py", "def f():\n    from sim.s import x\n"),
    ("calibration/c.py", "from impl.router import r\n"),  # impl stands on calibration, not the other way
    ("impl/router/r.py", "import sim.s\n"),
    ("impl/cli.py", "import sim.s\n"),  # the dispatcher's own imports follow impl's rule
])
def test_an_upward_arrow_is_a_layer_violation(tmp_path, source, text):
    files = {name: "" for name in ("impl/__init__.py", "impl/policy/__init__.py", "impl/router/__init__.py",
                                   "impl/router/r.py", "calibration/__init__.py", "calibration/c.py",
                                   "sim/__init__.py", "sim/s.py")}
    files[source] = text
    root = _tree(tmp_path, files)
    assert _run(root).returncode == 0  # no cycle
    done = _run(root, "--layers")
    assert done.returncode == 1 and "1 layer violations" in done.stdout


def test_the_simulator_and_impl_may_import_the_layers_below_them(tmp_path):
    root = _tree(tmp_path, {
        "impl/__init__.py": "", "impl/policy/__init__.py": "", "calibration/__init__.py": "",
        "calibration/c.py": "import impl.policy\n",
        "impl/router/__init__.py": "", "impl/router/r.py": "from calibration import c\n",
        "sim/__init__.py": "", "sim/s.py": "import impl.policy\nfrom calibration import c\n",
    })
    assert _run(root, "--layers").returncode == 0


def test_this_repository_has_no_import_cycle():
    done = _run(ROOT)
    assert done.returncode == 0, done.stdout
    assert " 0 cycles" in done.stdout.splitlines()[0]


# Not even a deferred one: calibration takes the simulator as a parameter (calibration.cli.Simulator)
# and sim.commands.calibrate, above both, passes it in; the bench's record format is calibration's
# (calibration.bench_records), so calibration imports nothing of impl but the policies; impl.cli, the
# dispatcher, names its subcommands' modules by name (tests/test_run_time_layers.py: what that loads).
def test_this_repository_has_no_upward_arrow():
    found = sorted((e.source, e.line, e.target) for e in import_graph.violations(import_graph.edges(ROOT)))
    assert found == []
