"""Simulator speed: simulated turns per wall second and peak RSS, 1P1D / 8P8D / 64P64D.

Run: python benchmarks/sim_speed.py [--turns 10000 100000 1000000] [--topologies 1 8 64]
Each size runs in a fresh process so peak RSS is that run's own. Full KV accounting is always on
(block pools, retention, pressure, store). The workload is the synthetic multi-turn generator with
short gaps, open-loop arrivals scaled to the topology so every node stays busy.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def one(turns: int, nodes: int, seed: int) -> dict:
    from sim.config import SimConfig
    from sim.runner import run_config

    # ~8 requests per conversation (vLLM's 12-18 messages); arrivals spread so load scales with nodes
    conversations = max(1, turns // 8)
    config = SimConfig(seed=seed)
    config.topology.num_prefill = config.topology.num_decode = nodes
    config.policy.placement = "least_loaded"
    config.workload = {"kind": "synthetic", "num_conversations": conversations,
                       "arrival_rate_per_s": 0.25 * nodes, "inter_turn_gap_s": {"kind": "exponential", "mean": 30.0}}
    config.validate()
    start = time.perf_counter()
    result = run_config(config)
    wall = time.perf_counter() - start
    simulated = result.summary["turns"]
    return {"turns": simulated, "topology": f"{nodes}P{nodes}D", "wall_s": round(wall, 2),
            "turns_per_s": round(simulated / wall), "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "completed": result.summary["completed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--topologies", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one(args.child[0], args.child[1], args.seed)))
        return
    print(f"{'topology':>9} {'turns':>9} {'wall s':>8} {'turns/s':>9} {'peak RSS MB':>12}")
    for nodes in args.topologies:
        for turns in args.turns:
            out = subprocess.run([sys.executable, __file__, "--child", str(turns), str(nodes), "--seed", str(args.seed)],
                                 check=True, capture_output=True, text=True).stdout
            r = json.loads(out)
            print(f"{r['topology']:>9} {r['turns']:>9} {r['wall_s']:>8} {r['turns_per_s']:>9} {r['peak_rss_mb']:>12}", flush=True)


if __name__ == "__main__":
    main()
