"""Where 64P64D's time per turn goes beyond 1P1D's: more nodes, or more conversations live at once.

Run: python benchmarks/sim_cost_split.py [--turns 50000]

sim_speed.py's workload scales the arrival rate with the topology (0.25 conversations/s per node pair) and
gives 30 s think times, so 64P64D differs from 1P1D in two ways at once: 64x the nodes, and ~64x the
conversations in flight (whose state is cold by the time a turn comes back to it). Each row changes one:

* ``1P1D``, ``64P64D``: sim_speed.py's workloads;
* ``64P64D at 1P1D's rate``: 64 nodes, 1P1D's arrivals (what the nodes alone cost: placement, upkeep);
* ``64P64D, 0.5 s think``: 64P64D's arrivals with think times 60x shorter (fewer conversations live).

Then LeastLoaded's index on its own: every ``update_load`` and ``pick`` of a 64P64D run is recorded
(the sources' build, whose router calls the index through a module global a subclass can stand in for),
and replayed against fresh indexes in a loop: its cost per turn with everything else taken away.
Each row is a fresh process (its own caches and heap); CPU seconds, so the host's other load counts less.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROWS = (("1P1D", 1, 1, 30.0), ("64P64D", 64, 64, 30.0), ("64P64D at 1P1D's rate", 64, 1, 30.0),
        ("64P64D, 0.5 s think", 64, 64, 0.5))


def _run(turns: int, nodes: int, rate_nodes: int, think_s: float, record: str | None) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sim_speed

    log: list = []
    if record:
        import sim.engine.router
        from impl.policy.placement import InstanceLoad, LeastLoadedIndex

        class Recording(LeastLoadedIndex):
            def __init__(self, instances: list[InstanceLoad]) -> None:
                log.append(("new", id(self), [(i.name, i.total_blocks) for i in instances]))
                super().__init__(instances)

            def update_load(self, name: str, **loads: int) -> None:  # type: ignore[override]
                log.append(("update", id(self), name, loads))
                super().update_load(name, **loads)

            def pick(self, rng: random.Random) -> str | None:
                log.append(("pick", id(self)))
                return super().pick(rng)

        sim.engine.router.LeastLoadedIndex = Recording  # type: ignore[misc]
    # sim_speed.py's workload (0.25 conversations/s per node pair) with this row's rate and think time
    result = sim_speed.one(turns, nodes, 0, calibrate=False, arrival_rate_per_s=0.25 * rate_nodes,
                           think_mean_s=think_s)
    if record:
        with open(record, "wb") as fh:
            pickle.dump(log, fh)
    return result


def _replay(path: str, turns: int, repeat: int = 5) -> tuple[float, float, float]:
    """CPU seconds per simulated turn of the recorded index calls (best of ``repeat``), and the updates
    and picks per turn."""
    from impl.policy.placement import InstanceLoad, LeastLoadedIndex

    with open(path, "rb") as fh:
        log = pickle.load(fh)
    best = float("inf")
    for _ in range(repeat):
        indexes, calls = {}, []
        for entry in log:
            if entry[0] == "new":
                indexes[entry[1]] = LeastLoadedIndex([InstanceLoad(n, total_blocks=t) for n, t in entry[2]])
            elif entry[0] == "update":
                calls.append((indexes[entry[1]].update_load, entry[2], entry[3]))
            else:
                calls.append((indexes[entry[1]].pick, None, None))
        rng = random.Random(0)
        start = time.process_time()
        for call, name, loads in calls:
            if name is None:
                call(rng)
            else:
                call(name, **loads)
        best = min(best, time.process_time() - start)
    picks = sum(entry[0] == "pick" for entry in log)
    updates = sum(entry[0] == "update" for entry in log)
    return best / turns, updates / turns, picks / turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=50_000, help="conversations x ~8 turns per row")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.turns < 8:
        parser.error(f"--turns must be >= 8, got {args.turns}")
    if args.child:
        row = json.loads(args.child)
        print(json.dumps(_run(args.turns, *row)))
        return
    print(f"load average {os.getloadavg()[0]:.2f}; {args.turns} turns per row")
    with tempfile.TemporaryDirectory() as tmp:
        def child(nodes: int, rate_nodes: int, think_s: float, record: str | None = None,
                  env: dict | None = None) -> dict:
            out = subprocess.run([sys.executable, __file__, "--turns", str(args.turns), "--child",
                                  json.dumps([nodes, rate_nodes, think_s, record])],
                                 check=True, capture_output=True, text=True, cwd=ROOT, env=env)
            return json.loads(out.stdout.splitlines()[-1])

        for label, nodes, rate_nodes, think_s in ROWS:
            r = child(nodes, rate_nodes, think_s)
            print(f"{label:>24}  {r['cpu_turns_per_s']:>7,} cpu turns/s  {1e6 / r['cpu_turns_per_s']:6.1f} us/turn  "
                  f"{r['events_per_turn']:4.1f} events/turn  ({r['build']})")
        log = str(Path(tmp) / "placement.pickle")
        r = child(64, 64, 30.0, log, env={**os.environ, "BIDIKV_PURE_SIM": "1"})
        per_turn, updates, picks = _replay(log, r["turns"])
        print(f"{'LeastLoaded index alone':>24}  {per_turn * 1e6:6.2f} us/turn (64P64D's {updates:.2f} update_load "
              f"and {picks:.2f} pick calls per turn, replayed)")
    print(f"load average {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
