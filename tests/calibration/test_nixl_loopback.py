"""``benchmarks/nixl_loopback.py --quick`` for real: real nixl (UCX over TCP/cma on this machine), real bytes.

Loopback (UCX over TCP/cma, DRAM), not EFA: these tests check that the benchmark runs, moves the right
bytes and recovers the transfer model's shape (a positive per-descriptor term, a finite bandwidth),
never EFA's constants. nixl is part of the test setup (the ``impl`` extra): no skip.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "nixl_loopback.py"
LABEL = "loopback (UCX over TCP/cma, DRAM), not EFA"


def _run(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run the script in its own process group; on a hang, kill that group (the script and its two sides)."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=SCRIPT.parents[1], start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"no result within {timeout} s\nstdout tail:\n{out[-2000:]}\nstderr tail:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_quick_moves_the_bytes_and_fits_a_positive_per_descriptor_term():
    proc = _run("--quick", "--json")
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout tail:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-3000:]}"
    result = json.loads(proc.stdout)
    assert result["ok"] is True and result["label"] == LABEL and "SHAPE" in result["note"]
    assert [r["config"] for r in result["runs"]] == ["prog_off", "prog_on"]
    modes = list(result["modes"])
    assert modes == ["read", "read_notif", "initialize"]
    n_points = sum(1 for bs in result["grid"]["block_sizes"] for n in result["grid"]["counts"]
                   if bs * n <= result["grid"]["max_transfer_bytes"])

    for run in result["runs"]:
        assert run["ok"], run
        ini, tgt = run["initiator"], run["target"]
        # every mode and point was READ into a sentinel-filled buffer and its CRC32 checked inside the script
        assert ini["verified_transfers"] == len(modes) * n_points
        # every notification-carrying READ reached the target
        assert ini["notifs_sent"] > 0 and ini["notifs_at_target"] == ini["notifs_sent"] == tgt["notifs"]
        for mode in modes:
            rows = ini["modes"][mode]
            assert len(rows) == n_points
            assert all(r["reps"] == result["grid"]["reps"] and r["median_total_s"] > 0 for r in rows)
        setup = ini["setup"]
        for key in ("agent_create_s", "register_s", "metadata_exchange_s", "add_remote_agent_s", "make_connection_s"):
            assert setup[key] > 0, key
        assert setup["first_transfer"]["total_s"] > 0 and setup["dlist_prep"]
        for fit in run["fits"].values():
            assert fit["fixed_per_transfer_s"] >= 0 and fit["per_descriptor_s"] >= 0 and fit["bandwidth_bytes_per_s"] > 0

    # the verdict: the prog_off READ fit has a positive per-descriptor term and a finite, positive bandwidth
    primary = next(r for r in result["runs"] if r["config"] == "prog_off")
    fit = primary["fits"]["read"]
    assert fit["per_descriptor_s"] > 0
    assert 0 < fit["bandwidth_bytes_per_s"] < math.inf
    assert fit["model"] == "t = fixed + per_descriptor x descriptors + bytes / bandwidth"
    # with the progress thread off, neither side burns CPU while idle (the reason for that config)
    cpu = primary["initiator"]["cpu"]
    assert cpu["idle_cpu_frac"] < 0.1 and cpu["target_idle_cpu_frac"] < 0.1


def test_exits_2_with_a_clear_message_when_ucx_cannot_start():
    # UCX_TLS without tcp leaves the UCX backend without an active-message transport: it cannot start
    env = {**os.environ, "UCX_TLS": "cma"}
    proc = _run("--quick", "--configs", "prog_off", env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "NIXL/UCX cannot start" in proc.stderr and "UCX_TLS" in proc.stderr
    assert LABEL in proc.stdout
