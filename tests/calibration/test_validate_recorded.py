"""`bidikv validate` on eight runs recorded from four real CPU deployments (tests/e2e/record_validate.py):
h512/l8 float32 model, P without prefix caching, 8 conversations x 4 requests per run, P pinned to core 0
and D to core 1, recorded at nice -15 on a 2-core machine other work shared (load 2.5-4.3; each
run's deployment.json holds `uptime` before and after).

    run       deployment                seed  clients  think time   role
    on-c1     ON, threshold 64, TTL 10  7     1        x0.01        fit
    on-c2a    ON, threshold 64, TTL 10  9     2        x0.01        fit
    on-c2     ON, threshold 64, TTL 10  8     2        x0.03        held out: longer gaps, 7 turns expire
    on-c3     ON, threshold 64, TTL 10  10    3        x0.01        held out: another concurrency
    t512-c2   ON, threshold 512, TTL 10 8     2        x0.03        held out: another threshold
    ttl30-c2  ON, threshold 64, TTL 30  8     2        x0.03        held out: a TTL no gap outlives
    off-c2    OFF                       8     2        x0.03        held out: bidirectional OFF
    off-c1    OFF                       7     1        x0.01        held out: OFF, one client
    press-c2  ON, threshold 64, TTL 60, 8     2        x0.03        held out: D's memory binds (95 usable
              a 96-block D pool                                   blocks, pinned retention)

What each deployment did (offered, pulled) is in the JSONL, from the router's and P's headers: the
decisions the simulator must match are vLLM's, not this code's. The latency bounds asserted are the
replay's targets (TTFT median |error| <= 15 %, p90 <= 30 %), met by every held-out run.

The OFF runs were recorded after the notify fix (84c2eb6): before it the router held an OFF conversation's
next turn for the rest of its 2 s notify wait, 0.5-1.8 s on 16 of 32 turns, and OFF's mean TTFT was
under-predicted by 35-61 % -- this replay is how that was found.
"""

from __future__ import annotations

import functools
import pathlib

import pytest

from calibration.bench_settings import settings_for
from calibration.from_bench import fit_from_runs
from calibration.profile import LatencyProfile
from sim.replay.validate import validate_run
from sim.commands.validate import ranking
from calibration.bench_records import read_jsonl
from impl.cli import main

DATA = pathlib.Path(__file__).parent / "data" / "validate"
BASE = LatencyProfile.load("qwen3-32b@p5en-tp8")
FIT = ["on-c1", "on-c2a"]
HELD_OUT_ON = ["on-c2", "on-c3", "t512-c2", "ttl30-c2"]
HELD_OUT_OFF = ["off-c2", "off-c1"]
SAME_WORKLOAD = ["on-c2", "t512-c2", "ttl30-c2", "off-c2"]  # seed 8, 2 clients, x0.03: four configurations


def _path(name: str) -> pathlib.Path:
    return DATA / f"{name}.jsonl"


@functools.lru_cache(maxsize=None)
def _fitted() -> LatencyProfile:
    profile, _ = fit_from_runs([read_jsonl(str(_path(n))) for n in FIT], BASE, settings=settings_for(_path(FIT[0])))
    return profile


@functools.lru_cache(maxsize=None)
def _summary(name: str, profile_name: str = "fitted") -> dict:
    profile = _fitted() if profile_name == "fitted" else BASE
    summary, _ = validate_run(read_jsonl(str(_path(name))), profile, settings_for(_path(name)))
    return summary


@pytest.mark.parametrize("name", FIT + HELD_OUT_ON + HELD_OUT_OFF)
def test_every_decision_and_every_pulled_token_agrees(name):
    s = _summary(name)
    assert s["turns"] == 32
    assert s["decisions_agree"] == s["pulled_tokens_agree"] == 32, s["decision_matrix"]
    assert s["pulled_tokens"]["real"] == s["pulled_tokens"]["sim"]


def test_the_held_out_runs_exercise_every_decision_the_deployment_made():
    # what vLLM did in them (router and P headers): pulls, turns whose D blocks had expired, OFF recomputes
    matrix = {name: _summary(name)["decision_matrix"] for name in HELD_OUT_ON + HELD_OUT_OFF}
    assert matrix["on-c2"] == {"none": {"none": 8}, "pulled": {"pulled": 17}, "expired": {"expired": 7}}
    assert matrix["ttl30-c2"] == {"none": {"none": 8}, "pulled": {"pulled": 24}}  # the same turns, none expired
    assert matrix["off-c2"] == matrix["off-c1"] == {"none": {"none": 32}}


@pytest.mark.parametrize("name", HELD_OUT_ON + HELD_OUT_OFF)
def test_held_out_runs_meet_the_latency_targets(name):
    ttft, tpot = _summary(name)["overall"]["ttft"], _summary(name)["overall"]["tpot"]
    assert ttft["median_abs_pct"] <= 15 and ttft["p90_abs_pct"] <= 30, ttft
    assert tpot["median_abs_pct"] <= 15 and tpot["p90_abs_pct"] <= 30, tpot


def test_the_uncalibrated_profile_does_not():
    """The same replay with the H200 profile the fit started from misses the targets on every held-out run
    (measured: TTFT p90 63-75 %, median 13-48 %): the fit is what makes them."""
    for name in HELD_OUT_ON:
        ttft = _summary(name, "base")["overall"]["ttft"]
        assert ttft["p90_abs_pct"] > 30, (name, ttft)


def test_the_simulator_ranks_four_configurations_of_one_workload_as_the_deployment_did():
    order = ranking({str(_path(n)): _summary(n) for n in SAME_WORKLOAD})
    assert order["same"], order
    assert order["real"] == ["ttl30-c2.jsonl", "on-c2.jsonl", "t512-c2.jsonl", "off-c2.jsonl"]


def test_cli_held_out_run(capsys):
    args = ["validate"] + [a for n in FIT for a in ("--fit", str(_path(n)))] + ["--bench", str(_path("on-c2"))]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "held out (not fitted on)" in out and "decisions agree 32/32" in out


# press-c2: on-c2's workload (seed 8, 2 clients, x0.03) on a D whose memory binds: a 96-block pool (95 usable)
# and a 60 s TTL, pinned as vLLM pins (recorded 2026-12-05 00:20 UTC, load 0.6-1.6, P core 0, D core 1, nice
# -15, D empty when it started). Five turns waited 45-60 s for D's blocks behind retained turns.
def test_under_d_memory_pressure_every_decision_and_pulled_token_still_agrees():
    s = _summary("press-c2")
    assert s["turns"] == 24
    assert s["decisions_agree"] == s["pulled_tokens_agree"] == 24, s["decision_matrix"]
    assert s["decision_matrix"] == {"none": {"none": 6}, "pulled": {"pulled": 18}}


def test_under_d_memory_pressure_the_replay_meets_the_latency_targets_waits_included():
    """The waits are most of the latency here: the turns that waited (real TTFT > 30 s) must each be
    predicted within 10 %, and the run as a whole within the targets of the other held-out runs."""
    summary, turns = validate_run(read_jsonl(str(_path("press-c2"))), _fitted(), settings_for(_path("press-c2")))
    ttft = summary["overall"]["ttft"]
    assert ttft["median_abs_pct"] <= 15 and ttft["p90_abs_pct"] <= 30, ttft
    waited = [t for t in turns if t.real_ttft_s > 30.0]
    assert len(waited) >= 3, [t.real_ttft_s for t in turns]
    for t in waited:
        assert abs(t.sim_ttft_s / t.real_ttft_s - 1) <= 0.10, t
