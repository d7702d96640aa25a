"""A run frees what each turn allocates by reference counting: no reference cycle per turn.

Cluster.run turns the cyclic GC off while it runs (sim.engine.cluster.without_cyclic_gc), which is safe only while
turns leave no cycles behind; a flow and its end timer once pointed at each other and kept every
turn's callbacks, records and flows alive until a full collection (351k objects per 10k turns).
"""

from __future__ import annotations

import gc

import pytest

from calibration.profile import LatencyProfile
from sim.engine.cluster import Cluster
from sim.engine.config import SimConfig
from sim.workload import load_workload


@pytest.mark.parametrize("nodes,overrides", [
    (1, {}),
    (4, {"placement": "least_loaded"}),  # transfers contend on shared NICs
    (2, {"retention": "lease"}),  # heartbeats
    (2, {"retention": "oracle"}),
    (2, {"prefix_caching": True}),
    (1, {"num_clients": 7}),  # pooled clients: one conversation after another
    (2, {"max_sim_time_s": 300.0}),  # turns cut by the clock
])
def test_a_run_leaves_no_cyclic_garbage(nodes, overrides):
    config = _config(nodes, overrides)
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


@pytest.mark.parametrize("enabled", [True, False])
def test_the_callers_collector_state_is_restored(enabled, monkeypatch):
    """The collector is off during the run (what makes it cheap), then as the caller had it, after a
    failed run too."""
    config = _config(1, {})
    workload = load_workload(config.workload, config.seed)[:20]
    seen = []
    monkeypatch.setattr(Cluster, "_sample", lambda self, *a: seen.append(gc.isenabled()))  # runs inside the loop
    (gc.enable if enabled else gc.disable)()
    try:
        Cluster(config, LatencyProfile.load(config.profile)).run(workload)
        assert seen == [False] and gc.isenabled() is enabled

        def fail(self, *a):
            raise RuntimeError("a failing callback")

        monkeypatch.setattr(Cluster, "_sample", fail)
        with pytest.raises(RuntimeError, match="a failing callback"):
            Cluster(config, LatencyProfile.load(config.profile)).run(workload)
        assert gc.isenabled() is enabled
    finally:
        gc.enable()


def _config(nodes: int, overrides: dict) -> SimConfig:
    config = SimConfig(seed=3)
    config.topology.num_prefill = config.topology.num_decode = nodes
    for name, value in overrides.items():
        setattr(config if hasattr(config, name) else config.policy, name, value)
    config.workload = {"kind": "synthetic", "num_conversations": 150, "arrival_rate_per_s": 2.0 * nodes,
                       "inter_turn_gap_s": {"kind": "exponential", "mean": 5.0}}
    return config.validate()
