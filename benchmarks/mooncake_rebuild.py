"""How Mooncake session rebuilding scales: wall time of ``load_trace`` on N two-turn sessions.

A speed goal, so it lives here and not in the unit tests (tests/workload/test_mooncake.py checks the
same shape rebuilds correctly at 10,000 sessions). Rebuilding goes through a trie of full-block
prefixes, so time should grow about linearly: doubling N should about double it, where pairwise
matching would quadruple it (10,000 sessions: 2 x 10^8 prefix checks).

Run: python benchmarks/mooncake_rebuild.py [--sessions 10000 20000 40000]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path


def trace(path: Path, sessions: int) -> None:
    """N sessions of two requests each; the second continues the first's full blocks (as in the unit test)."""
    rows = []
    for s in range(sessions):
        rows.append({"timestamp": s, "input_length": 512 * 3, "output_length": 10, "hash_ids": [0, 3 * s + 1, 3 * s + 2]})
    for s in range(sessions):
        rows.append({"timestamp": 2 * sessions + s, "input_length": 512 * 4 - 100, "output_length": 10,
                     "hash_ids": [0, 3 * s + 1, 3 * s + 2, 3 * s + 3]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    from sim.workload.mooncake import load_trace

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, nargs="+", default=[10_000, 20_000, 40_000])
    args = parser.parse_args()
    previous = None
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sessions:
            path = Path(tmp) / f"trace-{n}.jsonl"
            trace(path, n)
            started = time.perf_counter()
            conversations = load_trace(path, random.Random(0))
            wall = time.perf_counter() - started
            assert len(conversations) == n
            growth = f"  x{wall / previous[1]:.2f} for x{n / previous[0]:.1f} sessions" if previous else ""
            print(f"{n:>8} sessions: {wall:6.2f} s{growth}")
            previous = (n, wall)


if __name__ == "__main__":
    main()
