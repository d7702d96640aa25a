"""Every subcommand is reachable through the ``bidikv`` entry point (impl/cli.py dispatches on ``run``)."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest

from impl.cli import COMMANDS, SUBCOMMAND_MODULES, build_parser


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
    # every module registers exactly the commands COMMANDS sends to it (what main() imports for one
    # command), and those are exactly what bidikv offers
    for module in SUBCOMMAND_MODULES:
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module).register(sub)
        assert set(sub.choices) == {c for c, m in COMMANDS.items() if m == module}, module
    assert {path[1] for path, _ in leaves} == set(COMMANDS)
    # one command's parser is that command's, as the full parser has it
    for command in COMMANDS:
        alone = next(a for a in build_parser(command)._actions if isinstance(a, argparse._SubParsersAction))
        assert command in alone.choices and set(alone.choices) <= set(COMMANDS)


@pytest.mark.parametrize("argv, says", [
    (["router", "--prefill", "not a url", "--decode", "http://127.0.0.1:1"], "prefill URL must start with http"),
])
def test_bad_flags_are_named_errors_not_tracebacks(argv, says):
    run = subprocess.run([sys.executable, "-m", "impl.cli", *argv], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    assert says in run.stderr and "Traceback" not in run.stderr, run.stderr


def _subcommand_parsers():
    return [(path, sub) for path, sub in _leaves(build_parser(), ["bidikv"])]


def test_every_flag_has_help_and_a_metavar_a_person_can_read():
    for path, sub in _subcommand_parsers():
        for action in sub._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            name = f"{' '.join(path)} {action.option_strings[-1]}"
            assert action.help and action.help.strip(), f"{name} has no help"
            metavar = action.metavar or ""
            shown = metavar if isinstance(metavar, str) else " ".join(metavar)
            assert "__" not in shown and "__" not in (action.dest.upper() if action.metavar is None and action.nargs != 0
                                                      and not action.choices else ""), f"{name}: metavar {shown or action.dest}"


def test_metavars_say_the_unit():
    parser = build_parser()
    sim = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["simulate"]
    metavars = {a.option_strings[0]: a.metavar for a in sim._actions if a.option_strings}
    assert metavars["--nic-line-rate-bytes-per-s"] == "BYTES_PER_S"
    assert metavars["--decoder-kv-blocks-ttl"] == metavars["--lease-s"] == "SECONDS"
    assert metavars["--kv-recompute-threshold"] == "TOKENS" and metavars["--num-prefill"] == "N"


@pytest.mark.parametrize("argv", [
    ["router", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9", "--port", "0"],
    ["bench", "--url", "http://127.0.0.1:9", "--mode", "on", "--conversations", "1"],
])
def test_a_missing_extra_names_the_install_command(argv):
    # the light install (tools/demo.sh) has no aiohttp; blocking its import is that install, as far as
    # the command can tell
    code = ("import sys; sys.modules['aiohttp'] = None\n"
            "from impl.cli import main\n"
            f"sys.exit(main({argv!r}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == f"bidikv {argv[0]}: error: this needs aiohttp, which is not installed: " \
                                 "pip install 'bidikv[impl]'"


def test_version_and_one_line_usage_errors():
    version = subprocess.run([sys.executable, "-m", "impl.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("bidikv ")
    bad = subprocess.run([sys.executable, "-m", "impl.cli", "tune", "--workers", "many"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == \
        "bidikv tune: error: argument --workers: invalid integer value: 'many' (see bidikv tune --help)"
