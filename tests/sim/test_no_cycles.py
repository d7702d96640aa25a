"""A run frees what each turn allocates by reference counting: no reference cycle per turn.

Cluster.run lets the cyclic GC look at little (sim.cluster._young_garbage_only), which is safe only while
turns leave no cycles behind; a flow and its end timer once pointed at each other and kept every
turn's callbacks, records and flows alive until a full collection (351k objects per 10k turns).
"""

from __future__ import annotations

import gc

import pytest

from calibration.profile import LatencyProfile
from sim.cluster import Cluster
from sim.config import SimConfig
from sim.workload import load_workload


@pytest.mark.parametrize("nodes,overrides", [
    (1, {}),
    (4, {"placement": "least_loaded"}),  # transfers contend on shared NICs
    (2, {"retention": "lease"}),  # heartbeats
    (2, {"retention": "oracle"}),
])
def test_a_run_leaves_no_cyclic_garbage(nodes, overrides):
    config = SimConfig(seed=3)
    config.topology.num_prefill = config.topology.num_decode = nodes
    for name, value in overrides.items():
        setattr(config.policy, name, value)
    config.workload = {"kind": "synthetic", "num_conversations": 150, "arrival_rate_per_s": 2.0 * nodes,
                       "inter_turn_gap_s": {"kind": "exponential", "mean": 5.0}}
    config.validate()
    workload = load_workload(config.workload, config.seed)
    cluster = Cluster(config, LatencyProfile.load(config.profile))
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        result = cluster.run(workload)
        gc.collect()
        garbage = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    turns = result.summary["turns"]
    assert turns > 500
    kinds = sorted({type(o).__name__ for o in garbage})
    assert not garbage, f"{len(garbage)} objects in cycles after {turns} turns: {kinds[:12]}"
