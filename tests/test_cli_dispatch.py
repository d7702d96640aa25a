"""Every subcommand is reachable through the ``bidikv`` entry point (impl/cli.py dispatches on ``run``)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from impl.cli import SUBCOMMAND_MODULES, build_parser


def _leaves(parser, path):
    """(command path, parser) of every runnable (sub)command; argparse keeps no public list."""
    nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not nested:
        yield path, parser
    for action in nested:
        for name, sub in action.choices.items():
            yield from _leaves(sub, path + [name])


def test_every_subcommand_sets_run():
    leaves = list(_leaves(build_parser(), ["bidikv"]))
    for path, sub in leaves:
        assert callable(sub.get_default("run")), f"{' '.join(path)} does not set run"
    assert len({path[1] for path, _ in leaves}) == len(SUBCOMMAND_MODULES) + 1  # calibrate registers profile too


@pytest.mark.parametrize("argv, says", [
    (["router", "--prefill", "not a url", "--decode", "http://127.0.0.1:1"], "prefill URL must start with http"),
])
def test_bad_flags_are_named_errors_not_tracebacks(argv, says):
    run = subprocess.run([sys.executable, "-m", "impl.cli", *argv], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    assert says in run.stderr and "Traceback" not in run.stderr, run.stderr
