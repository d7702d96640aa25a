"""Fuzz the command line: whatever a user types, `bidikv simulate` and `bidikv tune` either run or
refuse in one line with exit status 2, never a traceback.

Flags come from the parsers themselves (so a new flag is fuzzed the day it is added); values from a
pool of what people mistype: negative, zero, NaN, infinities, huge, non-numbers, empty. Runs stay
small: a cheap base (2 conversations, a one-point tune grid, serial) comes first and the fuzzed
flags after it, so they may override it, but every value in the pool keeps a run short.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import pathlib
import signal
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from impl.cli import build_parser, main

VALUES = ["-1", "0", "1", "2", "3", "0.5", "-2.5", "1e308", "-1e308", "nan", "inf", "-inf", "NaN", "abc", "",
          "1e400", "0x10", "1e-300", "0.001", "64", "break_even", "lease", "ttl", "oracle", "60,120", ",", "-", "--", "120,inf", " "]
# flags whose large legal values would make a run long, not wrong: kept to the small end of the pool
SMALL_ONLY = {"--conversations", "--num-prefill", "--num-decode", "--num-clients", "--max-num-seqs",
              "--workers", "--max-num-batched-tokens"}
SKIP = {"--help", "--version", "--config", "--trace", "--out", "--plots", "--parquet", "--executor", "--profile",
        "--progress", "--no-progress"}


def _flags(command: str) -> list[tuple[str, bool]]:
    """(flag, takes a value) of a subcommand, from its parser."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    out = []
    for action in sub._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag not in SKIP:
                out.append((flag, action.nargs != 0))
    return out


def _argv(command: str) -> st.SearchStrategy[list[str]]:
    flags = _flags(command)

    @st.composite
    def build(draw):
        argv = []
        for flag, takes_value in draw(st.lists(st.sampled_from(flags), max_size=4)):
            argv.append(flag)
            if takes_value:
                pool = [v for v in VALUES if v in ("-1", "0", "1", "2", "3", "nan", "abc", "")] if flag in SMALL_ONLY \
                    else VALUES
                argv.append(draw(st.sampled_from(pool)))
        return argv

    return build()


class Hung(Exception):
    pass


def _hung(signum, frame):
    raise Hung("one command line ran for over a minute: a hang, or a value that should have been refused")


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(60)
    try:
        return _run_main(argv, out, err)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _run_main(argv: list[str], out: io.StringIO, err: io.StringIO) -> tuple[int, str, str]:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own exits (usage errors) come this way
            code = exc.code if isinstance(exc.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def _check(command: str, argv: list[str]) -> None:
    # relative paths from the pool (--out abc, --output ttl) land in a scratch directory
    with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):
        code, out, err = _run(argv)  # an exception escaping main() fails the test with its traceback
    assert "Traceback" not in err
    if code == 0:
        assert out.strip() or "--output" in argv, argv  # profile --output writes a file instead
    else:
        assert code == 2, (argv, code, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"bidikv {command}: error: "), (argv, err)


SIMULATE_BASE = ["simulate", "--conversations", "2", "--no-progress"]
TUNE_BASE = ["tune", "--conversations", "2", "--ttls", "60", "--thresholds", "64", "--leases", "",
             "--gap-quantiles", "", "--executor", "serial", "--no-progress"]


@settings(max_examples=60)
@given(args=_argv("simulate"))
def test_simulate_never_shows_a_traceback(args):
    _check("simulate", SIMULATE_BASE + args)


@settings(max_examples=30)
@given(args=_argv("tune"))
def test_tune_never_shows_a_traceback(args):
    _check("tune", TUNE_BASE + args)


ROOT = pathlib.Path(__file__).resolve().parents[2]
OTHER_BASES = {
    "calibrate": ["calibrate", "--source", "closed-form"],
    "profile": ["profile", "--model-config", str(ROOT / "calibration/data/config_qwen3-32b.json"), "--tp", "8"],
    "bench": ["bench", "--url", "http://127.0.0.1:9", "--mode", "on", "--conversations", "1"],  # nothing listens
}


@pytest.mark.parametrize("command", sorted(OTHER_BASES))
def test_other_subcommands_never_show_a_traceback(command):
    @settings(max_examples=25)
    @given(args=_argv(command))
    def fuzz(args):
        _check(command, OTHER_BASES[command] + args)

    fuzz()


def test_the_fuzzer_reaches_both_outcomes():
    # not vacuous: a known-good and a known-bad argument list through the same checks
    assert _run(SIMULATE_BASE)[0] == 0
    code, _, err = _run(SIMULATE_BASE + ["--nic-efficiency", "2"])
    assert code == 2 and "nic_efficiency" in err
    assert {f for f, _ in _flags("simulate")} >= {"--lease-s", "--decoder-kv-blocks-ttl", "--num-prefill", "--seed"}
    assert {f for f, _ in _flags("tune")} >= {"--workers", "--max-retained-hbm-pct", "--ttls", "--tolerance-pct"}
