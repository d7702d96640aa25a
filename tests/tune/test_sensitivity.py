"""The tuner across client renewal behaviours: which behaviour decides, what is run how often."""

from __future__ import annotations

import json

import pytest

from impl.cli import main
from sim.engine.config import RENEWAL_BEHAVIOURS, SimConfig
from sim.tune.executor import run_points
from sim.tune.grid import REFERENCES, Candidate, build_grid
from sim.tune.sensitivity import UNSTATED, sensitivity_rows, tune_across_behaviours, worst_case


def _m(p90, recomputed, gb_s, reused=0):
    return {"ttft_p50_ms": p90, "ttft_p90_ms": p90, "ttft_p99_ms": p90, "ttft_mean_ms": p90, "tokens_recomputed": recomputed,
            "tokens_reused": reused, "retained_hbm_gb_s": gb_s, "peak_retained_hbm_gb": 1.0, "sim_time_s": 100.0,
            "rejected": 0, "preemptions": 0, "heartbeats": 0}


TTL = Candidate("ttl=60s", {"retention": "ttl", "decoder_kv_blocks_ttl": 60.0})
LEASE = Candidate("lease=30s", {"retention": "lease", "lease_s": 30.0, "heartbeat_interval_s": 10.0})
# a fake simulator, by hand: the lease is excellent when clients renew through gaps and poor when they do not
FAKE = {
    ("ttl", "*"): _m(120.0, 30, 300.0),
    ("lease", "until_next_turn"): _m(100.0, 10, 100.0),
    ("lease", "while_open"): _m(105.0, 15, 200.0),
    ("lease", "tool_calls"): _m(190.0, 90, 10.0),
    ("lease", "never"): _m(190.0, 90, 10.0),
    ("off", "*"): _m(200.0, 100, 0.0),
    ("default", "*"): _m(130.0, 20, 600.0),
    ("oracle", "*"): _m(90.0, 0, 150.0),
}


def _fake_run(calls):
    def run(configs, policies):
        out = []
        for cfg, pol in zip(configs, policies):
            kind = ("off" if pol.get("bidirectional") is False else "oracle" if pol.get("retention") == "oracle"
                    else "default" if pol.get("decoder_kv_blocks_ttl") == 480.0 else pol["retention"])
            behaviour = cfg.clients.client_renewal if kind == "lease" else "*"
            calls.append((kind, behaviour))
            out.append(FAKE[(kind, behaviour)])
        return out
    return run


def _tune(stated, calls=None):
    calls = [] if calls is None else calls
    return tune_across_behaviours(SimConfig(), [TTL, LEASE, *REFERENCES], _fake_run(calls), "ttft_p90",
                                  max_retained_hbm_pct=100.0, decode_hbm_gb=10.0, tolerance_pct=1.0, stated=stated)


def test_leases_run_once_per_behaviour_everything_else_once():
    calls = []
    _tune(None, calls)
    assert sorted(calls) == sorted([("ttl", "*"), ("off", "*"), ("default", "*"), ("oracle", "*")]
                                   + [("lease", b) for b in RENEWAL_BEHAVIOURS])


def test_stated_behaviour_decides_and_unstated_is_safe_under_never_and_while_open():
    assert _tune("until_next_turn").main.chosen.candidate.label == "lease=30s"  # 100 ms, best knowing the future
    assert _tune("never").main.chosen.candidate.label == "ttl=60s"  # 120 ms beats the lapsed lease's 190
    assert _tune("while_open").main.chosen.candidate.label == "lease=30s"  # 105 ms
    tuning = _tune(None)
    safe, ttl = tuning.main, tuning.tuned_ttl
    assert safe.behaviour == UNSTATED
    assert safe.chosen.candidate.label == "ttl=60s"  # the lease's worst case is never's 190 ms
    assert safe.point("lease=30s").metrics["ttft_p90_ms"] == 190.0 and safe.point("lease=30s").metrics["retained_hbm_gb_s"] == 200.0
    assert ttl.chosen.candidate.label == "ttl=60s"
    rows = sensitivity_rows(tuning, "ttft_p90")
    by = {r["client_renewal"]: r for r in rows}
    assert by["while_open"]["recommended_for_it"]["label"] == "lease=30s"
    assert by["while_open"]["recommendation_under_it"]["label"] == "ttl=60s"
    # % of the oracle's compute saving, by hand: (100 - 15) / (100 - 0)
    assert by["while_open"]["recommended_for_it"]["compute_saving_pct_of_oracle"] == pytest.approx(85.0)
    assert by["never"]["recommended_for_it"]["hbm_vs_default"] == pytest.approx(0.5)  # 300 / 600
    # what a lease buys: under never the best lease is still the lapsed one, worse than the TTL
    assert by["never"]["best_lease_under_it"]["ttft_p90"] == 190.0


def test_worst_case_takes_each_figure_from_the_worse_behaviour():
    worst = worst_case([_m(100.0, 50, 10.0, reused=7), _m(150.0, 20, 30.0, reused=3)], "ttft_p90_ms")
    assert (worst["ttft_p90_ms"], worst["tokens_recomputed"], worst["retained_hbm_gb_s"], worst["tokens_reused"]) == \
           (150.0, 50, 30.0, 3)


def test_on_a_real_simulation_the_safe_choice_is_feasible_under_both():
    cfg = SimConfig()
    cfg.workload = {"kind": "synthetic", "num_conversations": 12, "arrival_rate_per_s": 0.05}
    candidates = [*build_grid([0.0, 60.0, 480.0], ["64"], [30.0, 120.0], []), *REFERENCES]
    run = lambda cfgs, pols: run_points(cfgs, pols, executor="serial", progress=False)  # noqa: E731
    tuning = tune_across_behaviours(cfg, candidates, run, "ttft_p90", max_retained_hbm_pct=2.0,
                                    decode_hbm_gb=1000.0, tolerance_pct=1.0, stated=None)
    safe, per = tuning.main, tuning.per_behaviour
    label = safe.chosen.candidate.label
    for behaviour in ("never", "while_open"):
        p = per[behaviour].point(label)
        assert p.feasible and p.metrics["ttft_p90_ms"] <= safe.chosen.metrics["ttft_p90_ms"]
    # and the lease's figures differ by behaviour (each was simulated under its own clients)
    leases = {b: per[b].point("lease=30s thr=64").metrics["tokens_reused"] for b in RENEWAL_BEHAVIOURS}
    assert leases["until_next_turn"] > leases["while_open"] > leases["never"] == leases["tool_calls"]


def test_cli_states_the_behaviour_from_the_flag_or_the_toml(tmp_path, capsys):
    args = ["tune", "--json", "--executor", "serial", "--conversations", "6", "--ttls", "60", "--thresholds", "64",
            "--leases", "30", "--gap-quantiles", "", "--decode-modes", "pinned"]
    assert main([*args, "--client-renewal", "never"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["client_renewal"] == "never"
    rows = {r["client_renewal"]: r for r in out["client_renewal_sensitivity"]}
    assert set(rows) == {*RENEWAL_BEHAVIOURS, "any (no heartbeat read)"}
    assert {p["label"] for p in out["client_renewal_lease_points"]["while_open"]} == {"lease=30s thr=64"}
    assert out["recommendation"]["label"] == rows["never"]["recommended_for_it"]["label"]
    toml = tmp_path / "c.toml"
    toml.write_text("[clients]\nclient_renewal = 'tool_calls'\n")
    assert main([*args, "--config", str(toml)]) == 0
    assert json.loads(capsys.readouterr().out)["client_renewal"] == "tool_calls"
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["client_renewal"] == UNSTATED


def test_a_lease_that_ties_a_fixed_ttl_loses_the_tie():
    from sim.tune.frontier import analyse

    # what a lease of 60 s is when clients never heartbeat: the same turns as a TTL of 60 s
    lease = Candidate("lease=60s", {"retention": "lease", "lease_s": 60.0, "heartbeat_interval_s": 20.0})
    metrics = [FAKE[("ttl", "*")], FAKE[("ttl", "*")], FAKE[("off", "*")], FAKE[("default", "*")], FAKE[("oracle", "*")]]
    for order in ([lease, TTL], [TTL, lease]):
        _, chosen = analyse([*order, *REFERENCES], metrics, "ttft_p90", 100.0, 10.0, 1.0)
        assert chosen.candidate is TTL


def test_a_recommended_lease_says_which_clients_its_figures_assume(capsys):
    assert main(["tune", "--executor", "serial", "--conversations", "12", "--ttls", "", "--thresholds", "64",
                 "--leases", "30", "--gap-quantiles", "", "--client-renewal", "until_next_turn"]) == 0
    out = capsys.readouterr().out
    assert "recommended: lease=30s thr=64" in out
    assert "clients: these figures assume until_next_turn clients (they know the future" in out
    assert "client renewal sensitivity" in out and "until_next_turn (bound)" in out
