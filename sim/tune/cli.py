"""``bidikv tune``: choose decoder_kv_blocks_ttl and kv_recompute_threshold for a workload."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

from sim.tune.grid import DEFAULT_GAP_QUANTILES, DEFAULT_LEASES_S, DEFAULT_THRESHOLDS, DEFAULT_TTLS_S, parse_floats

# Without a workload given, tune a steady stream rather than the benchmark's 24 simultaneous
# conversations: enough conversations for stable p90s, arriving (Poisson) one per 20 s on average.
TUNE_DEFAULT_WORKLOAD = {"kind": "synthetic", "num_conversations": 200, "arrival_rate_per_s": 0.05}


def register(subparsers: Any) -> None:
    from sim.cli import add_config_flags

    p = subparsers.add_parser("tune", help="sweep TTL x threshold x retention policy; recommend a vLLM config",
                              description="Simulate every configuration of the grid on your workload, compare each with "
                                          "a clairvoyant oracle and with bidirectional OFF, print the Pareto frontier of "
                                          "TTFT vs retained decode HBM and the recommended vLLM settings.")
    p.add_argument("--config", default=None, help="TOML config file (the base every sweep point changes)")
    add_config_flags(p)
    g = p.add_argument_group("sweep")
    g.add_argument("--ttls", default=",".join("inf" if t == float("inf") else f"{t:g}" for t in DEFAULT_TTLS_S),
                   help="fixed TTLs in seconds, comma-separated ('inf' allowed) (default: %(default)s)")
    g.add_argument("--thresholds", default=",".join(DEFAULT_THRESHOLDS),
                   help="recompute thresholds in tokens or 'break_even' (default: %(default)s)")
    g.add_argument("--leases", default=",".join(f"{x:g}" for x in DEFAULT_LEASES_S),
                   help="heartbeat lease lengths in seconds, '' for none (default: %(default)s)")
    g.add_argument("--gap-quantiles", default=",".join(f"{x:g}" for x in DEFAULT_GAP_QUANTILES),
                   help="gap quantiles for learnt TTLs, '' for none (default: %(default)s)")
    o = p.add_argument_group("objective")
    o.add_argument("--objective", default="ttft_p90", choices=("ttft_p50", "ttft_p90", "ttft_p99", "compute"),
                   help="what to minimise (default: %(default)s)")
    o.add_argument("--max-retained-hbm-pct", type=float, default=50.0,
                   help="budget: time-averaged retained KV as a %% of all decode HBM for KV (default: %(default)s)")
    o.add_argument("--tolerance-pct", type=float, default=1.0,
                   help="configurations within this %% of the best objective count as equal; the one pinning the "
                        "least HBM wins (default: %(default)s)")
    o.add_argument("--decode-hbm-gb", type=float, default=None,
                   help="KV budget per decode instance in GB (default: the profile's)")
    x = p.add_argument_group("execution")
    x.add_argument("--executor", default="process", choices=("process", "ray", "serial"), help="(default: %(default)s)")
    x.add_argument("--workers", type=int, default=None, help="process-pool size (default: CPU count)")
    x.add_argument("--json", action="store_true", help="print frontier and recommendation as JSON")
    x.add_argument("--plots", default=None, help="directory for frontier, TTFT CDF and retained-HBM plots (PNG, SVG)")
    x.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: on when stderr is a terminal)")
    p.set_defaults(run=run)


def _list(text: str, name: str) -> list[float]:
    return parse_floats(text, name) if text.strip() else []


def run(args: argparse.Namespace) -> int:
    from calibration.profile import LatencyProfile
    from sim.cli import config_from_args
    from sim.tune.executor import run_points
    from sim.tune.grid import REFERENCES, build_grid
    from sim.tune.sensitivity import UNSTATED, sensitivity_rows, sensitivity_table, stated_renewal, tune_across_behaviours
    from sim.tune.report import as_json, plots, recommendation_text, table

    config = config_from_args(args)
    if args.conversations is None and args.trace is None and args.config is None and args.workload_kind is None:
        config.workload = dict(TUNE_DEFAULT_WORKLOAD)
    profile = LatencyProfile.load(config.profile)
    block_gb = profile.kv_bytes_per_token * profile.block_size / 1e9
    if args.decode_hbm_gb is not None:
        if not args.decode_hbm_gb > 0:
            raise ValueError("--decode-hbm-gb must be > 0")
        config.topology.decode_kv_blocks = int(args.decode_hbm_gb / block_gb)
    decode_blocks = config.topology.decode_kv_blocks or profile.decode_blocks()
    decode_hbm_gb = decode_blocks * block_gb * config.topology.num_decode
    thresholds = [t.strip() for t in args.thresholds.split(",") if t.strip()]
    grid = build_grid(_list(args.ttls, "ttls"), thresholds, _list(args.leases, "leases"), _list(args.gap_quantiles, "gap-quantiles"))
    candidates = [*grid, *REFERENCES]
    # a lease is only as good as the clients' heartbeats: every lease point runs under each client
    # behaviour, the recommendation is for the stated one (or safe under never and while_open)
    stated = stated_renewal(args)
    main, per_behaviour, tuned_ttl = tune_across_behaviours(
        config, candidates, lambda cfgs, pols: run_points(cfgs, pols, args.executor, args.workers, args.progress),
        args.objective, args.max_retained_hbm_pct, decode_hbm_gb, args.tolerance_pct, stated)
    points, chosen = main.points, main.chosen
    sensitivity = sensitivity_rows(main, per_behaviour, tuned_ttl, args.objective)
    if args.plots:
        for path in plots(points, chosen, args.objective, pathlib.Path(args.plots)):
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        out = as_json(points, chosen, args.objective, config.profile)
        out.update(client_renewal=stated or UNSTATED, client_renewal_sensitivity=sensitivity)
        print(json.dumps(out, indent=2, sort_keys=True, default=str))
    else:
        print(f"client renewal: {stated}" if stated else "client renewal: unstated (lease rows: the worse of never and "
              "while_open per figure)")
        print(table(points, chosen, args.objective))
        print()
        print(sensitivity_table(sensitivity, main, args.objective))
        print()
        print(recommendation_text(chosen, config.profile))
    return 0
