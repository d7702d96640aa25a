"""Run one configured simulation: workload from the config's spec and seed, profile by name, progress."""

from __future__ import annotations

import math
from typing import Sequence

from calibration.profile import LatencyProfile
from sim.cluster import Cluster, SimResult
from sim.config import SimConfig
from sim.workload import load_workload
from sim.workload.model import Conversation


def run_config(config: SimConfig, progress: bool = False, profile: LatencyProfile | None = None,
               conversations: Sequence[Conversation] | None = None) -> SimResult:
    """``conversations``: the workload already generated from ``config`` (the CLI describes it first)."""
    if conversations is None:
        conversations = load_workload(config.workload, config.seed)
    profile = profile or LatencyProfile.load(config.profile)
    cluster = Cluster(config, profile)
    if not progress:
        return cluster.run(conversations)
    from tqdm import tqdm

    horizon = config.max_sim_time_s
    if math.isinf(horizon):  # the bar tracks completed turns when the end time is unknown
        total = sum(len(c.turns) for c in conversations)
        bar = tqdm(total=total, unit="turn", desc="simulate", leave=False)

        def update(_now: float) -> None:
            bar.n = sum(1 for r in cluster.records if not math.isnan(r.completion_s))
            bar.refresh()
    else:
        bar = tqdm(total=horizon, unit="sim-s", desc="simulate", leave=False)

        def update(now: float) -> None:
            bar.n = min(now, horizon)
            bar.refresh()
    try:
        return cluster.run(conversations, progress=update)
    finally:
        bar.close()
