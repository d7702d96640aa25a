"""The CI job that explores: the invariant and policy property tests again, on examples no earlier run
tried.

The rest of the suite runs hypothesis derandomised (tests/conftest.py, profile ``ci``): the same
examples every run, so whatever it can reach it catches every time, and it never reaches anything
else. This test runs the simulator's invariants (tests/sim/test_invariants.py) and the policies'
property tests (tests/policy) once more, under profile ``random``, from a fresh seed per run: the
budget is fixed (each test's own example count, 300 for the invariants; the subprocess is bounded in
time), the examples are new. The seed is printed, and a failure says how to run exactly those
examples again; ``BIDIKV_HYPOTHESIS_SEED=N`` replays seed N here.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPLORED = ("tests/sim/test_invariants.py", "tests/policy")
TIMEOUT_S = 1200  # the run takes ~2 min on 2 cores at load 12 (the commit that added it says how measured)


def test_the_invariants_hold_on_examples_drawn_from_a_fresh_seed():
    seed = int(os.environ.get("BIDIKV_HYPOTHESIS_SEED") or random.SystemRandom().randrange(2**32))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--hypothesis-seed={seed}", *EXPLORED]
    replay = f"HYPOTHESIS_PROFILE=random python -m {' '.join(command[2:])}"
    print(f"hypothesis seed {seed}; replay: {replay}")
    env = {**os.environ, "HYPOTHESIS_PROFILE": "random"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    print(summary)
    assert done.returncode == 0, f"seed {seed} found a failing example; replay: {replay}\n{done.stdout[-6000:]}"
    assert " passed" in summary and "skipped" not in summary, summary
