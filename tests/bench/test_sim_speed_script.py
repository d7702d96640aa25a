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


COST_SPLIT = SCRIPT.parent / "sim_cost_split.py"


def test_cost_split_prints_each_row_and_the_index_replayed():
    done = subprocess.run([sys.executable, str(COST_SPLIT), "--turns", "400"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    rows = {m.group(1).strip(): m for m in re.finditer(
        r"^\s*(.+?)\s+([\d,]+) cpu turns/s\s+([\d.]+) us/turn\s+([\d.]+) events/turn", done.stdout, re.M)}
    assert list(rows) == ["1P1D", "64P64D", "64P64D at 1P1D's rate", "64P64D, 0.5 s think"], done.stdout
    for m in rows.values():
        assert int(m.group(2).replace(",", "")) > 0
        assert abs(1e6 / int(m.group(2).replace(",", "")) - float(m.group(3))) < 0.1  # us/turn is its inverse
    index = re.search(r"LeastLoaded index alone\s+([\d.]+) us/turn \(64P64D's ([\d.]+) update_load and ([\d.]+) pick",
                      done.stdout)
    assert index and float(index.group(1)) > 0, done.stdout
    assert float(index.group(3)) == 2.0  # every turn picks a P and a D, and the run finished every turn
    assert float(index.group(2)) > 0


def test_cost_split_refuses_too_few_turns():
    done = subprocess.run([sys.executable, str(COST_SPLIT), "--turns", "7"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "--turns must be >= 8" in done.stderr
