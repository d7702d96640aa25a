"""benchmarks/sim_speed.py runs as a user runs it: its table, the medians of --repeat, a bad --repeat refused."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "sim_speed.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_repeat_prints_every_run_and_the_median_of_each_size():
    done = _run("--turns", "300", "--topologies", "1", "2", "--repeat", "3")
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()
            if re.match(r"\s+\dP\dD\s+\d+\s", line) and "turns:" not in line]
    assert [row[0] for row in rows] == ["1P1D", "2P2D"] * 3  # sizes interleaved per round
    medians = [line for line in done.stdout.splitlines() if "turns: cpu_turns_per_s" in line]
    assert len(medians) == 2
    # the median printed is the middle one of the three runs' cpu turns/s for that size
    for median_line, topology in zip(medians, ("1P1D", "2P2D")):
        runs = sorted(int(row[4]) for row in rows if row[0] == topology)
        printed = float(re.search(r"cpu_turns_per_s ([\d,.]+) \(", median_line).group(1).replace(",", ""))
        assert printed == runs[1]
        assert f"({runs[0]:,}-{runs[2]:,})" in median_line


def test_repeat_below_one_is_refused_naming_the_flag():
    done = _run("--turns", "300", "--topologies", "1", "--repeat", "0")
    assert done.returncode == 2 and "--repeat must be >= 1" in done.stderr
