from __future__ import annotations

import json
import math

import pytest

from calibration.profile import LatencyProfile
from sim.engine.cluster import Cluster
from sim.engine.config import SimConfig
from sim.tune.executor import run_points
from sim.tune.frontier import analyse
from sim.tune.grid import REFERENCES, Candidate, build_grid
from sim.tune.report import vllm_settings
from sim.workload.model import Conversation, Turn

PROFILE = LatencyProfile.load("qwen3-32b@p5en-tp8")


def _convs():
    # c0 continues after 100 s, c1 after 1000 s, c2 ends after one turn
    return [
        Conversation("c0", 0.0, (Turn(3000, 200), Turn(3400, 200, gap_before_s=100.0)), 0),
        Conversation("c1", 0.0, (Turn(3000, 200), Turn(3400, 200, gap_before_s=1000.0)), 0),
        Conversation("c2", 0.0, (Turn(3000, 200),), 0),
    ]


def _run(**policy):
    cfg = SimConfig()
    for k, v in policy.items():
        setattr(cfg.policy, k, v)
    return Cluster(cfg.validate(), PROFILE).run(_convs())


def test_oracle_reuses_every_continuing_turn_and_retains_only_until_reuse():
    oracle = _run(retention="oracle", recompute_policy="break_even")
    later = [r for r in oracle.records if r.turn == 1]
    assert all(r.reused_tokens > 0 for r in later)
    # retained exactly over the two gaps (100 s and 1000 s: until the read begins) and nothing for c2
    blocks = -(-(3000 + 200 - 1) // PROFILE.block_size)
    gb_per_block = PROFILE.kv_bytes_per_token * PROFILE.block_size / 1e9
    assert oracle.summary["retained_hbm_gb_s"] == pytest.approx(blocks * gb_per_block * (100 + 1000), rel=1e-6)
    # a fixed TTL covering both gaps reuses as much and retains more (it also pins c2 and overshoots)
    ttl = _run(retention="ttl", decoder_kv_blocks_ttl=1100.0)
    assert ttl.summary["tokens_recomputed"] == oracle.summary["tokens_recomputed"]
    assert ttl.summary["retained_hbm_gb_s"] > oracle.summary["retained_hbm_gb_s"]


def _metrics(ttft_p90, recomputed, gb_s, ttft_mean=None, rejected=0):
    return {"ttft_p50_ms": ttft_p90, "ttft_p90_ms": ttft_p90, "ttft_p99_ms": ttft_p90, "ttft_mean_ms": ttft_mean or ttft_p90,
            "tokens_recomputed": recomputed, "retained_hbm_gb_s": gb_s, "sim_time_s": 100.0, "rejected": rejected}


def test_frontier_and_recommendation_rule():
    cands = [Candidate("a"), Candidate("b"), Candidate("c"), Candidate("d"), *REFERENCES]
    metrics = [
        _metrics(100.0, 10, 500.0),   # best TTFT, costly
        _metrics(100.5, 10, 200.0),   # within 1 % of the best and cheaper: recommended
        _metrics(150.0, 50, 100.0),   # on the frontier (cheapest), but slower
        _metrics(160.0, 60, 300.0),   # dominated by b
        _metrics(200.0, 100, 0.0),    # OFF
        _metrics(110.0, 20, 400.0),   # vLLM default
        _metrics(90.0, 0, 150.0),     # oracle
    ]
    points, chosen = analyse(cands, metrics, "ttft_p90", max_retained_hbm_pct=100.0, decode_hbm_gb=10.0, tolerance_pct=1.0)
    by = {p.candidate.label: p for p in points}
    assert chosen.candidate.label == "b"
    assert {l for l, p in by.items() if p.on_frontier} == {"a", "b", "c"}
    assert by["b"].compute_saving_pct_of_oracle == pytest.approx(90.0)  # (100-10)/(100-0)
    assert by["b"].hbm_vs_default == pytest.approx(0.5)
    # a budget of 2.5 GB mean (250 GB*s over 100 s) rules out a and the default
    points, chosen = analyse(cands, metrics, "ttft_p90", max_retained_hbm_pct=25.0, decode_hbm_gb=10.0, tolerance_pct=1.0)
    assert chosen.candidate.label == "b" and not {p.candidate.label: p for p in points}["a"].feasible
    points, chosen = analyse(cands, metrics, "ttft_p90", max_retained_hbm_pct=0.5, decode_hbm_gb=10.0, tolerance_pct=1.0)
    assert chosen is None


def test_grid_validation():
    with pytest.raises(ValueError, match="threshold"):
        build_grid(thresholds=["sixty"])
    with pytest.raises(ValueError, match="--ttls: -1.0 must be a finite number"):
        build_grid(ttls_s=[-1.0])
    with pytest.raises(ValueError, match="--ttls: inf must be a finite number"):
        build_grid(ttls_s=[math.inf])  # vLLM's decoder_kv_blocks_ttl takes no infinity: never recommend one
    grid = build_grid([0.0, 3600.0], ["64"], [], [])
    assert [c.label for c in grid] == ["ttl=0s thr=64", "ttl=0s thr=64 give_back", "ttl=3600s thr=64",
                                       "ttl=3600s thr=64 give_back"]
    assert [c.policy["retained_under_pressure"] for c in grid] == ["pinned", "give_back"] * 2
    with pytest.raises(ValueError, match="--decode-modes: 'drop' must be one of pinned, give_back"):
        build_grid(decode_modes=["drop"])


def test_vllm_settings_are_valid_json_for_vllm_and_ours():
    plain = vllm_settings(analyse_one({"retention": "ttl", "decoder_kv_blocks_ttl": 120.0, "kv_recompute_threshold": 256}))
    assert "kv_connector_module_path" not in plain["decode_kv_transfer_config"]
    assert plain["decode_kv_transfer_config"]["kv_connector_extra_config"]["decoder_kv_blocks_ttl"] == 120.0
    assert plain["prefill_kv_transfer_config"]["kv_connector_extra_config"]["kv_recompute_threshold"] == 256
    assert plain["prefill_kv_transfer_config"]["kv_load_failure_policy"] == "recompute"
    lease = vllm_settings(analyse_one({"retention": "lease", "lease_s": 30.0, "heartbeat_interval_s": 10.0}))
    assert lease["decode_kv_transfer_config"]["kv_connector_module_path"] == "impl.connector"
    # a lease without D's heartbeat listener would be a fixed TTL: the recommendation turns it on
    assert lease["decode_kv_transfer_config"]["kv_connector_extra_config"]["bidikv_heartbeat_port"] > 0
    assert "/v1/conversations/{id}/heartbeat" in lease["caveat"] and "every 10 s" in lease["caveat"]
    assert "bidikv_heartbeat_port" not in plain["decode_kv_transfer_config"]["kv_connector_extra_config"]
    json.dumps(lease)


def analyse_one(policy):
    from sim.tune.frontier import Point

    return Point(Candidate("x", policy), {})


def test_process_pool_gives_the_serial_results():
    cfg = SimConfig()
    cfg.workload = {"kind": "synthetic", "num_conversations": 6}
    overrides = [{"decoder_kv_blocks_ttl": 60.0}, {"retention": "lease"}, {"bidirectional": False}]
    serial = run_points(cfg, overrides, executor="serial", progress=False)
    pooled = run_points(cfg, overrides, executor="process", workers=2, progress=False)
    assert serial == pooled


def test_ray_executor_gives_the_same_results_on_a_local_cluster():
    import ray  # the 'ray' extra is part of the test setup (tools/test.sh): missing it is a failure, not a skip
    cfg = SimConfig()
    cfg.workload = {"kind": "synthetic", "num_conversations": 4}
    overrides = [{"decoder_kv_blocks_ttl": 30.0}, {"retention": "gap_quantile"}]
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        assert run_points(cfg, overrides, executor="ray", progress=False) == run_points(cfg, overrides, executor="serial", progress=False)
    finally:
        ray.shutdown()


def test_recommended_settings_use_keys_the_connector_accepts():
    from impl.connector.config import ConnectorSettings

    for policy in ({"retention": "ttl", "decoder_kv_blocks_ttl": 120.0, "kv_recompute_threshold": 256},
                   {"retention": "lease", "lease_s": 30.0, "heartbeat_interval_s": 10.0},
                   {"retention": "gap_quantile", "gap_quantile": 0.9, "recompute_policy": "break_even"}):
        s = vllm_settings(analyse_one(policy), "qwen3-32b@p5en-tp8")
        for side in ("prefill_kv_transfer_config", "decode_kv_transfer_config"):
            ConnectorSettings.from_extra_config(s[side]["kv_connector_extra_config"])  # raises, naming the key, on drift


def test_identical_results_collapse_to_one_row_named_by_vllms_default_threshold():
    from sim.tune.report import as_json, collapse, table

    cands = [Candidate("ttl=60s thr=0", {"retention": "ttl", "kv_recompute_threshold": 0}),
             Candidate("ttl=60s thr=64", {"retention": "ttl", "kv_recompute_threshold": 64}),
             Candidate("ttl=60s thr=1024", {"retention": "ttl", "kv_recompute_threshold": 1024}),
             Candidate("ttl=90s thr=0", {"retention": "ttl", "kv_recompute_threshold": 0}), *REFERENCES]
    same = _metrics(100.0, 10, 200.0)
    metrics = [same, dict(same), _metrics(120.0, 30, 200.0), _metrics(100.0, 10, 300.0),
               _metrics(200.0, 100, 0.0), _metrics(110.0, 20, 400.0), _metrics(90.0, 0, 150.0)]
    for m in metrics:
        m.update(peak_retained_hbm_gb=1.0, preemptions=0, tokens_reused=0)
    points, chosen = analyse(cands, metrics, "ttft_p90", max_retained_hbm_pct=100.0, decode_hbm_gb=10.0, tolerance_pct=1.0)
    # thr=0 and thr=64 tie on every figure: the recommendation is vLLM's default, not the first label
    assert chosen.candidate.label == "ttl=60s thr=64"
    rows = collapse(points, chosen)
    assert [(r.candidate.label, [m.candidate.label for m in ms]) for r, ms in rows[:3]] == [
        ("ttl=60s thr=64", ["ttl=60s thr=0", "ttl=60s thr=64"]), ("ttl=60s thr=1024", ["ttl=60s thr=1024"]),
        ("ttl=90s thr=0", ["ttl=90s thr=0"])]
    text = table(points, chosen, "ttft_p90")
    assert "ttl=60s thr=64 (= thr 0)" in text and text.count("ttl=60s") == 2
    out = as_json(points, chosen, "ttft_p90")
    assert [p["label"] for p in out["points"]].count("ttl=60s thr=0") == 0
    assert out["points"][0]["same_results_as"] == ["ttl=60s thr=0"]


def _tune(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "impl.cli", "tune", "--no-progress", *args], capture_output=True,
                          text=True, timeout=300)


def test_tune_json_is_strict_states_the_workload_and_recommends_a_finite_ttl(tmp_path):
    run = _tune("--conversations", "10", "--ttls", "0,120,3600", "--thresholds", "0,64", "--leases", "",
                "--gap-quantiles", "", "--workers", "1", "--json", "--num-prefill", "2", "--num-decode", "3")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout, parse_constant=lambda name: pytest.fail(f"{name} in tune --json"))
    assert out["workload"]["conversations"] == 10 and "Poisson stream at 0.05/s" in out["workload"]["description"]
    rec = out["recommendation"]
    ttl = rec["decode_kv_transfer_config"]["kv_connector_extra_config"].get("decoder_kv_blocks_ttl")
    assert ttl is None or isinstance(ttl, (int, float))
    assert rec["router_argv"].count("--prefill") == 1 and sum(a.startswith("http://P") for a in rec["router_argv"]) == 2
    assert sum(a.startswith("http://D") for a in rec["router_argv"]) == 3
    labels = [p["label"] for p in out["points"]]
    assert len(labels) == len(set(labels))
    for p in out["points"]:  # a collapsed label is gone from the list but named by its representative
        for other in p["same_results_as"]:
            assert other not in labels


@pytest.mark.parametrize("args, says", [
    (["--workers", "0"], "--workers must be >= 1"),
    (["--max-retained-hbm-pct", "-3"], "--max-retained-hbm-pct must be in (0, 100]"),
    (["--max-retained-hbm-pct", "nan"], "argument --max-retained-hbm-pct: invalid number value"),
    (["--tolerance-pct", "inf"], "--tolerance-pct must be a finite number >= 0"),
    (["--decode-hbm-gb", "0"], "--decode-hbm-gb must be a finite number > 0"),
    (["--ttls", "inf"], "--ttls: inf must be a finite number"),
    (["--ttls", "60,abc"], "--ttls: 'abc' is not a number"),
    (["--leases", "-5"], "--leases: -5.0 must be a finite number of seconds > 0"),
    (["--gap-quantiles", "1.5"], "--gap-quantiles: 1.5 must be in (0, 1]"),
    (["--thresholds", "-1"], "--thresholds: threshold '-1' must be >= 0"),
    (["--lease-s", "-1"], "config field policy.lease_s must be finite and > 0"),
    (["--conversations", "0"], "--conversations must be >= 1"),
])
def test_tune_rejects_bad_numbers_in_one_line_before_simulating(args, says):
    run = _tune(*args)
    assert run.returncode == 2, run.stdout[-500:]
    assert says in run.stderr and len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr, run.stderr


def test_tune_plots_dir_that_cannot_be_made_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    run = _tune("--plots", str(blocker / "sub"))
    assert run.returncode == 2 and run.stderr.startswith("bidikv tune: error: --plots") and "Traceback" not in run.stderr
