"""Decode memory as it binds: vLLM's pinned retention at every TTL against bidikv's give-back, on one workload.

Run: python benchmarks/decode_memory.py --trace path/to/conversation_trace.jsonl [--num-prefill 4 --num-decode 4]
     [--decode-hbm-gb GB] [--ttls 30,60,120,240,480] [--give-back-ttls 120,480,3600] [--workers 2]
     [--write-docs docs/results/decode-memory.md]

For each configuration: TTFT p50/p90, TPOT p50, the turns' time waiting at D for blocks (in all, and the
99th percentile of a waiting turn), how many waits retained blocks caused (they alone would have made room),
preemptions (and how many happened while retained blocks held part of the pool), retained decode KV (GB*s,
relative to vLLM's default of 480 s), and the share of the oracle's compute saving over bidirectional OFF
(the oracle retains exactly until the next turn; it is simulated pinned in the same memory). Prints the
command, the date, the machine's load before and after and each simulation's CPU seconds, so the table
can be regenerated and compared. The Mooncake trace (Apache-2.0) is at
https://github.com/kvcache-ai/Mooncake/blob/main/FAST25-release/traces/conversation_trace.jsonl.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.generated_section import ROOT, shown_command, write_between_markers, write_headline  # noqa: E402

SCRIPT = "benchmarks/decode_memory.py"


def _one(args: tuple[str, dict, dict]) -> tuple[str, dict, float]:
    label, base, policy = args
    import dataclasses

    from sim.engine.config import SimConfig
    from sim.engine.runner import run_config

    cfg = SimConfig(workload=base["workload"], profile=base["profile"])
    cfg.topology.num_prefill, cfg.topology.num_decode = base["num_prefill"], base["num_decode"]
    cfg.topology.decode_kv_blocks = base["decode_kv_blocks"]
    cfg = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, **policy)).validate()
    started = time.process_time()
    result = run_config(cfg)
    s = result.summary
    tpots = [r.tpot_s for r in result.records if not r.rejected and r.output_tokens > 1]
    figures = {"ttft_p50_ms": s["ttft"]["p50_ms"], "ttft_p90_ms": s["ttft"]["p90_ms"],
               "tpot_p50_ms": statistics.median(tpots) * 1e3 if tpots else math.nan,
               "d_wait_total_s": s["d_wait"]["total_s"], "d_wait_p99_s": s["d_wait"]["p99_ms"] / 1e3 if s["d_wait"]["n"] else 0.0,
               "waits_behind_retained": s["d_waits_behind_retained"], "preemptions": s["preemptions"],
               "preemptions_behind_retained": s["preemptions_behind_retained"], "given_back": s["given_back"],
               "retained_hbm_gb_s": s["retained_hbm_gb_s"], "tokens_recomputed": s["tokens_recomputed"],
               "rejected": s["rejected"], "completed": s["completed"]}
    return label, figures, time.process_time() - started


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, help="Mooncake JSONL trace")
    ap.add_argument("--profile", default="qwen3-32b@p5en-tp8")
    ap.add_argument("--num-prefill", type=int, default=4)
    ap.add_argument("--num-decode", type=int, default=4)
    ap.add_argument("--decode-hbm-gb", type=float, default=None,
                    help="KV memory per decode instance (default: the profile's HBM budget)")
    ap.add_argument("--ttls", default="30,60,120,240,480", help="pinned (vLLM) TTLs, seconds")
    ap.add_argument("--give-back-ttls", default="120,480,3600", help="give_back TTLs, seconds")
    ap.add_argument("--give-back-window-s", type=float, default=15.0)
    ap.add_argument("--give-back-headroom", type=float, default=0.05)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-bounds", dest="bounds", action="store_false",
                    help="skip the two rows that say what limits giving back: instant_drop (no protocol) and "
                         "give_back with twice D's memory")
    ap.add_argument("--write-docs", metavar="MARKDOWN",
                    help="also write the table into this page, between its generated-section markers")
    args = ap.parse_args(argv)

    from calibration.profile import LatencyProfile

    profile = LatencyProfile.load(args.profile)
    block_gb = profile.kv_bytes_per_token * profile.block_size / 1e9
    blocks = int(args.decode_hbm_gb / block_gb) if args.decode_hbm_gb else profile.decode_blocks()
    base = {"workload": {"kind": "mooncake", "path": str(Path(args.trace).resolve())}, "profile": args.profile,
            "num_prefill": args.num_prefill, "num_decode": args.num_decode, "decode_kv_blocks": blocks}
    jobs = [("OFF (one-way)", base, {"bidirectional": False}),
            ("oracle (pinned)", base, {"retention": "oracle", "recompute_policy": "break_even"})]
    for ttl in (float(x) for x in args.ttls.split(",") if x.strip()):
        jobs.append((f"pinned ttl={ttl:g}s", base, {"decoder_kv_blocks_ttl": ttl}))
    def give_back(ttl: float) -> dict:
        return {"decoder_kv_blocks_ttl": ttl, "retained_under_pressure": "give_back",
                "give_back_publish_window_s": args.give_back_window_s, "give_back_headroom": args.give_back_headroom}

    for ttl in (float(x) for x in args.give_back_ttls.split(",") if x.strip()):
        jobs.append((f"give_back ttl={ttl:g}s", base, give_back(ttl)))
    longest = max((float(x) for x in args.give_back_ttls.split(",") if x.strip()), default=3600.0)
    if args.bounds:
        jobs.append((f"instant_drop ttl={longest:g}s", base, {
            "decoder_kv_blocks_ttl": longest, "retained_under_pressure": "instant_drop"}))
        jobs.append((f"give_back ttl={longest:g}s, 2x D memory", dict(base, decode_kv_blocks=2 * blocks),
                     give_back(longest)))
    command = f"python benchmarks/decode_memory.py {' '.join(argv if argv is not None else sys.argv[1:])}"
    date = time.strftime('%Y-%m-%d %H:%M %Z')
    load_before = os.getloadavg()[0]
    print(f"command: {command}")
    print(f"date: {date}  machine: {platform.node()} {os.cpu_count()} cores  load before: {load_before:.2f}")
    print(f"cluster: {args.num_prefill}P{args.num_decode}D, {args.profile}, {blocks:,} KV blocks "
          f"({blocks * block_gb:,.0f} GB) per decode instance")
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        results = {label: (fig, cpu) for label, fig, cpu in pool.map(_one, jobs)}
    off, oracle = results["OFF (one-way)"][0], results["oracle (pinned)"][0]
    default_hbm = results.get("pinned ttl=480s", (None,))[0]
    saving = off["tokens_recomputed"] - oracle["tokens_recomputed"]
    head = (f"{'configuration':<34}{'TTFT p50':>9}{'p90':>9}{'TPOT p50':>9}{'D wait s':>10}{'p99 s':>7}"
            f"{'behind':>8}{'preempt':>8}{'(ret.)':>7}{'given':>7}{'HBM vs480':>10}{'oracle%':>8}{'cpu s':>7}")
    print(head)
    rows = []  # (label, figures, share of the oracle's saving, retained HBM vs vLLM's default)
    for label, _, _ in jobs:
        m, cpu = results[label]
        share = (off["tokens_recomputed"] - m["tokens_recomputed"]) / saving * 100 if saving else math.nan
        hbm = m["retained_hbm_gb_s"] / default_hbm["retained_hbm_gb_s"] if default_hbm and default_hbm["retained_hbm_gb_s"] else math.nan
        rows.append((label, m, share, hbm))
        print(f"{label:<34}{m['ttft_p50_ms']:>9,.0f}{m['ttft_p90_ms']:>9,.0f}{m['tpot_p50_ms']:>9.1f}"
              f"{m['d_wait_total_s']:>10,.0f}{m['d_wait_p99_s']:>7,.0f}{m['waits_behind_retained']:>8,}"
              f"{m['preemptions']:>8,}{m['preemptions_behind_retained']:>7,}{m['given_back']:>7,}{hbm:>10.2f}"
              f"{share:>8.1f}{cpu:>7.1f}")
    print("(D wait s: turns' time waiting at D for blocks, summed; p99 s: of a turn that waited; behind: waits that "
          "retained blocks alone would have made room for; preempt (ret.): preemptions, and those while retained "
          "blocks held part of the pool; given: retained turns given back; oracle%: share of the oracle's compute "
          "saving over OFF)")
    load_after = os.getloadavg()[0]
    print(f"load after: {load_after:.2f}")
    if args.write_docs:
        when = f"{date}, {os.cpu_count()} cores, 1-minute load {load_before:.2f} before and {load_after:.2f} after"
        cluster = f"{args.num_prefill}P{args.num_decode}D, {args.profile}, {blocks * block_gb:,.0f} GB of KV per decode instance"
        write_between_markers(Path(args.write_docs), markdown(shown_command(command, args.trace), when, cluster, rows),
                              SCRIPT)
        print(f"wrote the table into {args.write_docs}")
        text = headline(f"{args.num_prefill}P{args.num_decode}D, {args.profile}", rows)
        if text is not None:
            pages = write_headline("decode-memory", text)
            print(f"wrote the headline into {', '.join(str(p.relative_to(ROOT)) for p in pages)}")
    return 0


def _ms(value: float) -> str:
    return f"{value / 1e3:,.0f} s" if value >= 1e4 else f"{value:,.0f} ms"


def headline(cluster: str, rows) -> str | None:
    """The sentence the README and the results index quote: vLLM's pinned D at its default TTL, the longest
    pinned TTL that never makes a turn wait, and give_back at the default TTL (None without those rows)."""
    by = {label: (m, share) for label, m, share, _ in rows}
    if "pinned ttl=480s" not in by or "give_back ttl=480s" not in by:
        return None
    default, gb = by["pinned ttl=480s"], by["give_back ttl=480s"]
    pinned = sorted((float(label[len("pinned ttl="):-1]), m, share) for label, (m, share) in by.items()
                    if label.startswith("pinned ttl="))
    calm = [(ttl, share) for ttl, m, share in pinned if not m["d_wait_total_s"] and not m["preemptions"]]
    waits = default[0]["d_wait_total_s"] > 0 or default[0]["preemptions"] > 0
    text = (f"On the Mooncake conversation trace ({cluster}), vLLM's pinned retention at its default "
            f"480 s TTL {'makes new work wait at D' if waits else 'never makes new work wait'}: TTFT p50 "
            f"{_ms(default[0]['ttft_p50_ms'])}, {default[0]['preemptions']:,} preemptions")
    if calm:
        text += (f"; the longest pinned TTL that never waits ({calm[-1][0]:g} s) keeps {calm[-1][1]:.1f} % of a "
                 f"clairvoyant oracle's compute saving")
    return (text + f". bidikv's `give_back` at the same TTL: TTFT p50 / p90 {_ms(gb[0]['ttft_p50_ms'])} / "
            f"{_ms(gb[0]['ttft_p90_ms'])}, {'no waits' if not gb[0]['d_wait_total_s'] else 'turns waiting'}, "
            f"{gb[1]:.1f} % of the oracle's saving.")


def markdown(command: str, when: str, cluster: str, rows) -> str:
    out = [f"Generated by `{command}` ({when}); {cluster}.", "",
           "| configuration | TTFT p50 / p90 ms | TPOT p50 ms | turns' wait at D for blocks | preemptions | "
           "retained HBM vs 480 s | % of oracle's compute saving |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for label, m, share, hbm in rows:
        wait = (f"{m['d_wait_total_s']:,.0f} s (p99 {m['d_wait_p99_s']:,.0f} s)" if m["d_wait_total_s"] else "0")
        out.append(f"| {label} | {m['ttft_p50_ms']:,.0f} / {m['ttft_p90_ms']:,.0f} | {m['tpot_p50_ms']:.1f} | {wait} | "
                   f"{m['preemptions']:,} | {hbm:.2f} | {share:.1f} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
