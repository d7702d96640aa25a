"""The learnt retention in the simulator: the router's estimator decides each turn's hold, D applies it."""

from __future__ import annotations

import dataclasses
import json

from sim.engine.config import SimConfig
from sim.engine.runner import run_config


def _run(**policy):
    cfg = SimConfig(workload={"kind": "synthetic", "num_conversations": 120})
    cfg = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, retention="learnt", **policy))
    cfg.topology.decode_kv_blocks = 20_000
    return run_config(cfg.validate())


def test_same_config_and_seed_give_identical_output():
    a, b = _run(), _run()
    assert json.dumps(a.summary, sort_keys=True, default=str) == json.dumps(b.summary, sort_keys=True, default=str)
    assert a.summary["learnt_retention"]["holds_learnt"] > 0


def test_a_smaller_budget_keeps_less_and_reuses_less_and_every_turn_completes():
    small, large = _run(learnt_retention_budget_pct=2.0), _run(learnt_retention_budget_pct=100.0)
    for result in (small, large):
        assert result.summary["completed"] == result.summary["turns"]
    assert small.summary["retained_hbm_gb_s"] < large.summary["retained_hbm_gb_s"]
    assert small.summary["tokens_recomputed"] > large.summary["tokens_recomputed"]
    assert small.summary["learnt_retention"]["price_per_block_s"] > large.summary["learnt_retention"]["price_per_block_s"]


def test_learnt_under_give_back_completes_every_turn():
    result = _run(retained_under_pressure="give_back", learnt_retention_budget_pct=1000.0)
    assert result.summary["completed"] == result.summary["turns"]
