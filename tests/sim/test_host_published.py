"""llm-d's published GLM-5.2-FP8 host-tier pull vs recompute, through the simulator (sim.replay.host_published),
with the profile ``bidikv profile`` builds: every point within 15 % but the report's non-monotone one,
the crossover and the first pull of a new pair within 15 %."""

from __future__ import annotations

import json

import pytest

from calibration.profile import LatencyProfile

from calibration.host_tier import PUBLISHED, host_tier_cost, pull_turn_ttft_s, recompute_turn_ttft_s
from sim.replay.host_published import compare, glm_profile, main

TOLERANCE = 0.15
# 2.51 s at 34,214 tokens sits between 1.80 s (21,617) and 1.98 s (48,109): single rep, no pull model
# that grows with the bytes reaches it (the simulator gives ~1.96 s). Said in docs/design/simulator.md.
OUTLIER = 34_214


@pytest.fixture(scope="module")
def table():
    return compare()


def test_the_profile_is_what_bidikv_profile_prints(capsys):
    from impl.cli import main as bidikv

    assert bidikv(["profile", "--model-config", "calibration/data/config_glm-5-fp8.json", "--hardware", "p5en",
                   "--tp", "8"]) == 0
    printed = LatencyProfile.from_dict(json.loads(capsys.readouterr().out))
    assert printed == glm_profile()  # every term (the provenance's config path aside)


def test_recompute_and_pull_are_within_15_percent_of_the_publication(table):
    assert [r["prefix_tokens"] for r in table["rows"]] == [p for p, _, _ in PUBLISHED]
    outside = []
    for r in table["rows"]:
        assert abs(r["recompute_s"] / r["published_recompute_s"] - 1) <= TOLERANCE, r  # not fitted: predicted
        if abs(r["pull_s"] / r["published_pull_s"] - 1) > TOLERANCE:
            outside.append(r["prefix_tokens"])
    assert outside == [OUTLIER]


def test_the_pull_is_flat_and_recompute_grows(table):
    rows = table["rows"]
    pulls = [r["pull_s"] for r in rows]
    assert max(pulls) / min(pulls) < 1.4  # published: 2.29 / 1.69 = 1.36
    assert rows[-1]["recompute_s"] / rows[0]["recompute_s"] > 10  # published: 13.75 / 1.00


def test_the_crossover_and_the_first_pull_are_within_15_percent(table):
    assert table["tie_tokens"] == pytest.approx(table["published_tie_tokens"], rel=TOLERANCE)
    assert table["first_pull_s"] == pytest.approx(table["published_first_pull_s"], rel=TOLERANCE)


def test_the_simulator_assembles_the_turn_as_the_fit_does(table):
    """The fit subtracts what the simulator charges around the pull; the runs must agree with that sum."""
    profile = glm_profile()
    cost = host_tier_cost(profile, "glm-5.2-wide-ep")
    for r in table["rows"]:
        assert r["pull_s"] == pytest.approx(pull_turn_ttft_s(profile, cost, r["prefix_tokens"]), rel=1e-3)
        assert r["recompute_s"] == pytest.approx(recompute_turn_ttft_s(profile, r["prefix_tokens"]), rel=1e-3)


def test_the_command_prints_the_table(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "crossover: published 13,648 tokens, simulated" in out and out.count(" s ") >= 7
