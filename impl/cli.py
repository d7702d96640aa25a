"""``bidikv``: one console script, one subcommand per job. Each subcommand lives with its concern and
registers itself here; a subcommand's module is imported only when that subcommand is asked for (or
for ``bidikv --help``, which lists them all).

Layering: this dispatcher is the one module of impl that names the simulator's modules, and only as
strings in :data:`COMMANDS`; ``bidikv router`` and ``bidikv deploy`` load nothing of sim/
(tests/test_run_time_layers.py checks ``sys.modules``; tools/import_graph.py reads the strings as
by-name arrows, exempt from the layer rules here only).

Whatever a subcommand raises for bad input or a broken environment (a ValueError naming the field, a
missing file, an unwritable directory, an unreachable URL, an extra that is not installed) ends here
as one line on stderr and exit status 2: a traceback is for bugs, not for a user's typo.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

# command -> the module that registers it (``register(subparsers)``), in the order ``--help`` lists them
COMMANDS = {
    "simulate": "sim.commands.simulate",
    "tune": "sim.tune.cli",
    "trace": "sim.commands.trace",  # router trace <-> Mooncake
    "calibrate": "sim.commands.calibrate",  # calibration.cli's, with the simulator passed in
    "profile": "sim.commands.calibrate",
    "validate": "sim.commands.validate",  # replays bench runs through the simulator
    "router": "impl.router.cli",
    "bench": "sim.bench.cli",
    "deploy": "impl.deploy.cli",
}
SUBCOMMAND_MODULES = list(dict.fromkeys(COMMANDS.values()))

# Top-level packages of the optional extras (pyproject.toml): importing one of them on the light
# install (tools/demo.sh) is a missing extra, not a bug.
EXTRA_PACKAGES = {"aiohttp": "impl", "vllm": "impl", "nixl": "impl", "torch": "impl", "ray": "ray",
                  "pyarrow": "pyarrow", "uvloop": "impl"}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("bidikv")
    except PackageNotFoundError:  # run from a checkout without `pip install -e .`
        return "unknown (not installed)"


class OneLineErrors(argparse.ArgumentParser):
    """argparse, but a rejected flag is one line: the usage of `tune` alone is 30 lines of noise
    around the one that says what was wrong. Subcommand parsers inherit the class."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand, or only the module of ``command`` (one of :data:`COMMANDS`)."""
    parser = OneLineErrors(prog="bidikv", description="Bidirectional KV-cache transfer: simulate, calibrate, tune, serve.")
    parser.add_argument("--version", action="version", version=f"bidikv {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in ([COMMANDS[command]] if command is not None else SUBCOMMAND_MODULES):
        importlib.import_module(module).register(sub)
    return parser


def _os_error(exc: OSError) -> str:
    # str(OSError) repeats errno; "No such file or directory: 'x.jsonl'" is what a user can act on
    what = exc.strerror or str(exc) or type(exc).__name__
    name = exc.filename if exc.filename is not None else None
    return f"{what}: {name!r}" if name else what


def _missing_extra(exc: ModuleNotFoundError) -> str | None:
    top = (exc.name or "").split(".")[0]
    if top not in EXTRA_PACKAGES:
        return None
    extra = EXTRA_PACKAGES[top]
    how = f"pip install {top}" if extra == top else f"pip install 'bidikv[{extra}]'"
    return f"this needs {top}, which is not installed: {how}"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # the command is the first argument (the top level has no option that takes a value); anything
    # else (--help, --version, a typo) gets the full parser
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    where = f"bidikv {args.command}: error:"
    try:
        return int(args.run(args) or 0)
    except ValueError as exc:  # bad input: name it, no traceback
        print(f"{where} {exc}", file=sys.stderr)
    except ModuleNotFoundError as exc:
        message = _missing_extra(exc)
        if message is None:
            raise  # our own module missing is a bug: keep the traceback
        print(f"{where} {message}", file=sys.stderr)
    except BrokenPipeError:  # `bidikv ... | head`: the reader left, nothing to say
        sys.stdout = None  # type: ignore[assignment]  # no flush (and no second EPIPE) at exit
        return 1
    except OSError as exc:  # files, directories, sockets, unreachable URLs (aiohttp's are OSErrors too)
        print(f"{where} {_os_error(exc)}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"bidikv {args.command}: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
