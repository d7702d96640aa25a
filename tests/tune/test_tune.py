from __future__ import annotations

import json
import math

import pytest

from calibration.profile import LatencyProfile
from sim.cluster import Cluster
from sim.config import SimConfig
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
    with pytest.raises(ValueError, match="TTL"):
        build_grid(ttls_s=[-1.0])
    assert len(build_grid([0.0, math.inf], ["64"], [], [])) == 2


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
