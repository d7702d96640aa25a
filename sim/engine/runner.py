"""Run one configured simulation: workload from the config's spec and seed, profile by name, progress."""

from __future__ import annotations

import math
from typing import Callable, Sequence

from calibration.profile import LatencyProfile
from sim.engine.cluster import Cluster, SimResult
from sim.engine.config import SimConfig
from sim.engine.records import fields_of
from sim.workload import VLLM_MULTI_TURN, load_workload
from sim.workload.model import Conversation


def run_config(config: SimConfig, progress: bool = False, profile: LatencyProfile | None = None,
               conversations: Sequence[Conversation] | None = None) -> SimResult:
    """``conversations``: the workload already generated from ``config`` (the CLI describes it first)."""
    if conversations is None:
        conversations = load_workload(config.workload, config.seed)
    profile = profile or LatencyProfile.load(config.profile)
    cluster = Cluster(config, profile)
    clients = vllm_clients(config)
    if not progress:
        return cluster.run(conversations, clients=clients)
    from tqdm import tqdm

    horizon = config.max_sim_time_s
    if math.isinf(horizon):  # the bar tracks completed turns when the end time is unknown
        total = sum(len(c.turns) for c in conversations)
        bar = tqdm(total=total, unit="turn", desc="simulate", leave=False)

        def update(_now: float) -> None:
            bar.n = sum(1 for (t,) in fields_of(cluster.records, "completion_s") if not math.isnan(t))
            bar.refresh()
    else:
        bar = tqdm(total=horizon, unit="sim-s", desc="simulate", leave=False)

        def update(now: float) -> None:
            bar.n = min(now, horizon)
            bar.refresh()
    try:
        return cluster.run(conversations, progress=update, clients=clients)
    finally:
        bar.close()


def vllm_clients(config: SimConfig) -> Callable[[Cluster, Sequence[Conversation]], int] | None:
    """vLLM's benchmark client loop for a ``vllm_multi_turn`` workload (sim/clients/bench.py), else None."""
    if config.workload.get("kind") != VLLM_MULTI_TURN:
        return None
    from sim.clients import bench as bench_clients

    if config.policy.retention == "oracle":
        raise ValueError("config field policy.retention: oracle needs each next turn's arrival, which vLLM's client "
                         "loop decides during the run; use ttl, lease or gap_quantile with a vllm_multi_turn workload")
    client_config = bench_clients.config_from_workload(config.workload)
    return lambda cluster, conversations: bench_clients.start(cluster, conversations, client_config,
                                                              config.num_clients, config.seed)
