"""``bidikv tune``: choose decoder_kv_blocks_ttl and kv_recompute_threshold for a workload.

The workload is ``bidikv simulate``'s: the same config, flags and default (sim/engine/config.py), stated in
``--help`` and on the first line of the output. ``--json`` prints strict JSON (``null`` for no value).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
from typing import Any

from impl.policy import catalogue
from sim.tune.designs import DESIGN_THRESHOLDS
from sim.tune.grid import DECODE_MODES, DEFAULT_GAP_QUANTILES, DEFAULT_LEASES_S, DEFAULT_THRESHOLDS, DEFAULT_TTLS_S
from sim.tune.run_inputs import capacity_warnings, decode_memory, float_list, thresholds_of


def register(subparsers: Any) -> None:
    from sim.commands.simulate import add_config_flags, describe_spec, number
    from sim.engine.config import SimConfig

    p = subparsers.add_parser(
        "tune", help="sweep TTL x threshold x retention policy; recommend a vLLM config",
        description="Simulate every configuration of the grid on your workload, compare each with a clairvoyant oracle "
                    "and with bidirectional OFF, print the Pareto frontier of TTFT vs retained decode HBM and the "
                    "recommended vLLM settings, ready to paste. A lease keeps KV only while clients heartbeat, so "
                    "every lease runs under each client renewal behaviour: the recommendation is for the one "
                    "--client-renewal states, or, unstated, safe whether clients renew while open or never; a "
                    "table shows how it moves across behaviours. Default workload (the same as bidikv simulate's): "
                    f"{describe_spec(SimConfig().workload)}, on 1P1D.")
    p.add_argument("--config", default=None, metavar="TOML", help="TOML config file (the base every sweep point changes)")
    add_config_flags(p)
    g = p.add_argument_group("sweep")
    g.add_argument("--ttls", default=",".join(f"{t:g}" for t in DEFAULT_TTLS_S), metavar="SECONDS,...",
                   help="fixed TTLs in seconds, comma-separated, finite (vLLM takes no infinite TTL) "
                        "(default: %(default)s)")
    g.add_argument("--thresholds", default=None, metavar="TOKENS,...",
                   help="recompute thresholds in tokens or 'break_even' (default: "
                        f"{','.join(DEFAULT_THRESHOLDS)}; with --designs {','.join(DESIGN_THRESHOLDS)}, vLLM's and "
                        "bidikv's)")
    g.add_argument("--leases", default=",".join(f"{x:g}" for x in DEFAULT_LEASES_S), metavar="SECONDS,...",
                   help="heartbeat lease lengths in seconds, '' for none (default: %(default)s)")
    g.add_argument("--decode-modes", default=",".join(DECODE_MODES), metavar="MODE,...",
                   help="what D does with retained blocks under memory pressure, each configuration under each: pinned "
                        "(vLLM: held until read or expired, new work waits) and give_back (bidikv's connector gives "
                        "them back, never serving a freed block); default %(default)s")
    g.add_argument("--gap-quantiles", default=",".join(f"{x:g}" for x in DEFAULT_GAP_QUANTILES), metavar="Q,...",
                   help="quantiles of the observed think time to use as a learnt TTL, '' for none "
                        "(default: %(default)s)")
    g.add_argument("--learnt", action=argparse.BooleanOptionalAction, default=True,
                   help="also evaluate the learnt per-turn retention (the router's --learnt-retention-budget-tokens: "
                        "each turn held as long as its estimated return is worth, from the returns the router sees), "
                        "its budget the --max-retained-hbm-pct, nothing tuned, at each threshold (default: %(default)s)")
    from sim.tune.design_cli import add_design_flags

    add_design_flags(p)
    o = p.add_argument_group("objective")
    o.add_argument("--objective", default="ttft_p90", choices=("ttft_p50", "ttft_p90", "ttft_p99", "compute"),
                   help="what to minimise (default: %(default)s)")
    # the learnt retention is evaluated with this budget: its catalogue default is the tuner's
    o.add_argument("--max-retained-hbm-pct", type=number(float), default=catalogue.default("learnt_retention_budget_pct"),
                   metavar="PCT",
                   help="budget: time-averaged retained KV as a %% of all decode HBM for KV, in (0, 100] "
                        "(default: %(default)s)")
    o.add_argument("--tolerance-pct", type=number(float), default=1.0, metavar="PCT",
                   help="configurations within this %% of the best objective count as equal; the one pinning the "
                        "least HBM wins (default: %(default)s)")
    o.add_argument("--decode-hbm-gb", type=number(float), default=None, metavar="GB",
                   help="KV budget per decode instance in GB (default: the profile's)")
    x = p.add_argument_group("execution")
    x.add_argument("--executor", default="process", choices=("process", "ray", "serial"),
                   help="where sweep points run: a local process pool, a Ray cluster (RAY_ADDRESS) or this process "
                        "(default: %(default)s)")
    x.add_argument("--workers", type=number(int), default=None, metavar="N",
                   help="process-pool size, or the CPUs of a Ray started locally (no RAY_ADDRESS), >= 1 "
                        "(default: CPU count)")
    x.add_argument("--screen", action=argparse.BooleanOptionalAction, default=False,
                   help="screen fixed-TTL points from one pass over the workload (exact reuse figures, bounded "
                        "TTFT and retained HBM) and simulate only those the recommendation could be; the table marks "
                        "screened rows. Needs closed-loop gaps and P's prefix cache off (default: %(default)s)")
    x.add_argument("--json", action="store_true", help="print every configuration, the frontier and the recommendation "
                                                       "as strict JSON")
    x.add_argument("--plots", default=None, metavar="DIR",
                   help="directory for the frontier, TTFT CDF and retained-HBM plots (PNG and SVG)")
    x.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar with an estimate of the time left (default: on when stderr is a terminal)")
    p.set_defaults(run=run)


def check_args(args: argparse.Namespace) -> None:
    """The tuner's own numeric flags (the simulation's are checked by its config)."""
    if not 0 < args.max_retained_hbm_pct <= 100:
        raise ValueError(f"--max-retained-hbm-pct must be in (0, 100], got {args.max_retained_hbm_pct:g}")
    if not 0 <= args.tolerance_pct < math.inf:
        raise ValueError(f"--tolerance-pct must be a finite number >= 0, got {args.tolerance_pct:g}")
    if args.decode_hbm_gb is not None and not 0 < args.decode_hbm_gb < math.inf:
        raise ValueError(f"--decode-hbm-gb must be a finite number > 0, got {args.decode_hbm_gb:g}")
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")


def run(args: argparse.Namespace) -> int:
    from sim.commands.simulate import config_from_args, describe_workload, dumps, load_conversations, prepare_dir
    from sim.tune.executor import Runs
    from sim.tune.grid import REFERENCES, build_grid
    from sim.tune.sensitivity import (UNSTATED, lease_points, sensitivity_rows, sensitivity_table, stated_renewal,
                                      surely_simulated, sweep_jobs, tune_across_behaviours)
    from sim.tune.report import as_json, plots, recommendation_text, screening_summary, table as table_text
    from sim.tune.screen import TurnTable, screener

    check_args(args)
    if args.designs is not None:
        from sim.tune.design_cli import run_designs

        return run_designs(args)
    runs = Runs(args.executor, args.workers, args.progress)
    config = config_from_args(args)
    thresholds = thresholds_of(args)
    modes = [m.strip() for m in args.decode_modes.split(",") if m.strip()]
    grid = build_grid(float_list(args.ttls, "ttls"), thresholds, float_list(args.leases, "leases"),
                      float_list(args.gap_quantiles, "gap-quantiles"), modes,
                      args.max_retained_hbm_pct if args.learnt else None)
    plots_dir = prepare_dir(args.plots, "--plots") if args.plots else None
    conversations = load_conversations(config)
    workload = describe_workload(config, conversations)
    profile, decode_blocks, decode_hbm_gb, decode_kv_tokens = decode_memory(args, config)
    candidates = [*grid, *REFERENCES]
    # the workers simulate what the screen cannot spare while this process screens (config is final here)
    configs, overrides, _ = sweep_jobs(config, candidates)
    sure = surely_simulated(config, candidates, args.screen)
    runs.submit([configs[j] for j in sure], [overrides[j] for j in sure])
    table = TurnTable(config, conversations, profile)
    screen, not_screened = screener(config, conversations, profile, decode_blocks, table) if args.screen else (None, [])
    del conversations  # the workers build their own; a million turns need not stay here
    # a lease is only as good as the clients' heartbeats: every lease point runs under each client
    # behaviour, the recommendation is for the stated one (or safe under never and while_open)
    stated = stated_renewal(args)
    tuning = tune_across_behaviours(
        config, candidates, runs.run, args.objective, args.max_retained_hbm_pct, decode_hbm_gb, args.tolerance_pct,
        stated, screen, batch=runs.workers, compute_bound_tokens=table.compute_bound_tokens(), submit=runs.submit)
    runs.close()
    print(f"tune: {runs.simulations} simulations ({runs.cpu_s:,.0f} CPU s) on {runs.workers} {args.executor} "
          f"worker(s), idle {runs.idle_share():.1%} of the {runs.last_done - runs.started:,.0f} s from the start "
          "to the last simulation's end", file=sys.stderr)
    screening = screening_summary(tuning.narrowing, not_screened, args.screen)
    points, chosen = tuning.main.points, tuning.main.chosen
    sensitivity = sensitivity_rows(tuning, args.objective)
    topology = (config.topology.num_prefill, config.topology.num_decode)
    warnings = capacity_warnings(points, config.topology.num_prefill)
    if plots_dir is not None:
        for path in plots(points, chosen, args.objective, plots_dir, budget_gb=args.max_retained_hbm_pct / 100.0
                          * decode_hbm_gb):
            print(f"wrote {path}", file=sys.stderr)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    if args.json:
        out = as_json(points, chosen, args.objective, config.profile, topology, decode_kv_tokens)
        out.update(workload=workload, warnings=warnings, screening=screening, client_renewal=stated or UNSTATED,
                   client_renewal_sensitivity=sensitivity, client_renewal_lease_points=lease_points(tuning))
        print(dumps(out))
    else:
        print(f"workload: {workload['description']}")
        print(f"cluster:  {topology[0]}P{topology[1]}D, profile {config.profile}, decode KV memory "
              f"{decode_hbm_gb:,.0f} GB in all, budget {args.max_retained_hbm_pct:g} % of it retained on average")
        print(f"client renewal: {stated}" if stated else "client renewal: unstated (lease rows: the worse of never and "
              "while_open per figure)")
        print(f"screening: {screening['text']}")
        print(table_text(points, chosen, args.objective))
        print()
        print(sensitivity_table(sensitivity, tuning.main, args.objective))
        print()
        print(recommendation_text(chosen, config.profile, topology, decode_kv_tokens))
        if chosen is not None and chosen.candidate.policy.get("retention") == "lease":
            # a lease's figures hold only for clients that heartbeat as assumed: say which
            bound = " (they know the future: an upper bound, not a client you can deploy)" if stated == "until_next_turn" else ""
            print(f"  clients: these figures assume {stated or 'the worse of never and while_open'} clients{bound} "
                  "(sim/clients/renewal.py); see the sensitivity table for the others")
    return 0
