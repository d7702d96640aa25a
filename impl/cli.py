"""``bidikv``: one console script, one subcommand per job. Each subcommand lives with its concern and
registers itself here; heavy imports happen only when that subcommand runs."""

from __future__ import annotations

import argparse
import importlib
import sys

# (module, what it adds); each module exposes register(subparsers)
SUBCOMMAND_MODULES = [
    "sim.cli",  # simulate
    "sim.tune.cli",  # tune
    "calibration.cli",  # calibrate, profile
    "impl.router.cli",  # router
    "impl.bench.cli",  # bench
    "impl.deploy.cli",  # deploy
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bidikv", description="Bidirectional KV-cache transfer: simulate, calibrate, tune, serve.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMAND_MODULES:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except ValueError as exc:  # bad input: name it, no traceback
        print(f"bidikv {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
