"""``bidikv tune --designs``: every design side by side on the workload, the recommended one and what to paste.

The workload, topology, budget, objective, tolerance, TTLs and thresholds are the single-design tune's flags
(sim/tune/cli.py); sim/tune/designs.py says which designs there are and how one is recommended.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sim.tune.designs import DEFAULT_MAX_TPOT_INCREASE_PCT, DESIGN_KEYS


def add_design_flags(parser: argparse.ArgumentParser) -> None:
    from sim.commands.simulate import number

    g = parser.add_argument_group("designs")
    g.add_argument("--designs", nargs="?", const="all", default=None, metavar="all|DESIGN,...",
                   help="compare designs instead of tuning one: each at its best setting (the sweep's TTLs and "
                        "thresholds) within the HBM budget, one row each, and the recommended design with what to "
                        f"paste; 'all' (the value when the flag is given alone) or some of {', '.join(DESIGN_KEYS)}")
    g.add_argument("--max-tpot-increase-pct", type=number(float), default=DEFAULT_MAX_TPOT_INCREASE_PCT, metavar="PCT",
                   help="--designs: a design is recommended only if its TPOT p50 is within this %% of OFF's "
                        "(work a D takes on slows its other sequences) (default: %(default)s)")


def check_design_args(args: argparse.Namespace) -> None:
    if not 0 <= args.max_tpot_increase_pct < float("inf"):
        raise ValueError(f"--max-tpot-increase-pct must be a finite number >= 0, got {args.max_tpot_increase_pct:g}")


def run_designs(args: argparse.Namespace) -> int:
    from sim.commands.simulate import config_from_args, describe_workload, dumps, load_conversations
    from sim.tune import design_report
    from sim.tune.run_inputs import capacity_warnings, decode_memory, float_list, thresholds_of
    from sim.tune.designs import DESIGN_THRESHOLDS, Settings, parse_designs, tune_designs
    from sim.tune.executor import Runs
    from sim.tune.screen import TurnTable

    check_design_args(args)
    designs = parse_designs(args.designs)
    config = config_from_args(args)
    settings = Settings(float_list(args.ttls, "ttls"), thresholds_of(args, DESIGN_THRESHOLDS), args.max_retained_hbm_pct)
    conversations = load_conversations(config)
    workload = describe_workload(config, conversations)
    profile, _, decode_hbm_gb, decode_kv_tokens = decode_memory(args, config)
    bound = TurnTable(config, conversations, profile).compute_bound_tokens()
    del conversations
    runs = Runs(args.executor, args.workers, args.progress)
    tuning = tune_designs(config, designs, settings, runs.run, args.objective, args.max_retained_hbm_pct,
                          decode_hbm_gb, args.tolerance_pct, args.max_tpot_increase_pct, bound)
    runs.close()
    print(f"tune: {runs.simulations} simulations ({runs.cpu_s:,.0f} CPU s) on {runs.workers} {args.executor} "
          f"worker(s), idle {runs.idle_share():.1%} of the {runs.last_done - runs.started:,.0f} s from the start "
          "to the last simulation's end", file=sys.stderr)
    topology = (config.topology.num_prefill, config.topology.num_decode)
    warnings = capacity_warnings(tuning.points, config.topology.num_prefill)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    if args.json:
        out: dict[str, Any] = design_report.as_json(tuning, config.profile, topology, decode_kv_tokens)
        out.update(workload=workload, warnings=warnings, max_retained_hbm_pct=args.max_retained_hbm_pct,
                   max_tpot_increase_pct=args.max_tpot_increase_pct)
        print(dumps(out))
        return 0
    print(f"workload: {workload['description']}")
    print(f"cluster:  {topology[0]}P{topology[1]}D, profile {config.profile}, decode KV memory "
          f"{decode_hbm_gb:,.0f} GB in all, budget {args.max_retained_hbm_pct:g} % of it retained on average")
    print(design_report.table(tuning, args.max_tpot_increase_pct))
    print()
    print(design_report.recommendation_text(tuning, config.profile, topology, decode_kv_tokens))
    return 0
