"""`bidikv validate` on three runs recorded from ONE real CPU deployment (tests/e2e/record_validate.py --only on):
bidirectional ON, TTL 10 s, threshold 64, h512/l8 float32 model, 6 conversations x 4 requests each.

    on-c1   seed 7, 1 client,  think time x0.01   fit
    on-c2a  seed 9, 2 clients, think time x0.01   fit
    on-c2   seed 8, 2 clients, think time x0.03   held out (longer gaps: 5 of 18 later turns expired)

What the deployment did (offered, pulled) is in the JSONL, from the router's and P's headers: the
expected decisions below are vLLM's, not this code's. Recorded on a shared 2-core machine at load
average 14-25 (the runs' deployment.json files hold `uptime` before and after): latencies are noisy,
decisions are not.
"""

from __future__ import annotations

import pathlib

from calibration.bench_settings import settings_for
from calibration.from_bench import fit_from_runs
from calibration.profile import LatencyProfile
from calibration.validate import validate_run
from impl.bench.records import read_jsonl
from impl.cli import main

DATA = pathlib.Path(__file__).parent / "data" / "validate"
BASE = LatencyProfile.load("qwen3-32b@p5en-tp8")
FIT = [DATA / "on-c1.jsonl", DATA / "on-c2a.jsonl"]
HELD_OUT = DATA / "on-c2.jsonl"


def _fitted() -> LatencyProfile:
    profile, _ = fit_from_runs([read_jsonl(str(p)) for p in FIT], BASE, settings=settings_for(FIT[0]))
    return profile


def test_decisions_and_pulled_tokens_agree_exactly_on_the_fitted_runs():
    profile = _fitted()
    for path in FIT:
        summary, turns = validate_run(read_jsonl(str(path)), profile, settings_for(path))
        assert summary["decisions_agree"] == summary["pulled_tokens_agree"] == summary["turns"] == 24, path
        assert summary["pulled_tokens"]["real"] == summary["pulled_tokens"]["sim"]


def test_held_out_decisions_agree_but_for_one_read_the_loaded_p_made_too_late():
    summary, turns = validate_run(read_jsonl(str(HELD_OUT)), _fitted(), settings_for(HELD_OUT))
    assert summary["decision_matrix"] == {"none": {"none": 6}, "pulled": {"pulled": 12}, "expired": {"expired": 5},
                                          "declined": {"pulled": 1}}
    # The one: conversation 1, turn 2 arrived 3.7 s after turn 1 finished, inside the 5 s the 10 s TTL
    # leaves after vLLM's 5 s margin, so the router offered D's 833 tokens; P's worker logged "Declining
    # expired remote read" (its read came after the margin: TTFT 5.9 s on a machine at load 25). The
    # simulator's P reads at once and pulls: it has no model of a host that delays P by seconds.
    (odd,) = [t for t in turns if not t.decision_agrees]
    assert (odd.conversation, odd.turn, odd.sim_pulled) == ("synthetic-0001", 2, 833)
    assert summary["pulled_tokens"]["sim"] - summary["pulled_tokens"]["real"] == 833


def test_held_out_ttft_error_is_bounded_and_unbiased():
    """A regression guard, not the issue's target (15 % median): on this loaded machine the fitted
    runs themselves are fitted to 45 % median |error|. Measured held out: median 45 %, signed +10 %."""
    summary, _ = validate_run(read_jsonl(str(HELD_OUT)), _fitted(), settings_for(HELD_OUT))
    ttft = summary["overall"]["ttft"]
    assert ttft["median_abs_pct"] < 60
    assert abs(ttft["median_signed_pct"]) < 30
    # the uncalibrated profile (H200 terms) predicts this CPU rig nearly 100 % too fast: the fit is what helps
    base_summary, _ = validate_run(read_jsonl(str(HELD_OUT)), BASE, settings_for(HELD_OUT))
    assert base_summary["overall"]["ttft"]["median_abs_pct"] > 90


def test_cli_held_out_run(capsys):
    args = ["validate"] + [a for p in FIT for a in ("--fit", str(p))] + ["--bench", str(HELD_OUT)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "held out (not fitted on)" in out and "decisions agree 23/24" in out


def test_ranking_of_the_three_runs_is_reported_as_it_is():
    """Measured mean TTFT: on-c1 1.50 s < on-c2 2.21 s < on-c2a 2.94 s (on-c2a ran at load 25). The simulator puts
    on-c2 (more expiries, more recompute) last: it cannot know the machine was busier during on-c2a."""
    from calibration.validate_cli import ranking

    profile = _fitted()
    summaries = {str(p): validate_run(read_jsonl(str(p)), profile, settings_for(p))[0] for p in FIT + [HELD_OUT]}
    r = ranking(summaries)
    assert r["real"] == ["on-c1.jsonl", "on-c2.jsonl", "on-c2a.jsonl"]
    assert r["sim"] == ["on-c1.jsonl", "on-c2a.jsonl", "on-c2.jsonl"] and not r["same"]
