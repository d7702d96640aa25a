"""The README's commands and every ``bidikv`` subcommand, run in a terminal as a person runs them.

Each test attaches a pseudo-terminal (so progress bars and other TTY-only paths are on) and has a
deadline: a command that hangs fails here instead of in front of a user.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import sys
import urllib.error
import urllib.request

import pytest

from impl.cli import build_parser
from tests.cli.terminal import run_in_terminal

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIDIKV = [sys.executable, "-m", "impl.cli"]


def _env() -> dict:
    env = dict(os.environ)
    env.pop("NO_COLOR", None)
    env["PYTHONPATH"] = str(ROOT)
    return env


def bidikv(*args: str, timeout: float = 60, **kw):
    return run_in_terminal([*BIDIKV, *args], timeout, cwd=str(ROOT), env=_env(), **kw)


def _ok(run, *expected: str) -> str:
    assert not run.timed_out, f"still running after {run.seconds:.0f} s; output so far:\n{run.output[-2000:]}"
    assert run.returncode == 0, run.output[-3000:]
    assert "Traceback" not in run.output, run.output[-3000:]
    for text in expected:
        assert text in run.output, f"{text!r} not in:\n{run.output[-3000:]}"
    return run.output


# --- the README's quick start ---------------------------------------------------------------------

def test_readme_demo_command_finishes_in_a_terminal():
    # tools/demo.sh passes its arguments to `bidikv simulate --compare`; fewer conversations keep it cheap
    run = run_in_terminal(["bash", "tools/demo.sh", "--conversations", "10"], 240, cwd=str(ROOT), env=_env())
    out = _ok(run, "workload: synthetic", "later p50 on", "later p50 off", "[on] turns", "[off] turns")
    assert re.search(r"\[on\] turns (\d+)/\1 ", out)  # every turn completed


def test_readme_test_command_runs_pytest_in_a_terminal():
    # the same script CI runs (setup is idempotent), on one cheap test file
    run = run_in_terminal(["bash", "tools/test.sh", "tests/policy/test_purity.py", "-q", "-p", "no:cacheprovider"],
                          420, cwd=str(ROOT), env=_env())
    _ok(run, "2 passed")


# --- simulate: the progress bar is on in a terminal -----------------------------------------------

def test_simulate_default_run_ends_in_a_terminal_with_the_bar_on():
    out = _ok(bidikv("simulate", "--compare"), "200 conversations", "[on] turns 1,556/1,556")
    assert "simulate: 100%" in out and "turn/s" in out  # the bar was drawn, and reached the end


def test_simulate_progress_does_not_change_the_numbers(tmp_path):
    for name, flag in (("bar", "--progress"), ("plain", "--no-progress")):
        _ok(bidikv("simulate", "--conversations", "15", "--seed", "4", flag, "--out", str(tmp_path / name)))
    for f in ("records.csv", "series.csv", "summary.json"):
        assert (tmp_path / "bar" / f).read_bytes() == (tmp_path / "plain" / f).read_bytes(), f


# --- every subcommand: --help, then a small real run -----------------------------------------------

def _commands() -> list[list[str]]:
    """Every runnable command path under bidikv (argparse keeps no public list of subparsers)."""
    import argparse

    out = []

    def walk(parser, path):
        nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not nested:
            out.append(path)
        for action in nested:
            for name, sub in action.choices.items():
                walk(sub, path + [name])

    walk(build_parser(), [])
    return out


COMMANDS = _commands()


def test_the_command_list_covers_the_readme():
    top = {c[0] for c in COMMANDS}
    assert {"simulate", "tune", "calibrate", "profile", "router", "bench", "deploy"} <= top


@pytest.mark.parametrize("path", [[]] + COMMANDS, ids=lambda p: " ".join(p) or "bidikv")
def test_help_in_a_terminal(path):
    out = _ok(bidikv(*path, "--help", timeout=30), "usage: bidikv")
    assert "CFG__" not in out and "cfg__" not in out  # metavars a user can read


def test_version_in_a_terminal():
    out = _ok(bidikv("--version", timeout=30))
    assert re.fullmatch(r"bidikv \d+\.\d+\.\d+\s*", out), out


def test_tune_small_grid_in_a_terminal(tmp_path):
    out = _ok(bidikv("tune", "--conversations", "8", "--ttls", "0,480", "--thresholds", "64", "--leases", "30",
                     "--gap-quantiles", "", "--workers", "1", "--plots", str(tmp_path), timeout=180),
              "recommended:", "prefill: vllm serve ... --kv-transfer-config", "router:  bidikv router --prefill")
    assert (tmp_path / "frontier.png").stat().st_size > 0 and "wrote" in out


def test_calibrate_in_a_terminal():
    _ok(bidikv("calibrate", timeout=120), "qwen3-32b")


def test_profile_in_a_terminal(tmp_path):
    out_file = tmp_path / "p.json"
    _ok(bidikv("profile", "--model-config", str(ROOT / "calibration/data/config_qwen3-32b.json"), "--tp", "8",
               "-o", str(out_file), timeout=60))
    assert json.loads(out_file.read_text())["block_size"] > 0


@pytest.mark.parametrize("action", ["check", "plan", "show", "argv"])
def test_deploy_in_a_terminal(action):
    extra = {"show": ["decode", "--mode", "on"], "argv": ["decode", "--mode", "on"]}.get(action, [])
    args = ["deploy", action, "--config", str(ROOT / "impl/deploy/deploy.toml"), *extra]
    _ok(bidikv(*args, timeout=60), "qwen3-32b" if action != "argv" else "--kv-transfer-config")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_router_starts_in_a_terminal_and_stops_on_ctrl_c():
    port = _free_port()

    def up(_output: str) -> bool:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
        except urllib.error.HTTPError:  # 503 while P and D are down still means it serves
            return True
        except OSError:
            return False
        return True

    run = bidikv("router", "--host", "127.0.0.1", "--port", str(port), "--prefill", "http://127.0.0.1:9",
                 "--decode", "http://127.0.0.1:9", timeout=60, until=up, then_send=b"\x03")
    assert not run.timed_out, run.output[-2000:]
    assert "Traceback" not in run.output and f":{port}" in run.output, run.output[-2000:]


def test_bench_against_nothing_is_one_line_in_a_terminal():
    port = _free_port()  # nothing listens there
    run = bidikv("bench", "--url", f"http://127.0.0.1:{port}", "--mode", "on", "--conversations", "1", timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.output
    assert len(run.output.strip().splitlines()) == 1 and run.output.startswith("bidikv bench: error:"), run.output
