"""A sample two-host deployment written by the tests themselves, and a way to run the launch scripts.

Nothing here starts vLLM: "python" in the written configs is either a path that does not exist (for
--dry-run, which only prints) or a fake interpreter that records what it was exec'd with.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_DIR = ROOT / "impl" / "deploy"

P_HOST, D_HOST, ROUTER_HOST = "10.0.1.11", "10.0.1.12", "10.0.1.11"
P_HTTP, D_HTTP, P_SIDE, D_SIDE, ROUTER_PORT = 8100, 8200, 5600, 5601, 9000
THRESHOLD, TTL_S = 128, 300
WORKDIR = "/opt/bidikv"

SAMPLE: dict[str, Any] = {
    "deploy": {"workdir": WORKDIR, "python": "/opt/bidikv/.venv/bin/python"},
    "model": {"name": "Qwen/Qwen3-32B", "served_name": "qwen3-32b", "tensor_parallel_size": 8,
              "max_model_len": 32768, "prefix_caching_on_prefill": False},
    "prefill": {"host": P_HOST, "http_port": P_HTTP, "side_channel_port": P_SIDE},
    "decode": {"host": D_HOST, "http_port": D_HTTP, "side_channel_port": D_SIDE},
    "transfer": {"backends": ["LIBFABRIC"], "kv_buffer_device": "cuda",
                 "env": {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}},
    "connector": {"kv_recompute_threshold": THRESHOLD, "decoder_kv_blocks_ttl": TTL_S},
    "router": {"host": ROUTER_HOST, "port": ROUTER_PORT},
    "bench": {"conversations": 24, "concurrency": 2, "seed": 7, "results_dir": "results"},
    "calibrate": {"base_profile": "qwen3-32b@p5en-tp8"},
}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string for these values
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(value)


def to_toml(config: dict[str, Any]) -> str:
    """Tables of scalars and lists, one level of sub-tables (enough for the deploy config)."""
    lines = []
    for section, table in config.items():
        lines.append(f"[{section}]")
        subtables = {k: v for k, v in table.items() if isinstance(v, dict)}
        for key, value in table.items():
            if not isinstance(value, dict):
                lines.append(f"{key} = {_toml_value(value)}")
        for name, sub in subtables.items():
            lines.append(f"[{section}.{name}]")
            lines += [f"{key} = {_toml_value(value)}" for key, value in sub.items()]
    return "\n".join(lines) + "\n"


def sample() -> dict[str, Any]:
    return copy.deepcopy(SAMPLE)


@pytest.fixture
def write_config(tmp_path):
    def write(config: dict[str, Any], name: str = "deploy.toml") -> Path:
        path = tmp_path / name
        path.write_text(to_toml(config))
        return path

    return write


def run_script(script: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, BIDIKV_PYTHON=sys.executable)
    return subprocess.run(["bash", str(DEPLOY_DIR / script), *args], capture_output=True, text=True, env=env,
                          cwd=str(cwd or ROOT), timeout=120)


FAKE_PYTHON = """#!{python}
# Stands in for the hosts' interpreter: records how it was exec'd, starts nothing.
import json, os, sys
with open({record!r}, "a") as fh:
    fh.write(json.dumps({{"argv": sys.argv[1:], "env": dict(os.environ)}}) + "\\n")
"""


@pytest.fixture
def fake_python(tmp_path):
    """(path of a fake interpreter, path of the JSON lines it appends one record per exec to)."""
    record = tmp_path / "exec_record.jsonl"
    path = tmp_path / "fake-python"
    path.write_text(FAKE_PYTHON.format(python=sys.executable, record=str(record)))
    path.chmod(0o755)
    return path, record
