"""``bidikv deploy``: check a deployment config, print or hand over the exact commands, compare runs.

    bidikv deploy check   --config deploy.toml                 what the config resolves to
    bidikv deploy plan    --config deploy.toml                 every step's commands, ON then OFF, then the report
    bidikv deploy show    --config deploy.toml STEP [--mode M] one step's commands (the scripts' --dry-run)
    bidikv deploy argv    --config deploy.toml STEP [--mode M] the same, NUL-separated, for the scripts to exec
    bidikv deploy compare ON.jsonl OFF.jsonl [--merged FILE]   the ON/OFF table

``register(subparsers)`` plugs it into impl/cli.py; ``python -m impl.deploy`` runs it alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

STEP_HELP = "decode | prefill | router | bench | report"


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, metavar="TOML", help="deployment config (see impl/deploy/deploy.toml)")


def _add_step(p: argparse.ArgumentParser) -> None:
    _add_config(p)
    p.add_argument("step", metavar="STEP", help=STEP_HELP)
    p.add_argument("--mode", choices=("on", "off"), help="bidirectional KV transfer ON or OFF (all steps but report)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="deploy_action", required=True, metavar="ACTION")
    for name, help_text, add, run in (
            ("check", "validate the config and print what it resolves to", _add_config, _check),
            ("plan", "print every step's exact commands in order (ON, OFF, report)", _add_config, _plan),
            ("show", "print one step's exact commands (what --dry-run prints)", _add_step, _show),
            ("argv", "one step's commands as NUL-separated arguments (for the scripts)", _add_step, _argv)):
        action = actions.add_parser(name, help=help_text)
        add(action)
        action.set_defaults(run=run)
    comp = actions.add_parser("compare", help="the ON/OFF TTFT table of two bench JSONLs")
    comp.add_argument("on", metavar="ON_JSONL")
    comp.add_argument("off", metavar="OFF_JSONL")
    comp.add_argument("--merged", metavar="FILE", help="also write both runs to FILE (for calibrate --from-bench)")
    comp.set_defaults(run=_compare)


def _load(args: argparse.Namespace) -> Any:
    from impl.deploy.config import load_config

    return load_config(args.config)


def _check(args: argparse.Namespace) -> int:
    from impl.deploy.render import kv_transfer_config, router_ttl_s

    c = _load(args)
    print(f"{c.source}: OK")
    hw = c.instance
    print(f"  instance {hw.name}: {hw.gpus_per_node} x {hw.accelerator}, {hw.hbm_bytes_per_gpu / 1e9:.0f} GB HBM at "
          f"{hw.hbm_bytes_per_s_per_gpu / 1e12:.1f} TB/s each, EFA {hw.efa_bytes_per_s_per_gpu / 1e9:.0f} GB/s per "
          f"accelerator (calibration/data/hardware_{hw.key}.json)")
    if hw.is_neuron:
        print(f"  WARNING: {hw.accelerator} runs vLLM's Neuron backend: the launch commands below are the CUDA "
              "recipe's (kv_buffer_device, EFA RDMA env) and vLLM's engine overheads on Neuron are unknown to this "
              "project; adapt them and measure with the bench before trusting any profile")
    print(f"  model {c.model.name} (served as {c.model.served_name}), TP {c.model.tensor_parallel_size}")
    for s in (c.prefill, c.decode):
        print(f"  {s.role:8} {s.url}  NIXL side channel {s.host}:{s.side_channel_port}"
              + (f"  via ssh {s.ssh}" if s.ssh else "  (this machine)"))
    print(f"  router   {c.router.url}  (D notifies {c.router.url}/internal/kv_params; entries live <= "
          f"{router_ttl_s(c):g} s)")
    print(f"  NIXL backends {list(c.transfer.backends)}, env " + " ".join(f"{k}={v}" for k, v in c.transfer.env))
    print("  kv_connector_extra_config (ON): "
          + json.dumps(kv_transfer_config(c, "decode", "on")["kv_connector_extra_config"], sort_keys=True))
    print(f"  results in {c.results_path('')}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from impl.deploy.render import format_commands, plan

    for name, commands in plan(_load(args)):
        print(f"## {name}")
        sys.stdout.write(format_commands(commands))
    return 0


def _show(args: argparse.Namespace) -> int:
    from impl.deploy.render import format_commands, step_commands

    sys.stdout.write(format_commands(step_commands(_load(args), args.step, args.mode)))
    return 0


def _argv(args: argparse.Namespace) -> int:
    from impl.deploy.render import nul_argv, step_commands

    sys.stdout.buffer.write(nul_argv(step_commands(_load(args), args.step, args.mode)))
    sys.stdout.flush()
    return 0


def _compare(args: argparse.Namespace) -> int:
    from impl.deploy.compare import compare

    print(compare(args.on, args.off, args.merged))
    if args.merged:
        print(f"wrote {args.merged}", file=sys.stderr)
    return 0


def register(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "deploy", help="EFA deployment recipe: P/D vLLM with NIXL LIBFABRIC, router, bench, ON/OFF report",
        description="Check a deployment config and print (or hand the launch scripts) the exact commands that "
                    "start D, P and the router on EFA hosts, run the bench ON and OFF, and report.")
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m impl.deploy",
                                     description="bidikv's EFA deployment recipe (same as `bidikv deploy`)")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except ValueError as exc:  # a bad config or input: name it, no traceback, nothing launched
        print(f"bidikv deploy: error: {exc}", file=sys.stderr)
        return 2
