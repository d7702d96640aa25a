"""``bidikv simulate``: flags generated from the config dataclasses (one source of defaults)."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import pathlib
import sys
from typing import Any

from sim.config import ClientConfig, PolicyConfig, SimConfig, TopologyConfig, load_config
from sim.records import RECORD_FIELDS

_SECTIONS = (("topology", TopologyConfig), ("policy", PolicyConfig), ("clients", ClientConfig))
_TOP_LEVEL = ("seed", "profile", "num_clients", "max_sim_time_s")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field; defaults stay None so only given flags override the TOML file."""
    defaults = SimConfig()
    for name in _TOP_LEVEL:
        f = {f.name: f for f in dataclasses.fields(SimConfig)}[name]
        parser.add_argument(_flag(name), dest=f"cfg__{name}", default=None, type=type(getattr(defaults, name)),
                            help=f"{f.metadata['help']} (default: {getattr(defaults, name)})")
    for section, cls in _SECTIONS:
        group = parser.add_argument_group(section)
        instance = getattr(defaults, section)
        for f in dataclasses.fields(cls):
            default = getattr(instance, f.name)
            kw: dict[str, Any] = {"dest": f"cfg__{section}__{f.name}", "default": None,
                                  "help": f"{f.metadata['help']} (default: {default})"}
            if isinstance(default, bool):
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = type(default)
                if "choices" in f.metadata:
                    kw["choices"] = f.metadata["choices"]
            group.add_argument(_flag(f.name), **kw)
    w = parser.add_argument_group("workload")
    w.add_argument("--workload", dest="workload_kind", default=None, choices=("synthetic", "agentic", "mooncake"),
                   help="workload generator (default: synthetic, the published benchmark's settings)")
    w.add_argument("--trace", default=None, help="Mooncake JSONL trace path (implies --workload mooncake)")
    w.add_argument("--conversations", type=int, default=None, help="number of conversations (synthetic/agentic)")


def overrides_from_args(args: argparse.Namespace) -> dict:
    out: dict[str, Any] = {}
    for key, value in vars(args).items():
        if not key.startswith("cfg__") or value is None:
            continue
        parts = key.split("__")[1:]
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def workload_from_args(base: dict, args: argparse.Namespace) -> dict:
    """The config's [workload] table with --trace, --workload and --conversations applied."""
    workload = dict(base)
    if args.trace:
        workload = {"kind": "mooncake", "path": args.trace}
    elif args.workload_kind and args.workload_kind != workload.get("kind"):
        workload = {"kind": args.workload_kind}
    if args.conversations is not None:
        if workload.get("kind", "synthetic") == "mooncake":
            raise ValueError("--conversations does not apply to a trace (its conversations are fixed)")
        workload["num_conversations"] = args.conversations
    return workload


def config_from_args(args: argparse.Namespace) -> SimConfig:
    config = load_config(args.config, overrides_from_args(args))
    config.workload = workload_from_args(config.workload, args)
    return config


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("simulate", help="simulate a multi-turn workload on a P/D cluster",
                              description="Simulate router, prefill and decode nodes and the interconnect, with "
                                          "decisions from impl.policy. Prints TTFT by prompt length.")
    p.add_argument("--config", default=None, help="TOML config file (flags override it)")
    add_config_flags(p)
    p.add_argument("--compare", action="store_true", help="run bidirectional ON and OFF and print both")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.add_argument("--out", default=None, help="directory for records.csv, series.csv and summary.json")
    p.add_argument("--parquet", action="store_true", help="also write records.parquet (needs pyarrow)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: on when stderr is a terminal)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from sim.runner import run_config  # heavy imports only when simulating

    config = config_from_args(args)
    show_progress = sys.stderr.isatty() if args.progress is None else args.progress
    modes = (True, False) if args.compare else (config.policy.bidirectional,)
    results = {}
    for bidirectional in modes:
        cfg = dataclasses.replace(config, policy=dataclasses.replace(config.policy, bidirectional=bidirectional))
        results["on" if bidirectional else "off"] = run_config(cfg, progress=show_progress)
    if args.out:
        for mode, result in results.items():
            write_outputs(pathlib.Path(args.out) / mode if len(results) > 1 else pathlib.Path(args.out), result,
                          args.parquet)
    if args.json:
        payload = {mode: r.summary for mode, r in results.items()} if len(results) > 1 else next(iter(results.values())).summary
        print(json.dumps(payload, indent=2, sort_keys=True, default=_json_default))
    else:
        print(format_comparison(results))
    return 0


def _json_default(value: Any) -> Any:
    raise TypeError(f"not JSON serialisable: {value!r}")


def _num(value: float) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.0f}"


def format_comparison(results: dict) -> str:
    """TTFT p50/p90 by prompt-length bucket, one column pair per mode, plus the headline numbers."""
    modes = list(results)
    buckets: list[str] = []
    for r in results.values():
        buckets += [b for b in r.summary["ttft_by_prompt_bucket"] if b not in buckets]
    head = f"{'prompt':>9} " + "".join(f"{'TTFT p50 ' + m:>14}{'p90 ' + m:>10}" for m in modes)
    if len(modes) == 2:
        head += f"{'p50 speed-up':>14}"
    lines = ["TTFT (ms) by prompt length", head]
    for b in buckets:
        row = f"{b:>9} "
        cells = [results[m].summary["ttft_by_prompt_bucket"].get(b) for m in modes]
        for c in cells:
            row += f"{_num(c['p50_ms']) if c else '-':>14}{_num(c['p90_ms']) if c else '-':>10}"
        if len(modes) == 2 and all(cells):
            row += f"{cells[1]['p50_ms'] / cells[0]['p50_ms']:>13.2f}x"
        lines.append(row)
    lines.append("")
    for m in modes:
        s = results[m].summary
        lines.append(
            f"[{m}] turns {s['completed']}/{s['turns']}  TTFT p50 {_num(s['ttft']['p50_ms'])} ms p90 {_num(s['ttft']['p90_ms'])} ms  "
            f"reuse hit rate {s['reuse_hit_rate']:.0%}  recomputed tokens {s['tokens_recomputed']:,}  "
            f"retained {s['retained_hbm_gb_s']:,.0f} GB*s (peak {s['peak_retained_hbm_gb']:,.1f} GB)  "
            f"preemptions {s['preemptions']}" if not math.isnan(s["reuse_hit_rate"]) else f"[{m}] turns {s['completed']}")
    return "\n".join(lines)


def write_outputs(out: pathlib.Path, result: Any, parquet: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "records.csv", "w", newline="") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(RECORD_FIELDS + ["prefill_s"])
        for rec in result.records:
            writer.writerow([_cell(getattr(rec, f)) for f in RECORD_FIELDS] + [_cell(rec.prefill_s)])
    with open(out / "series.csv", "w", newline="") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(["t_s", "node", "running_blocks", "retained_blocks", "cached_blocks", "capacity_blocks"])
        writer.writerows((_cell(t), *rest) for t, *rest in result.series)
    (out / "summary.json").write_text(json.dumps(result.summary, indent=2, sort_keys=True) + "\n")
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(result.config), indent=2, sort_keys=True, default=str) + "\n")
    if parquet:
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError("--parquet needs pyarrow (pip install pyarrow)") from None
        cols = {f: [getattr(r, f) for r in result.records] for f in RECORD_FIELDS}
        pq.write_table(pa.table(cols), out / "records.parquet")


def _cell(value: Any) -> Any:
    # repr() of a float is the shortest round-trip form: byte-identical across runs and platforms
    return repr(value) if isinstance(value, float) else value
