"""What is deployed runs without the simulator, at run time: ``bidikv router`` serving, ``bidikv deploy``
and the vLLM connector as vLLM loads it leave no module of sim/ in ``sys.modules``.

tools/import_graph.py checks the written imports (tests/test_import_graph.py); this checks what a process
actually loads, which also covers imports by name (impl/cli.py's table of subcommand modules) and
whatever a library we call imports back. Each runs in a fresh interpreter, as a user's would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("sim", "impl", "calibration")
# printed last: the project's modules this process loaded
REPORT = ("import json, sys\n"
          f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {PROJECT!r})))\n")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _loaded(code: str, timeout: float = 300) -> set[str]:
    done = subprocess.run([sys.executable, "-c", code + REPORT], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def _simulator(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] == "sim")


def test_the_router_serving_has_loaded_nothing_of_the_simulator():
    # the console script's own entry point (pyproject: bidikv = impl.cli:main), serving until SIGTERM
    # the router installs its SIGTERM handler just after it logs that it listens; a SIGTERM before
    # that is a Ctrl-C (which it also takes as "stop")
    code = ("import signal\n"
            "def interrupt(*_):\n"
            "    raise KeyboardInterrupt\n"
            "signal.signal(signal.SIGTERM, interrupt)\n"
            "from impl.cli import main\n"
            "code = main(['router', '--prefill', 'http://127.0.0.1:9', '--decode', 'http://127.0.0.1:9',\n"
            "             '--host', '127.0.0.1', '--port', '0'])\n"
            "assert code == 0, code\n")
    proc = subprocess.Popen([sys.executable, "-c", code + REPORT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=_env())
    try:
        seen = []
        for line in proc.stderr:  # the router logs to stderr
            seen.append(line)
            if "router listening on" in line:
                break
        else:
            pytest.fail("the router exited before listening:\n" + "".join(seen[-40:]))
        proc.send_signal(signal.SIGTERM)  # it drains and returns from main
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    loaded = set(json.loads(out.strip().splitlines()[-1]))
    assert {"impl.router.app", "impl.router.proxy"} <= loaded  # it did serve
    assert _simulator(loaded) == []


def test_deploy_has_loaded_nothing_of_the_simulator():
    code = ("import contextlib, io\n"
            "from impl.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['deploy', 'plan', '--config', 'impl/deploy/deploy.toml']) == 0\n")
    loaded = _loaded(code)
    assert "impl.deploy.render" in loaded
    assert _simulator(loaded) == []


def test_deploy_manifests_has_loaded_nothing_of_the_simulator():
    code = ("import contextlib, io, os\n"
            "os.environ['BIDIKV_STORE_PASSWORD'] = 'x'\n"
            "from impl.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            "    assert main(['deploy', 'manifests', '--config', 'impl/deploy/deploy.toml']) == 0\n")
    loaded = _loaded(code)
    assert {"impl.deploy.k8s_render", "impl.deploy.k8s_check"} <= loaded
    assert _simulator(loaded) == []


def test_the_connector_as_vllm_loads_it_has_loaded_nothing_of_the_simulator():
    # vLLM imports kv_connector_module_path ("impl.connector") and takes NixlConnector from it; the
    # connector then reads its extra config, with the cost profile of the break-even threshold
    code = ("import impl.connector\n"
            "impl.connector.NixlConnector\n"
            "from impl.connector.config import ConnectorSettings\n"
            "ConnectorSettings.from_extra_config({'bidikv_recompute_policy': 'break_even',\n"
            "                                     'bidikv_cost_profile': 'qwen3-32b@p5en-tp8'})\n")
    loaded = _loaded(code)
    assert {"impl.connector.scheduler", "impl.connector.worker", "calibration.profile"} <= loaded
    assert _simulator(loaded) == []


def test_a_simulator_subcommand_loads_the_simulator_so_the_checks_above_can_fail():
    code = ("import contextlib, io\n"
            "from impl.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    main(['trace', 'to-mooncake', '--help'])\n")
    loaded = _loaded(code)
    assert "sim.commands.trace" in _simulator(loaded)
    assert "impl.router.cli" not in loaded  # and only the subcommand asked for
