"""Simulator speed: simulated turns per wall second and peak RSS, 1P1D / 8P8D / 64P64D.

Run: python benchmarks/sim_speed.py [--turns 10000 100000 1000000] [--topologies 1 8 64]
Each size runs in a fresh process so peak RSS is that run's own. Full KV accounting is always on
(block pools, retention, pressure, store). The workload is the synthetic multi-turn generator with
short gaps, open-loop arrivals scaled to the topology so every node stays busy.

Columns: ``turns/s`` is simulated turns per wall second of the whole run (workload generation
included); ``cpu turns/s`` the same per CPU second of the process (less sensitive to a shared host);
``events/turn`` simpy events scheduled per simulated turn; ``bare ev/s`` how many events a bare simpy
timeout loop runs per CPU second in the same process (mean of a calibration just before and just after
the run), and ``bare ev/turn`` = bare ev/s divided by cpu turns/s: what one simulated turn costs in
bare-simpy events, a figure that survives a noisy host (its inverse is turns per bare event). ``KB/turn``: peak RSS the run added (workload, records, live
state) per simulated turn. The load average is printed with the table, and which build of the simulator
ran: its sources, or the compiled one of ``python tools/build_native.py`` (sim/native.py).

``--instructions`` measures the same ratio in CPU instructions instead of seconds, under valgrind's
callgrind (instructions are counted, not timed: the same count whatever else the host runs):
instructions per simulated turn (the difference between a run of N turns and one of 4N, so the
interpreter's start, imports and the first turns' ramp-up cancel out), instructions per bare simpy event
(the calibration loop at 100k and 400k events, differenced the same way), and their ratio ``bare
ev/turn (instr)``. It is not the time ratio: the bare loop runs more instructions per cycle than the
simulator (fewer cache misses), so the two differ by a factor the table shows; ``--instructions N``
sets the smaller run's turns (default 1000; 64P64D's ramp-up needs more).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time


# The simulator's speed targets, and the bare simpy rate of the machine they were set on (its bare ev/turn bound)
TARGET_TURNS_PER_S = {1: 20_000, 64: 15_000}
TARGET_BARE_EVENTS_PER_S = 1.27e6


def bare_simpy_events_per_s(events: int = 200_000) -> float:
    """Events per CPU second of the cheapest simpy loop: 10 processes each yielding timeouts (CPU
    time, like ``cpu turns/s``, so time the shared host gives other processes counts in neither)."""
    import simpy

    env = simpy.Environment()

    def ticker(env: simpy.Environment):
        while True:
            yield env.timeout(1)

    for _ in range(10):
        env.process(ticker(env))
    start = time.process_time()
    env.run(until=events // 10)
    cpu = time.process_time() - start
    return next(env._eid) / cpu  # simpy numbers every scheduled event; this counts them


def simulator_build() -> str:
    """Which build the runs import: the sources, or the compiled one (tools/build_native.py)."""
    from sim.native import build_name

    return build_name()


def bare_child(events: int) -> None:
    """The calibration loop alone (for an instruction count of it)."""
    bare_simpy_events_per_s(events)


def one(turns: int, nodes: int, seed: int, calibrate: bool = True, arrival_rate_per_s: float | None = None,
        think_mean_s: float = 30.0) -> dict:
    """One run of ``turns`` on ``nodes``P``nodes``D. The arrival rate defaults to 0.25 conversations/s
    per node pair (every node busy); benchmarks/sim_cost_split.py sets it and the think time apart."""
    from sim.engine.cluster import Cluster
    from sim.engine.config import SimConfig
    from sim.workload import load_workload
    from calibration.profile import LatencyProfile

    # ~8 requests per conversation (vLLM's 12-18 messages); arrivals spread so load scales with nodes
    conversations = max(1, turns // 8)
    config = SimConfig(seed=seed)
    config.topology.num_prefill = config.topology.num_decode = nodes
    config.policy.placement = "least_loaded"
    config.workload = {"kind": "synthetic", "num_conversations": conversations,
                       "arrival_rate_per_s": 0.25 * nodes if arrival_rate_per_s is None else arrival_rate_per_s,
                       "inter_turn_gap_s": {"kind": "exponential", "mean": think_mean_s}}
    config.validate()
    bare = bare_simpy_events_per_s() if calibrate else math.nan
    rss_before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # interpreter, modules, calibration
    start, cpu_start = time.perf_counter(), time.process_time()
    # what sim.engine.runner.run_config does, with the cluster kept to read its event count
    workload = load_workload(config.workload, config.seed)
    cluster = Cluster(config, LatencyProfile.load(config.profile))
    result = cluster.run(workload)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    simulated = result.summary["turns"]
    events = next(cluster.env._eid)
    if calibrate:
        bare = (bare + bare_simpy_events_per_s()) / 2  # calibrated before and after the run
    return {"turns": simulated, "topology": f"{nodes}P{nodes}D", "wall_s": round(wall, 2),
            "turns_per_s": round(simulated / wall), "cpu_turns_per_s": round(simulated / cpu),
            "events_per_turn": round(events / simulated, 1),
            "bare_events_per_s": round(bare) if calibrate else None,
            "bare_events_per_turn": round(bare / (simulated / cpu), 1) if calibrate else None,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            # what the run added at its peak (the workload held in memory, records, live state) per turn
            "kb_per_turn": round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before_kb) / simulated, 2),
            "completed": result.summary["completed"], "build": simulator_build()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--topologies", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run each size N times (fresh processes, sizes interleaved) and print the medians")
    parser.add_argument("--instructions", type=int, nargs="?", const=1000, default=None, metavar="TURNS",
                        help="count instructions under callgrind instead of timing (see the module docstring)")
    parser.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--bare-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--no-calibration", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.child:
        print(json.dumps(one(args.child[0], args.child[1], args.seed, calibrate=not args.no_calibration)))
        return
    if args.bare_child:
        bare_child(args.bare_child)
        return
    if args.instructions is not None:
        instructions(args.topologies, args.instructions, args.seed)
        return
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs; "
          f"simulator: {simulator_build()}")
    print(f"{'topology':>9} {'turns':>9} {'wall s':>8} {'turns/s':>9} {'cpu turns/s':>12} {'events/turn':>12} "
          f"{'bare ev/s':>10} {'bare ev/turn':>13} {'peak RSS MB':>12} {'KB/turn':>8}")
    runs: dict[tuple[int, int], list[dict]] = {}
    # one size after another within a round, so a slow spell of the host falls on every size alike
    for _ in range(args.repeat):
        for nodes in args.topologies:
            for turns in args.turns:
                out = subprocess.run([sys.executable, __file__, "--child", str(turns), str(nodes), "--seed",
                                      str(args.seed)], check=True, capture_output=True, text=True).stdout
                r = json.loads(out)
                runs.setdefault((nodes, turns), []).append(r)
                print(f"{r['topology']:>9} {r['turns']:>9} {r['wall_s']:>8} {r['turns_per_s']:>9} {r['cpu_turns_per_s']:>12} "
                      f"{r['events_per_turn']:>12} {r['bare_events_per_s']:>10} {r['bare_events_per_turn']:>13} "
                      f"{r['peak_rss_mb']:>12} {r['kb_per_turn']:>8}", flush=True)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} after")
    if args.repeat > 1:
        print(f"medians of {args.repeat} runs (min-max):")
        for (nodes, turns), rs in runs.items():
            cells = []
            for column in ("cpu_turns_per_s", "bare_events_per_s", "bare_events_per_turn"):
                values = sorted(r[column] for r in rs)
                cells.append(f"{column} {statistics.median(values):,.1f} ({values[0]:,}-{values[-1]:,})")
            print(f"{nodes:>3}P{nodes}D {turns:>9} turns: " + ", ".join(cells))
    print(f"the speed targets: 1P1D >= {TARGET_TURNS_PER_S[1]:,} turns/s and 64P64D >= {TARGET_TURNS_PER_S[64]:,} on a "
          f"machine running {TARGET_BARE_EVENTS_PER_S:,.0f} bare events/s, i.e. <= "
          f"{TARGET_BARE_EVENTS_PER_S / TARGET_TURNS_PER_S[1]:.1f} and <= {TARGET_BARE_EVENTS_PER_S / TARGET_TURNS_PER_S[64]:.1f} "
          f"bare ev/turn; <= 1 KB/turn")


def _callgrind(*argv: str) -> tuple[int, str]:
    """(instructions, stdout) of one run of this script under callgrind."""
    done = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__,
                           *argv], check=True, capture_output=True, text=True)
    refs = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if refs is None:
        sys.exit(f"no instruction count in valgrind's output:\n{done.stderr[-2000:]}")
    return int(refs.group(1).replace(",", "")), done.stdout


def instructions(topologies: list[int], turns: int, seed: int) -> None:
    if shutil.which("valgrind") is None:
        sys.exit("--instructions needs valgrind (Debian: apt-get install valgrind)")
    small, big = _callgrind("--bare-child", "100000")[0], _callgrind("--bare-child", "400000")[0]
    per_event = (big - small) / 300_000  # the loop schedules 100,000 and 400,000 events (+ 10 process starts)
    print(f"simulator: {simulator_build()}")
    print(f"callgrind: {per_event:,.0f} instructions per bare simpy event (the calibration loop, 100k vs 400k events)")
    print(f"{'topology':>9} {'turns':>15} {'instr/turn':>12} {'bare ev/turn (instr)':>21}")
    for nodes in topologies:
        runs = []
        for n in (turns, 4 * turns):
            count, out = _callgrind("--child", str(n), str(nodes), "--seed", str(seed), "--no-calibration")
            runs.append((count, json.loads(out)["turns"]))
        (i1, t1), (i2, t2) = runs
        per_turn = (i2 - i1) / (t2 - t1)
        print(f"{f'{nodes}P{nodes}D':>9} {f'{t1}->{t2}':>15} {per_turn:>12,.0f} {per_turn / per_event:>21.1f}", flush=True)
    print(f"the speed targets in time: <= {TARGET_BARE_EVENTS_PER_S / TARGET_TURNS_PER_S[1]:.1f} (1P1D) and <= "
          f"{TARGET_BARE_EVENTS_PER_S / TARGET_TURNS_PER_S[64]:.1f} (64P64D) bare ev/turn; instructions are not time "
          "(see the module docstring)")


if __name__ == "__main__":
    main()
