"""Learnt per-turn retention against the best fixed TTL and lease chosen in hindsight, within one memory budget.

Run: python benchmarks/learnt_retention.py [--trace path/to/conversation_trace.jsonl] [--presets synthetic,agentic,...]
     [--budget-pct 50] [--workers 2] [--write-docs docs/results/learnt-retention.md]

For each workload (the Mooncake conversation trace on 4P4D, Qwen3-32B profile, as the README's tuning table;
each workload preset on the default 1P1D): bidirectional OFF, the clairvoyant oracle, fixed TTLs and heartbeat
leases (clients renewing while their session is open), and the learnt retention (impl.policy.return_time) with
its budget set to the same share of decode KV memory and nothing tuned. All pinned, as vLLM's D is. Per
configuration: TTFT p50/p90, mean retained decode KV as a share of all decode KV memory, retained HBM*s, the
share of the oracle's compute saving over OFF, and whether it fits the budget (mean retained within it, no
turn waiting at D for blocks, nothing rejected). The best fixed setting is the best-saving TTL or lease that
fits: chosen knowing the outcome, which the learnt one is not.

With ``--trace`` it first prints what predicts a return on that trace (the features the estimate groups by
were chosen from this table): per turn index, previous gap and context length, the share of turns whose
conversation comes back and the gap's p50/p90; then the most any per-group hold of those features could
keep, chosen in hindsight (the ceiling the learnt retention works under).

The Mooncake trace (Apache-2.0): https://github.com/kvcache-ai/Mooncake/blob/main/FAST25-release/traces/conversation_trace.jsonl
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.generated_section import ROOT, markers, shown_command, write_between_markers, write_headline  # noqa: E402

TTLS_S = (15.0, 30.0, 60.0, 90.0, 120.0, 180.0, 240.0, 360.0, 480.0, 900.0, 1800.0, 3600.0)
LEASES_S = (30.0, 60.0, 120.0, 240.0)


def _one(job: tuple[str, str, dict, dict]) -> tuple[str, str, dict, float]:
    workload_name, label, base, policy = job
    import dataclasses

    from sim.engine.config import SimConfig
    from sim.engine.runner import run_config

    cfg = SimConfig(workload=base["workload"], profile=base["profile"])
    cfg.topology.num_prefill, cfg.topology.num_decode = base["num_prefill"], base["num_decode"]
    cfg = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, **policy)).validate()
    started = time.process_time()
    result = run_config(cfg)
    s = result.summary
    figures = {"ttft_p50_ms": s["ttft"]["p50_ms"], "ttft_p90_ms": s["ttft"]["p90_ms"],
               "retained_hbm_gb_s": s["retained_hbm_gb_s"], "sim_time_s": s["sim_time_s"],
               "tokens_recomputed": s["tokens_recomputed"], "rejected": s["rejected"],
               "d_wait_total_s": s["d_wait"]["total_s"], "learnt": s.get("learnt_retention")}
    return workload_name, label, figures, time.process_time() - started


def _links(trace: str) -> tuple[list, list[int | None], dict[int, int], list[int]]:
    """The trace's requests, each one's parent (sim.workload.mooncake), first child and turn index."""
    from sim.workload.mooncake import find_parents, read_trace

    requests = read_trace(trace)
    parents = find_parents(requests)
    first_child: dict[int, int] = {}
    for i, p in enumerate(parents):
        if p is not None and p not in first_child:
            first_child[p] = i
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p is None else depth[p] + 1)
    return requests, parents, first_child, depth


def feature_table(trace: str) -> None:
    """What predicts a return on the trace, from its parent->child links."""
    requests, parents, first_child, depth = _links(trace)

    def gap_before(i: int) -> float | None:
        p = parents[i]
        return None if p is None else (requests[i].timestamp_ms - requests[p].timestamp_ms) / 1e3

    features = {
        "turn index": lambda i: f"{min(depth[i], 6)}{'+' if depth[i] >= 6 else ''}",
        "previous gap": lambda i: "first turn" if gap_before(i) is None else
        ("< 60 s" if gap_before(i) < 60 else "60-180 s" if gap_before(i) < 180 else
         "180-480 s" if gap_before(i) < 480 else ">= 480 s"),
        "context tokens": lambda i: f"{min(requests[i].input_length // 8000, 4) * 8}k+",
    }
    print(f"what predicts a return ({len(requests):,} requests, {len(first_child):,} continued):")
    for name, key in features.items():
        groups: dict[str, list[int]] = collections.defaultdict(list)
        for i in range(len(requests)):
            groups[key(i)].append(i)
        print(f"  {name}")
        for value in sorted(groups, key=lambda v: (len(v), v)):
            members = groups[value]
            gaps = sorted((requests[first_child[i]].timestamp_ms - requests[i].timestamp_ms) / 1e3
                          for i in members if i in first_child)
            share = len(gaps) / len(members)
            quantiles = (f"gap p50 {gaps[len(gaps) // 2]:5.0f} s  p90 {gaps[int(len(gaps) * 0.9)]:5.0f} s"
                         if gaps else "")
            print(f"    {value:<12} {len(members):>6,} turns  returns {share * 100:5.1f} %  {quantiles}")


def feature_ceiling(trace: str) -> tuple[float, list[tuple[str, int, float]]]:
    """How much any per-group hold could keep with the features the estimate groups by, chosen in
    hindsight: per group the bin edge (or no hold) that a single price makes best, at the memory a
    fixed 180 s TTL spends, from the trace alone (memory: a turn's tokens x min(gap, hold + 5 s);
    reuse: the next turn's prompt tokens it covers; gaps arrival to arrival). The simulator's figures
    differ (queues, P's verification), the ordering holds: what no estimate of these features can beat."""
    import bisect

    from impl.policy.return_time import DEFAULT_EDGES_S, PREVIOUS_GAP_EDGES_S, TURN_INDEX_BUCKETS

    requests, parents, child, depth = _links(trace)
    holds = (0.0, *DEFAULT_EDGES_S)
    turns = []  # (size, gap, reuse, turn index, previous gap)
    for i, r in enumerate(requests):
        size = r.input_length + r.output_length
        nxt = child.get(i)
        gap = (requests[nxt].timestamp_ms - r.timestamp_ms) / 1e3 if nxt is not None else math.inf
        reuse = min(requests[nxt].input_length, size) if nxt is not None else 0
        previous = None if parents[i] is None else (r.timestamp_ms - requests[parents[i]].timestamp_ms) / 1e3
        turns.append((size, gap, reuse, depth[i], previous))
    oracle = sum(t[2] for t in turns)

    def figures(members, hold):
        if hold == 0:
            return 0.0, 0.0
        return (sum(t[0] * min(t[1], hold + 5.0) for t in members), sum(t[2] for t in members if t[1] <= hold))

    budget, fixed = figures(turns, 180.0)

    def best(key) -> tuple[int, float]:
        groups: dict = collections.defaultdict(list)
        for t in turns:
            groups[key(t)].append(t)
        tables = [[figures(m, h) for h in holds] for m in groups.values()]

        def at(price: float) -> tuple[float, float]:
            cost = value = 0.0
            for table in tables:
                c, v = max(table, key=lambda cv: cv[1] - price * cv[0])
                cost, value = cost + c, value + v
            return cost, value

        lo, hi = -12.0, 2.0
        for _ in range(60):
            mid = (lo + hi) / 2.0
            lo, hi = (mid, hi) if at(10.0 ** mid)[0] > budget else (lo, mid)
        return len(tables), at(10.0 ** hi)[1] / oracle * 100

    def gap_bucket(g, edges=PREVIOUS_GAP_EDGES_S):
        return -1 if g is None else bisect.bisect_right(edges, g)

    rows: list[tuple[str, int, float]] = []
    print(f"\nthe most any hold per group keeps, chosen in hindsight, at a 180 s TTL's memory (trace alone; "
          f"the 180 s TTL: {fixed / oracle * 100:.1f} % of the oracle's reuse):")
    for name, key in (("one group (a fixed TTL)", lambda t: 0),
                      ("turn index", lambda t: min(t[3], TURN_INDEX_BUCKETS - 1)),
                      ("turn index x previous gap (the router's)", lambda t: (min(t[3], TURN_INDEX_BUCKETS - 1),
                                                                              gap_bucket(t[4]))),
                      ("finer: 7 turn indices x 9 previous gaps", lambda t: (min(t[3], 6), gap_bucket(
                          t[4], (15, 30, 60, 120, 180, 300, 480, 900)))),
                      ("knowing whether the conversation returns", lambda t: t[1] < math.inf)):
        groups, share = best(key)
        print(f"  {name:<44} {groups:>3} groups  {share:5.1f} %")
        rows.append((name, groups, share))
    return fixed / oracle * 100, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", help="Mooncake JSONL trace (skipped when absent)")
    ap.add_argument("--presets", default="synthetic,agentic,reasoning_chat,answer_drift,edited_history,reasoning_agent",
                    help="workload presets to run on 1P1D (comma-separated; empty for none)")
    ap.add_argument("--profile", default="qwen3-32b@p5en-tp8")
    ap.add_argument("--budget-pct", type=float, default=50.0,
                    help="retained decode KV allowed on average, in percent of all decode KV memory")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--write-docs", metavar="MARKDOWN",
                    help="also write the tables into this page, between its generated-section markers "
                         "(docs/results/learnt-retention.md)")
    args = ap.parse_args(argv)
    command = f"python benchmarks/learnt_retention.py {' '.join(argv if argv is not None else sys.argv[1:])}"
    load_before = os.getloadavg()[0]

    print(f"command: {command}")
    date = time.strftime('%Y-%m-%d %H:%M %Z')
    print(f"date: {date}  machine: {platform.node()} {os.cpu_count()} cores  load before: {load_before:.2f}")
    ceiling = None
    if args.trace:
        feature_table(args.trace)
        ceiling = feature_ceiling(args.trace)

    from calibration.profile import LatencyProfile
    from sim.tune.grid import LEARNT_D_TTL_S

    profile = LatencyProfile.load(args.profile)
    block_gb = profile.kv_bytes_per_token * profile.block_size / 1e9
    workloads: list[tuple[str, dict]] = []
    if args.trace:
        workloads.append(("mooncake 4P4D", {"workload": {"kind": "mooncake", "path": str(Path(args.trace).resolve())},
                                            "profile": args.profile, "num_prefill": 4, "num_decode": 4}))
    for preset in (p.strip() for p in args.presets.split(",") if p.strip()):
        workloads.append((f"{preset} 1P1D", {"workload": {"kind": preset}, "profile": args.profile,
                                             "num_prefill": 1, "num_decode": 1}))
    jobs: list[tuple[str, str, dict, dict]] = []
    for name, base in workloads:
        jobs.append((name, "OFF", base, {"bidirectional": False}))
        jobs.append((name, "oracle", base, {"retention": "oracle", "recompute_policy": "break_even"}))
        jobs += [(name, f"ttl {t:g} s", base, {"decoder_kv_blocks_ttl": t}) for t in TTLS_S]
        jobs += [(name, f"lease {t:g} s", base, {"retention": "lease", "lease_s": t, "heartbeat_interval_s": t / 3})
                 for t in LEASES_S]
        # as `bidikv tune` evaluates it: D's TTL the longest hold (D cuts none short), the router asks for less
        jobs.append((name, "learnt", base, {"retention": "learnt", "learnt_retention_budget_pct": args.budget_pct,
                                            "decoder_kv_blocks_ttl": LEARNT_D_TTL_S}))
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        results = {(w, label): (fig, cpu) for w, label, fig, cpu in pool.map(_one, jobs)}

    summary_rows = []
    tables: list[tuple[str, float, list[tuple[str, dict]]]] = []  # per workload: name, budget GB, (label, figures)
    for name, base in workloads:
        decode_gb = profile.decode_blocks() * block_gb * base["num_decode"]
        budget_gb = args.budget_pct / 100.0 * decode_gb
        off = results[(name, "OFF")][0]
        oracle = results[(name, "oracle")][0]
        saving = off["tokens_recomputed"] - oracle["tokens_recomputed"]
        print(f"\n{name}: budget {args.budget_pct:g} % of {decode_gb:,.0f} GB decode KV retained on average")
        print(f"  {'configuration':<14}{'TTFT p50':>11}{'p90':>12}{'retained %':>11}{'HBM TB*s':>10}{'oracle %':>9}"
              f"{'D wait s':>12}{'fits':>6}{'cpu s':>7}")
        best: tuple[float, str] | None = None
        rows: list[tuple[str, dict]] = []
        tables.append((name, decode_gb, rows))
        for w, label, _, _ in jobs:
            if w != name:
                continue
            m, cpu = results[(w, label)]
            rows.append((label, m))
            mean_gb = m["retained_hbm_gb_s"] / m["sim_time_s"] if m["sim_time_s"] > 0 else 0.0
            share = (off["tokens_recomputed"] - m["tokens_recomputed"]) / saving * 100 if saving else math.nan
            fits = mean_gb <= budget_gb and m["rejected"] == 0 and m["d_wait_total_s"] == 0
            m["share"], m["fits"], m["mean_pct"] = share, fits, mean_gb / decode_gb * 100
            print(f"  {label:<14}{m['ttft_p50_ms']:>11,.0f}{m['ttft_p90_ms']:>12,.0f}{m['mean_pct']:>11.1f}"
                  f"{m['retained_hbm_gb_s'] / 1e3:>10,.1f}{share:>9.1f}{m['d_wait_total_s']:>12,.0f}"
                  f"{'yes' if fits else 'no':>6}{cpu:>7.1f}")
            if fits and (label.startswith("ttl") or label.startswith("lease")) and (best is None or share > best[0]):
                best = (share, label)
        learnt = results[(name, "learnt")][0]
        if learnt["learnt"]:
            info = learnt["learnt"]
            print(f"  learnt: {info['holds_learnt']:,} holds learnt, {info['freed_at_once']:,} freed at once, "
                  f"{info['holds_fallback']:,} on the fallback TTL before enough returns; mean hold "
                  f"{info['mean_retention_s']:,.0f} s")
        summary_rows.append((name, best, learnt))
    print("\nlearnt (nothing tuned) against the best fixed setting that fits, chosen in hindsight:")
    print(f"  {'workload':<24}{'best fixed':>14}{'oracle %':>9}{'learnt %':>9}{'difference':>11}{'learnt fits':>12}")
    for name, best, learnt in summary_rows:
        best_share, best_label = best if best else (math.nan, "-")
        print(f"  {name:<24}{best_label:>14}{best_share:>9.1f}{learnt['share']:>9.1f}"
              f"{learnt['share'] - best_share:>+11.1f}{'yes' if learnt['fits'] else 'no':>12}")
    print("(retained %: mean retained decode KV over the run, of all decode KV memory; oracle %: share of the oracle's "
          "compute saving over OFF; fits: within the budget, no turn waited at D for blocks, nothing rejected)")
    load_after = os.getloadavg()[0]
    print(f"load after: {load_after:.2f}")
    if args.write_docs:
        command = shown_command(command, args.trace)
        text = markdown(command, f"{date}, {os.cpu_count()} cores, 1-minute load {load_before:.2f} before and "
                                 f"{load_after:.2f} after", args.budget_pct, tables, summary_rows, ceiling)
        write_between_markers(Path(args.write_docs), text, SCRIPT)
        print(f"wrote the tables into {args.write_docs}")
        text = headline(args.budget_pct, summary_rows)
        if text is not None:
            pages = write_headline("learnt-retention", text)
            print(f"wrote the headline into {', '.join(str(p.relative_to(ROOT)) for p in pages)}")
    return 0


def headline(budget_pct: float, summary_rows) -> str | None:
    """The sentence the README and the results index quote: the learnt retention on the Mooncake trace against
    the best fixed setting of this script's grid that fits, and its worst shortfall over the presets (None
    without the trace's row)."""
    mooncake = [(name, best, learnt) for name, best, learnt in summary_rows if name.startswith("mooncake")]
    if not mooncake or mooncake[0][1] is None:
        return None
    name, (best_share, best_label), learnt = mooncake[0]
    text = (f"On the Mooncake trace ({name.split()[-1]}), within a {budget_pct:g} % memory budget and with nothing "
            f"tuned, the router's learnt holds keep {learnt['share']:.1f} % of the oracle's compute saving, where the "
            f"best fixed setting of this benchmark's grid (TTLs {TTLS_S[0]:g}-{TTLS_S[-1]:g} s, leases) that fits, "
            f"chosen in hindsight ({best_label}), keeps {best_share:.1f} %")
    presets = [learnt["share"] - best[0] for n, best, learnt in summary_rows if not n.startswith("mooncake") and best]
    if presets:
        text += f"; within {max(0.0, -min(presets)):.1f} points of the best fixed setting on every preset workload"
    return text + "."


SCRIPT = "benchmarks/learnt_retention.py"
BEGIN, END = markers(SCRIPT)


def markdown(command: str, when: str, budget_pct: float, tables, summary_rows, ceiling) -> str:
    out = [f"Generated by `{command}` ({when}).", ""]
    for name, decode_gb, rows in tables:
        if not name.startswith("mooncake"):
            continue
        out += [f"**{name}**, budget {budget_pct:g} % of {decode_gb:,.0f} GB of decode KV retained on average:", "",
                "| configuration | TTFT p50 ms | p90 ms | retained % | HBM TB·s | oracle's saving % | D wait s | fits |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for label, m in rows:
            out.append(f"| {label} | {m['ttft_p50_ms']:,.0f} | {m['ttft_p90_ms']:,.0f} | {m['mean_pct']:.1f} | "
                       f"{m['retained_hbm_gb_s'] / 1e3:,.1f} | {m['share']:.1f} | {m['d_wait_total_s']:,.0f} | "
                       f"{'yes' if m['fits'] else 'no'} |")
        out.append("")
    if ceiling is not None:
        fixed, rows = ceiling
        out += [f"The most any hold per group could keep, chosen in hindsight from the trace alone, at the memory a "
                f"fixed 180 s TTL spends (that TTL: {fixed:.1f} % of the oracle's reuse on the same count):", "",
                "| groups | how many | most kept (% of the oracle's reuse) |", "| --- | ---: | ---: |"]
        out += [f"| {name} | {groups} | {share:.1f} |" for name, groups, share in rows]
        out.append("")
    out += ["The learnt retention against the best fixed TTL or lease that fits, chosen in hindsight:", "",
            "| workload | best fixed | its saving % | learnt saving % | difference | learnt fits |",
            "| --- | --- | ---: | ---: | ---: | --- |"]
    for name, best, learnt in summary_rows:
        best_share, best_label = best if best else (math.nan, "-")
        out.append(f"| {name} | {best_label} | {best_share:.1f} | {learnt['share']:.1f} | "
                   f"{learnt['share'] - best_share:+.1f} | {'yes' if learnt['fits'] else 'no'} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
