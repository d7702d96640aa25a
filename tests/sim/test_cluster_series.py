"""The cluster's per-node series: sampled from time 0 every ``series_interval_s`` while any client is live."""

from __future__ import annotations

from sim.engine.cluster import simulate
from sim.engine.config import SimConfig
from sim.workload import load_workload


def test_the_series_has_one_row_per_decode_node_every_interval_until_the_last_client_leaves():
    config = SimConfig(seed=3)
    config.topology.num_prefill = config.topology.num_decode = 2
    config.workload = {"kind": "synthetic", "num_conversations": 12, "arrival_rate_per_s": 0.5,
                       "inter_turn_gap_s": {"kind": "exponential", "mean": 20.0}}
    config.validate()
    result = simulate(config, load_workload(config.workload, config.seed))
    last_client_left = max(r.completion_s for r in result.records)
    interval = config.series_interval_s
    times = [k * interval for k in range(int(last_client_left // interval) + 1)]
    assert len(times) > 3  # the run spans several intervals
    assert [(row[0], row[1]) for row in result.series] == [(t, d) for t in times for d in ("d0", "d1")]
