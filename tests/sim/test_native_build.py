"""The compiled build (tools/build_native.py, sim/native.py) as a user gets it: built with the real mypyc
and C compiler into a copy of this checkout, it computes what the sources compute (every line of
benchmarks/sim_fingerprint.py, which reaches every path of the cluster), and it never runs once a source
changed. The rest of the suite runs the sources (tests/conftest.py sets BIDIKV_PURE_SIM)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.extra("native")  # mypyc comes with mypy
ROOT = Path(__file__).resolve().parents[2]
COPIED = ("sim", "impl", "calibration", "tools/build_native.py", "benchmarks/sim_fingerprint.py")
WHICH = "import sim.native; print(sim.native.build_name())"


def _env(root: Path, pure: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "BIDIKV_PURE_SIM"}
    env["PYTHONPATH"] = str(root)  # the copy's sim, ahead of the checkout the venv has installed
    if pure:
        env["BIDIKV_PURE_SIM"] = "1"
    return env


def _run(root: Path, *args: str, pure: bool = False, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, *args], cwd=root, env=_env(root, pure), capture_output=True, text=True,
                         timeout=900)
    if check and out.returncode != 0:
        raise AssertionError(f"{args} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out


def _copy_tree(src: Path, dst: Path, *ignored: str) -> Path:
    for rel in COPIED:
        if (src / rel).is_dir():
            shutil.copytree(src / rel, dst / rel, ignore=shutil.ignore_patterns("__pycache__", *ignored))
        else:
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / rel, dst / rel)
    return dst


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A copy of the checkout's simulator with the compiled build in it (one build for the module)."""
    # without a compiled build the checkout may hold (a developer's)
    root = _copy_tree(ROOT, tmp_path_factory.mktemp("native"), "*.so", "_native.json")
    assert _run(root, "-c", WHICH).stdout.strip() == "pure Python"
    _run(root, "tools/build_native.py")
    return root


def test_the_compiled_build_runs_and_computes_what_the_sources_compute(built):
    assert _run(built, "-c", WHICH).stdout.strip() == "native (mypyc)"
    assert "native (mypyc)" in _run(built, "tools/build_native.py", "--status").stdout
    native = _run(built, "benchmarks/sim_fingerprint.py").stdout
    pure = _run(built, "benchmarks/sim_fingerprint.py", pure=True).stdout
    assert len(native.splitlines()) >= 15  # one line per configuration
    assert native == pure


def test_an_edited_source_runs_instead_of_the_stale_build_with_a_warning(built, tmp_path):
    root = _copy_tree(built, tmp_path)
    router = root / "sim" / "engine" / "router.py"
    original = router.read_bytes()
    router.write_bytes(original + b"\nEDITED_AFTER_THE_BUILD = True\n")
    out = _run(root, "-c", "import sim.engine.router, sim.engine.decode; print(sim.engine.router.EDITED_AFTER_THE_BUILD, "
                           "sim.engine.decode.__file__.endswith('.py'))")
    assert out.stdout.split() == ["True", "True"]  # the edit runs, and every compiled module is the source's
    assert "stale" in out.stderr and "sim/engine/router.py" in out.stderr and "tools/build_native.py" in out.stderr
    assert "stale" in _run(root, "tools/build_native.py", "--status").stdout
    # the stamp is of the sources' bytes, not their times: the same bytes again, the build runs again
    router.write_bytes(original)
    out = _run(root, "-c", WHICH)
    assert out.stdout.strip() == "native (mypyc)" and "stale" not in out.stderr


def test_a_build_with_a_compiled_file_missing_or_without_its_stamp_is_not_run(built, tmp_path):
    root = _copy_tree(built, tmp_path)
    (root / "sim" / "_native.json").unlink()
    out = _run(root, "-c", WHICH)
    assert out.stdout.strip() == "pure Python" and "stamp" in out.stderr
    _run(root, "tools/build_native.py")
    assert _run(root, "-c", WHICH).stdout.strip() == "native (mypyc)"
    next((root / "sim" / "engine").glob("decode.*.so")).unlink()
    out = _run(root, "-c", WHICH)
    assert out.stdout.strip() == "pure Python" and "stale" in out.stderr


def test_clean_removes_the_build_and_the_sources_run_without_a_warning(built, tmp_path):
    root = _copy_tree(built, tmp_path)
    out = _run(root, "tools/build_native.py", "--clean")
    assert "removed 7 compiled files" in out.stdout
    assert not list((root / "sim").rglob("*.so")) and not (root / "sim" / "_native.json").exists()
    out = _run(root, "-c", WHICH)
    assert out.stdout.strip() == "pure Python" and out.stderr == ""
    assert "no compiled build" in _run(root, "tools/build_native.py", "--status").stdout


def test_status_says_the_sources_run_when_the_suite_asks_for_them(built):
    assert "BIDIKV_PURE_SIM=1" in _run(built, "tools/build_native.py", "--status", pure=True).stdout
    assert _run(built, "-c", WHICH, pure=True).stdout.strip() == "pure Python"


def test_a_source_mypyc_rejects_fails_the_build_naming_it_and_leaves_the_sources_in_charge(built, tmp_path):
    root = _copy_tree(built, tmp_path)
    router = root / "sim" / "engine" / "router.py"
    router.write_text(router.read_text() + "\nNOT_AN_INT: int = 'a string'\n")
    out = _run(root, "tools/build_native.py", check=False)
    assert out.returncode != 0
    assert "the build failed" in out.stderr and "sim/engine/router.py" in out.stderr and "NOT_AN_INT" not in out.stdout
    assert not list((root / "sim").rglob("*.so")) and not (root / "sim" / "_native.json").exists()
    out = _run(root, "-c", WHICH)
    assert out.stdout.strip() == "pure Python" and out.stderr == ""
