"""Every design side by side on a trace or a preset workload: which one to deploy, and how far it is from the oracle.

Run: python benchmarks/designs.py [--trace path/to/conversation_trace.jsonl --num-prefill 4 --num-decode 4]
     [--presets synthetic,agentic] [--max-retained-hbm-pct 50] [--designs all] [--workers 2] [--json]
     [--write-docs docs/results/designs.md]

Per workload, `bidikv tune --designs`'s evaluation (sim/tune/designs.py): each design at its best setting within
the HBM budget, one row each (TTFT p50/p90, TPOT p50, share of the oracle's compute saving, turns' wait at D for
blocks, preemptions, retained HBM*s relative to vLLM's default, host DRAM*s), the references (OFF, the clairvoyant
oracle) and the recommended design; then the goal of the design tune checked on the recommendation: at least 95 %
of the oracle's compute saving, no wait or preemption caused by retained KV, TTFT p90 within 5 % of the oracle's,
TPOT p50 within 3 % of OFF's. The trace runs on --num-prefill/--num-decode, each preset on 1P1D with the tuner's
default arrivals (200 conversations, 0.05/s). Prints the command,
the date, the machine's load before and after and the simulations' CPU seconds, so a table can be regenerated and
compared. The Mooncake trace (Apache-2.0):
https://github.com/kvcache-ai/Mooncake/blob/main/FAST25-release/traces/conversation_trace.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.generated_section import shown_command, write_between_markers  # noqa: E402

SCRIPT = "benchmarks/designs.py"
# the design tune's goal, on the recommended design
GOAL = {"oracle_saving_pct": 95.0, "ttft_p90_vs_oracle_pct": 5.0, "tpot_p50_vs_off_pct": 3.0}
# one row per design in JSON, these keys first (the table's columns)
KEYS = ("design", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "oracle_saving_pct", "d_wait_s", "preemptions",
        "hbm_s_vs_default", "dram_s")


def goal_check(rows: list[dict[str, Any]], chosen: str | None) -> dict[str, Any]:
    """The goal's four conditions on the recommended design's row, each with its figure."""
    if chosen is None:
        return {"met": False, "why": "no design is acceptable"}
    row = next(r for r in rows if r["design"] == chosen)
    off, oracle = rows[0], rows[-1]
    ttft = (row["ttft_p90_ms"] / oracle["ttft_p90_ms"] - 1) * 100
    tpot = (row["tpot_p50_ms"] / off["tpot_p50_ms"] - 1) * 100 if row["tpot_p50_ms"] and off["tpot_p50_ms"] else math.nan
    checks = {
        "oracle_saving_pct": (row["oracle_saving_pct"], row["oracle_saving_pct"] >= GOAL["oracle_saving_pct"]),
        "retention_waits_and_preemptions": (row["d_waits_behind_retained"] + row["preemptions_behind_retained"],
                                            row["d_waits_behind_retained"] + row["preemptions_behind_retained"] == 0),
        "ttft_p90_vs_oracle_pct": (ttft, ttft <= GOAL["ttft_p90_vs_oracle_pct"]),
        "tpot_p50_vs_off_pct": (tpot, tpot <= GOAL["tpot_p50_vs_off_pct"]),
    }
    return {"met": all(ok for _, ok in checks.values()), "design": chosen,
            "checks": {k: {"value": v, "met": ok} for k, (v, ok) in checks.items()}}


def evaluate_workload(name: str, config: Any, designs: list, args: argparse.Namespace, runs: Any) -> dict[str, Any]:
    from sim.tune import design_report
    from sim.tune.designs import Settings, tune_designs
    from sim.tune.designs import DESIGN_THRESHOLDS
    from sim.tune.grid import DEFAULT_TTLS_S
    from sim.tune.screen import TurnTable
    from sim.workload import load_workload
    from calibration.profile import LatencyProfile

    profile = LatencyProfile.load(config.profile)
    conversations = load_workload(config.workload, config.seed)
    turns = sum(len(c.turns) for c in conversations)
    bound = TurnTable(config, conversations, profile).compute_bound_tokens()
    del conversations
    block_gb = profile.kv_bytes_per_token * profile.block_size / 1e9
    decode_hbm_gb = (config.topology.decode_kv_blocks or profile.decode_blocks()) * block_gb * config.topology.num_decode
    settings = Settings(DEFAULT_TTLS_S, DESIGN_THRESHOLDS, args.max_retained_hbm_pct)
    cpu = runs.cpu_s
    tuning = tune_designs(config, designs, settings, runs.run, "ttft_p90", args.max_retained_hbm_pct, decode_hbm_gb,
                          1.0, args.max_tpot_increase_pct, bound)
    rows = design_report.rows(tuning)
    chosen = tuning.chosen.design.key if tuning.chosen else None
    topo = f"{config.topology.num_prefill}P{config.topology.num_decode}D"
    return {"workload": name, "cluster": topo, "turns": turns, "decode_hbm_gb": decode_hbm_gb,
            "rows": [{**{k: r[k] for k in KEYS}, **r} for r in rows], "recommended": chosen,
            "recommended_setting": tuning.chosen and rows[[r["design"] for r in rows].index(chosen)]["setting"],
            "goal": goal_check(rows, chosen), "cpu_s": runs.cpu_s - cpu}


def text_table(w: dict[str, Any]) -> str:
    head = (f"{'design':<32}{'setting':<34}{'TTFT p50':>9}{'p90':>8}{'TPOT p50':>9}{'oracle%':>8}{'D wait s':>10}"
            f"{'preempt':>8}{'HBM vs480':>10}{'DRAM GB*s':>11}")
    lines = [f"{w['workload']} {w['cluster']} ({w['turns']:,} turns, {w['decode_hbm_gb']:,.0f} GB decode KV): "
             f"recommended {w['recommended'] or 'none'}", head]
    for r in w["rows"]:
        mark = "*" if r["design"] == w["recommended"] else ("x" if r["acceptable"] is False else "")
        lines.append(f"{r['design']:<32}{r['setting']:<34}{_n(r['ttft_p50_ms'], ',.0f'):>9}{_n(r['ttft_p90_ms'], ',.0f'):>8}"
                     f"{_n(r['tpot_p50_ms'], '.2f'):>9}{_n(r['oracle_saving_pct'], '.1f'):>8}{_n(r['d_wait_s'], ',.0f'):>10}"
                     f"{r['preemptions']:>8,}{_n(r['hbm_s_vs_default'], '.2f'):>10}{_n(r['dram_s'], ',.0f'):>11}  {mark}")
    g = w["goal"]
    if "checks" in g:
        c = g["checks"]
        lines.append(f"goal {'MET' if g['met'] else 'NOT met'} by {g['design']}: oracle's saving "
                     f"{c['oracle_saving_pct']['value']:.1f} % (>= {GOAL['oracle_saving_pct']:g}), waits+preemptions "
                     f"caused by retention {c['retention_waits_and_preemptions']['value']:,} (0), TTFT p90 "
                     f"{c['ttft_p90_vs_oracle_pct']['value']:+.1f} % on the oracle's (<= +{GOAL['ttft_p90_vs_oracle_pct']:g}), "
                     f"TPOT p50 {c['tpot_p50_vs_off_pct']['value']:+.1f} % on OFF's (<= +{GOAL['tpot_p50_vs_off_pct']:g})")
    else:
        lines.append(f"goal NOT met: {g['why']}")
    for r in w["rows"]:
        if r["acceptable"] is False:
            lines.append(f"  x {r['design']}: {'; '.join(r['why_not'])}")
    return "\n".join(lines)


def _n(x: Any, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def markdown(command: str, when: str, workloads: list[dict[str, Any]], budget_pct: float) -> str:
    out = [f"Generated by `{command}` ({when}); HBM budget {budget_pct:g} % of decode KV retained on average.", ""]
    for w in workloads:
        out += [f"**{w['workload']}, {w['cluster']}** ({w['turns']:,} turns, {w['decode_hbm_gb']:,.0f} GB of decode KV "
                "memory):", "",
                "| design | best setting | TTFT p50 / p90 ms | TPOT p50 ms | % of oracle's compute saving | "
                "turns' wait at D | preemptions | retained HBM·s vs vLLM's default | host DRAM GB·s |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in w["rows"]:
            bold = "**" if r["design"] == w["recommended"] else ""
            name = f"{bold}{r['design']}{' (recommended)' if bold else ''}{bold}"
            if r["acceptable"] is False:
                name += f" (not acceptable: {'; '.join(r['why_not'])})"
            out.append(f"| {name} | {r['setting'] or '-'} | {_n(r['ttft_p50_ms'], ',.0f')} / {_n(r['ttft_p90_ms'], ',.0f')} | "
                       f"{_n(r['tpot_p50_ms'], '.2f')} | {_n(r['oracle_saving_pct'], '.1f')} | {_n(r['d_wait_s'], ',.0f')} s | "
                       f"{r['preemptions']:,} | {_n(r['hbm_s_vs_default'], '.2f')} | {_n(r['dram_s'], ',.0f')} |")
        g = w["goal"]
        if "checks" in g:
            c = g["checks"]
            out += ["", f"Goal {'met' if g['met'] else '**not met**'} by {g['design']}: "
                        f"{c['oracle_saving_pct']['value']:.1f} % of the oracle's compute saving (≥ 95), "
                        f"{c['retention_waits_and_preemptions']['value']:,} waits or preemptions caused by retained KV (0), "
                        f"TTFT p90 {c['ttft_p90_vs_oracle_pct']['value']:+.1f} % on the oracle's (≤ +5 %), "
                        f"TPOT p50 {c['tpot_p50_vs_off_pct']['value']:+.1f} % on OFF's (≤ +3 %)."]
        else:
            out += ["", f"Goal **not met**: {g['why']}."]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", help="Mooncake JSONL trace (run on --num-prefill/--num-decode)")
    ap.add_argument("--num-prefill", type=int, default=4)
    ap.add_argument("--num-decode", type=int, default=4)
    ap.add_argument("--presets", default=None,
                    help="workload presets to run on 1P1D, comma-separated (default: synthetic,agentic without "
                         "--trace, none with it)")
    ap.add_argument("--profile", default="qwen3-32b@p5en-tp8")
    ap.add_argument("--designs", default="all", help="all, or some of the design keys (sim/tune/designs.py)")
    ap.add_argument("--max-retained-hbm-pct", type=float, default=50.0,
                    help="HBM budget: retained decode KV on average, in %% of all decode KV memory")
    ap.add_argument("--max-tpot-increase-pct", type=float, default=3.0)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", action="store_true", help="print the rows as JSON (one object, a list per workload)")
    ap.add_argument("--write-docs", metavar="MARKDOWN",
                    help="also write the tables into this page, between its generated-section markers")
    args = ap.parse_args(argv)

    from sim.engine.config import SimConfig
    from sim.tune.designs import parse_designs
    from sim.tune.executor import Runs

    designs = parse_designs(args.designs)
    presets = args.presets if args.presets is not None else ("" if args.trace else "synthetic,agentic")
    workloads: list[tuple[str, SimConfig]] = []
    if args.trace:
        cfg = SimConfig(workload={"kind": "mooncake", "path": str(Path(args.trace).resolve())}, profile=args.profile)
        cfg.topology.num_prefill, cfg.topology.num_decode = args.num_prefill, args.num_decode
        workloads.append((Path(args.trace).stem, cfg.validate()))
    for preset in (p.strip() for p in presets.split(",") if p.strip()):
        # the tuner's default workload (200 conversations arriving at 0.05/s) from the preset's generator
        workloads.append((preset, SimConfig(workload=dict(SimConfig().workload, kind=preset), profile=args.profile).validate()))
    if not workloads:
        ap.error("give --trace or --presets")
    command = f"python {SCRIPT} {' '.join(argv if argv is not None else sys.argv[1:])}"
    date = time.strftime("%Y-%m-%d %H:%M %Z")
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    runs = Runs("process", args.workers, progress=False)
    results = [evaluate_workload(name, cfg, designs, args, runs) for name, cfg in workloads]
    runs.close()
    wall = time.perf_counter() - started
    load_after = os.getloadavg()[0]
    meta = {"command": command, "date": date, "machine": f"{platform.node()} {os.cpu_count()} cores",
            "load_before": load_before, "load_after": load_after, "wall_s": wall, "simulations": runs.simulations,
            "cpu_s": runs.cpu_s, "max_retained_hbm_pct": args.max_retained_hbm_pct, "goal": GOAL}
    if args.json:
        from sim.commands.simulate import dumps

        print(dumps({**meta, "workloads": results}))
    else:
        print(f"command: {command}")
        print(f"date: {date}  machine: {meta['machine']}  load before: {load_before:.2f}")
        for w in results:
            print()
            print(text_table(w))
        print(f"\n{runs.simulations} simulations, {runs.cpu_s:,.0f} CPU s, {wall:,.0f} s wall on {args.workers} "
              f"workers; load after: {load_after:.2f}")
    if args.write_docs:
        when = (f"{date}, {os.cpu_count()} cores, 1-minute load {load_before:.2f} before and {load_after:.2f} after, "
                f"{wall:,.0f} s wall")
        write_between_markers(Path(args.write_docs), markdown(shown_command(command, args.trace), when, results,
                                                              args.max_retained_hbm_pct), SCRIPT)
        print(f"wrote the tables into {args.write_docs}", file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
