"""Screening (sim/tune/screen.py, narrow.py) against the full simulation, on small random workloads.

Each example simulates every configuration of a small grid in full, then tunes the same grid with
screening, and checks what screening promises: the reuse figures it gives are the simulation's,
to the token; its TTFT figures are lower bounds and its retained HBM*s lies within its bounds; no
configuration the full simulation puts on the frontier is taken off it; the recommendation is the
same; and a point simulated after screening has the figures of the full run.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calibration.profile import LatencyProfile
from sim.engine.config import SimConfig
from sim.tune.evaluate import evaluate
from sim.tune.grid import REFERENCES, build_grid
from sim.tune.narrow import EXACT_KEYS
from sim.tune.screen import TurnTable, offerable_candidates, premise_failures, screener
from sim.tune.sensitivity import tune_across_behaviours
from sim.workload.model import Conversation, Turn

PROFILE = LatencyProfile.load("qwen3-32b@p5en-tp8")
BS = PROFILE.block_size
TTLS = (0.0, 20.0, 60.0, 150.0)
THRESHOLDS = ("0", "64", "1024", "break_even")


@st.composite
def workloads(draw):
    """A few closed-loop conversations; some rewrite or drift from what D holds (partial verified prefixes)."""
    convs = []
    for c in range(draw(st.integers(1, 8))):
        turns = []
        prompt = draw(st.integers(20, 3000))
        revision = 0
        for k in range(draw(st.integers(1, 6))):
            output = draw(st.integers(1, 300))
            agreement = None
            if k:
                held = turns[-1].prompt_tokens + turns[-1].output_tokens - 1
                prompt = held + 1 + draw(st.integers(0, 400))
                change = draw(st.sampled_from(("faithful", "faithful", "drift", "rewrite")))
                if change == "drift":
                    agreement = draw(st.integers(0, held))
                elif change == "rewrite":
                    revision += 1
                    agreement = draw(st.one_of(st.none(), st.integers(0, held)))
            gap = draw(st.sampled_from((0.0, 5.0, 15.0, 54.999, 55.0, 130.0))) if draw(st.booleans()) else \
                draw(st.floats(0.0, 200.0, allow_nan=False))
            turns.append(Turn(prompt, output, gap_before_s=gap if k else 0.0, history_revision=revision,
                              reuse_agreement_tokens=agreement))
        convs.append(Conversation(f"c{c}", draw(st.floats(0.0, 60.0)), tuple(turns),
                                  shared_prefix_tokens=draw(st.sampled_from((0, 100)))))
    return convs


def _config(decode_blocks: int, nodes: int = 1) -> SimConfig:
    cfg = SimConfig()
    cfg.topology.decode_kv_blocks = decode_blocks
    cfg.topology.num_prefill = cfg.topology.num_decode = nodes
    return cfg.validate()


def _tune(cfg, convs, objective, screen, budget_pct=30.0, unscreenable=False):
    # unscreenable: also a gap quantile and the learnt hold, which the screen cannot stand for; their thresholds
    # that decide alike on every pull the workload offers share one simulation (Screener.same_simulation_key)
    extra = ((0.5,), 30.0) if unscreenable else ((), None)
    candidates = [*build_grid(TTLS, THRESHOLDS, (), extra[0], learnt_retention_budget_pct=extra[1]), *REFERENCES]

    def run(configs, overrides):
        return [evaluate(c, o, convs) for c, o in zip(configs, overrides)]

    decode_gb = cfg.topology.decode_kv_blocks * PROFILE.kv_bytes_per_token * BS / 1e9
    return candidates, tune_across_behaviours(cfg, candidates, run, objective, budget_pct, decode_gb, 1.0, "never",
                                              screen, batch=2)


@settings(max_examples=80)
@given(convs=workloads(), objective=st.sampled_from(("ttft_p90", "ttft_p50", "compute")),
       tight=st.sampled_from((False, False, True)), budget_pct=st.sampled_from((0.001, 0.01, 0.1, 30.0)),
       nodes=st.sampled_from((1, 1, 2)), unscreenable=st.booleans())
def test_screening_keeps_the_frontier_and_its_exact_figures(convs, objective, tight, budget_pct, nodes, unscreenable):
    # tight: D holds little more than the largest conversation, so retention competes with running turns
    largest = max(-(-(t.prompt_tokens + t.output_tokens) // BS) for c in convs for t in c.turns)
    cfg = _config(largest + 2 if tight else 100_000, nodes)
    screen, reasons = screener(cfg, convs, PROFILE, cfg.topology.decode_kv_blocks)
    assert reasons == []
    candidates, full = _tune(cfg, convs, objective, None, budget_pct, unscreenable)
    _, screened = _tune(cfg, convs, objective, screen, budget_pct, unscreenable)
    narrowing = screened.narrowing
    full_by = {p.candidate.label: p for p in full.main.points}
    by = {p.candidate.label: p for p in screened.main.points}
    # never off the frontier where the full simulation has it on
    assert {l for l, p in full_by.items() if p.on_frontier} <= {l for l, p in by.items() if p.on_frontier}
    # the same recommendation
    assert (full.main.chosen and full.main.chosen.candidate.label) == (screened.main.chosen and
                                                                      screened.main.chosen.candidate.label)
    fallback = any("every point was simulated" in n for n in narrowing.notes)
    for label, p in by.items():
        m, truth = p.metrics, full_by[label].metrics
        if not p.screened:
            assert m == truth, label  # simulated after screening (or a twin of one): the full run's figures
            continue
        assert not fallback
        for key in EXACT_KEYS:
            assert m[key] == truth[key], (label, key)
        assert m["reuse_hit_rate"] == pytest.approx(truth["reuse_hit_rate"], abs=1e-12, nan_ok=True)
        for key in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "ttft_mean_ms"):
            assert m[key] <= truth[key] * (1 + 1e-9), (label, key)
        lo, hi = m["bounds"]["retained_hbm_gb_s"]
        assert lo * (1 - 1e-9) <= truth["retained_hbm_gb_s"] <= hi * (1 + 1e-9), label


def test_one_pass_matches_the_simulation_across_the_ttl_curve():
    """The default workload, no pressure: every TTL's reuse figures from the one pass, to the token."""
    cfg = SimConfig().validate()
    cfg.workload = {"kind": "synthetic", "num_conversations": 40, "arrival_rate_per_s": 0.05}
    from sim.workload import load_workload

    convs = load_workload(cfg.workload, cfg.seed)
    screen, reasons = screener(cfg, convs, PROFILE, PROFILE.decode_blocks())
    assert reasons == []
    for candidate in build_grid((0.0, 30.0, 120.0, 480.0, 3600.0), ("64", "break_even"), (), ()):
        figures = screen(candidate)
        truth = evaluate(cfg, candidate.policy)
        assert {k: figures[k] for k in EXACT_KEYS} == {k: truth[k] for k in EXACT_KEYS}, candidate.label
        lo, hi = figures["retained_hbm_gb_s_bounds"]
        assert lo <= truth["retained_hbm_gb_s"] <= hi
        # the estimate sits within 1 % of the simulation on a lightly loaded cluster
        assert figures["retained_hbm_gb_s_estimate"] == pytest.approx(truth["retained_hbm_gb_s"], rel=0.01)
        assert figures["ttft_lower_bound_ms"]["p90"] <= truth["ttft_p90_ms"]


def test_premises_name_what_makes_hits_depend_on_timing():
    convs = [Conversation("c", 0.0, (Turn(100, 10), Turn(200, 10, gap_before_s=5.0, arrival_s=30.0)))]
    cfg = SimConfig().validate()
    cfg.policy.prefix_caching = True
    cfg.max_sim_time_s = 100.0
    reasons = premise_failures(cfg, convs, 1, BS)
    assert any("arrival" in r for r in reasons) and any("prefix cache" in r for r in reasons)
    assert any("max_sim_time_s" in r for r in reasons) and any("capacity" in r for r in reasons)
    assert screener(cfg, convs, PROFILE, 1)[0] is None


@settings(max_examples=40)
@given(convs=workloads(), prefix_caching=st.booleans())
def test_compute_bound_holds_for_every_configuration(convs, prefix_caching):
    """No configuration that completes every turn recomputes fewer tokens than the bound, the oracle included."""
    cfg = _config(100_000)
    cfg.policy.prefix_caching = prefix_caching
    bound = TurnTable(cfg, convs, PROFILE).compute_bound_tokens()
    lease_cfg = dataclasses.replace(cfg, clients=dataclasses.replace(cfg.clients, client_renewal="until_next_turn"))
    runs = [(cfg, c.policy) for c in REFERENCES] + [
        (cfg, {"retention": "ttl", "decoder_kv_blocks_ttl": 1e6, "recompute_policy": "fixed", "kv_recompute_threshold": 0}),
        (lease_cfg, {"retention": "lease", "lease_s": 30.0, "heartbeat_interval_s": 10.0, "kv_recompute_threshold": 0})]
    for c, policy in runs:
        m = evaluate(c, policy, convs)
        assert m["rejected"] or m["tokens_recomputed"] >= bound, policy
    # and it is reached: the longest TTL pulling everything verified recomputes exactly the bound
    if not prefix_caching:
        assert evaluate(*runs[3], convs)["tokens_recomputed"] == bound


def test_compute_bound_is_every_turn_reusing_all_it_verified():
    # turn 1 continues turn 0 faithfully (D holds 1000 + 50 - 1 = 1049 tokens, all verified): 1049 reused
    convs = [Conversation("c", 0.0, (Turn(1000, 50), Turn(1200, 50, gap_before_s=10.0)))]
    table = TurnTable(SimConfig().validate(), convs, PROFILE)
    assert table.compute_bound_tokens() == 1000 + (1200 - 1049)


def test_tied_gap_is_left_to_the_simulation():
    convs = [Conversation("c", 0.0, (Turn(1000, 50), Turn(1200, 50, gap_before_s=55.0)))]
    cfg = SimConfig().validate()
    screen, _ = screener(cfg, convs, PROFILE, PROFILE.decode_blocks())
    ttl60 = build_grid((60.0, 61.0), ("64",), (), (), decode_modes=("pinned",))
    assert screen(ttl60[0]) is None  # 55 s gap + 5 s margin = 60 s: only the simulation's clock can tell
    assert screen(ttl60[1])["tokens_reused"] == 1049


def test_a_screened_candidate_with_a_twin_takes_its_simulation(monkeypatch):
    cfg = SimConfig().validate()
    convs = [Conversation("c", 0.0, (Turn(3000, 50), Turn(3200, 50, gap_before_s=10.0)))]
    screen, _ = screener(cfg, convs, PROFILE, PROFILE.decode_blocks())
    a, b = build_grid((60.0,), ("0", "64"), (), (), decode_modes=("pinned",))
    # 3049 verified tokens: thresholds 0 and 64 pull the same, so they are one simulation
    assert screen(a)["same_simulation_key"] == screen(b)["same_simulation_key"]
    calls = []

    def run(configs, overrides):
        calls.extend(overrides)
        return [evaluate(c, o, convs) for c, o in zip(configs, overrides)]

    tuning = tune_across_behaviours(cfg, [a, b, *REFERENCES], run, "ttft_p90", 100.0, 1e6, 1.0, "never", screen, batch=2)
    assert len(calls) == 4  # three references and one of the twins
    by = {p.candidate.label: p for p in tuning.main.points}
    assert by[a.label].metrics == by[b.label].metrics and not by[a.label].screened
    assert dataclasses.asdict(tuning.main.points[0].candidate) == dataclasses.asdict(a)


def test_cli_screen_flag_reports_what_it_screened_and_recommends_as_without(capsys):
    import json

    from impl.cli import main

    base = ["tune", "--json", "--executor", "serial", "--no-progress", "--conversations", "25", "--ttls", "0,60,480,900",
            "--thresholds", "64,break_even", "--leases", "", "--gap-quantiles", "", "--decode-modes", "pinned"]
    assert main(base) == 0
    full = json.loads(capsys.readouterr().out)
    assert main([*base, "--screen"]) == 0
    screened = json.loads(capsys.readouterr().out)
    s = screened["screening"]
    assert s["requested"] and s["screened"] > 0 and s["screened"] + s["simulated_after_screening"] == 8
    # every screened configuration is marked (a row stands for itself and the configurations collapsed into it)
    assert s["screened"] == sum(1 + len(row["same_results_as"]) for row in screened["points"] if row["screened"])
    assert screened["recommendation"]["label"] == full["recommendation"]["label"]
    assert full["screening"]["requested"] is False
    # the bound: no configuration saves more compute than it
    assert all(row["compute_saving_pct_of_bound"] <= 100.0 + 1e-9 for row in full["points"])


def test_offerable_candidates_include_holds_older_than_the_previous_turn():
    """The router offers the last retained turn's blocks: when turn 1 was not retained, turn 2 meets turn 0's."""
    turns = (Turn(100, 11), Turn(300, 21, gap_before_s=1.0), Turn(700, 5, gap_before_s=1.0))
    offered = {(c.prompt_tokens, c.remote_num_tokens) for c in offerable_candidates([Conversation("c", 0.0, turns)], BS)}
    assert offered == {(300, 110), (700, 110), (700, 320)}


def test_thresholds_deciding_alike_everywhere_share_a_simulation_and_others_do_not():
    """Learnt holds at thresholds 0 and 64 on a workload whose every offer is 64 tokens or more: one key, and the
    two full simulations agree figure for figure; a threshold above some offer gets its own key."""
    cfg = SimConfig().validate()
    cfg.workload = {"kind": "synthetic", "num_conversations": 30, "arrival_rate_per_s": 0.05}
    from sim.workload import load_workload

    convs = load_workload(cfg.workload, cfg.seed)
    screen, reasons = screener(cfg, convs, PROFILE, PROFILE.decode_blocks())
    assert reasons == []
    offers = [c.reusable_tokens for c in offerable_candidates(convs, BS) if c.reusable_tokens > 0]
    assert min(offers) >= 64
    learnt = {"retention": "learnt", "learnt_retention_budget_pct": 30.0, "recompute_policy": "fixed"}
    points = [{**learnt, "kv_recompute_threshold": t} for t in (0, 64, max(offers))]
    keys = [screen.same_simulation_key(cfg, p) for p in points]
    assert keys[0] == keys[1] != keys[2]
    assert evaluate(cfg, points[0], convs) == evaluate(cfg, points[1], convs)
