"""From sweep results to a frontier and a recommendation, each point measured against the oracle.

Savings are relative to bidirectional OFF: compute saving = prompt tokens recomputed with OFF minus
with the configuration; TTFT saving = mean TTFT with OFF minus with the configuration. Each is
expressed as a percentage of the oracle's saving. The oracle (sim/engine/oracle.py) is clairvoyant retention with
time-optimal pulls, a reference and not an upper bound: more than 100 % means a configuration saved more
than it on that metric (sim/engine/oracle.py says exactly what it optimises and why it can be beaten). The
compute saving is also given as a percentage of a true bound, ``compute_bound_tokens``: the prompt
tokens recomputed if every turn reused the most P could (sim/tune/screen.py), which no configuration
that completes every turn can beat. No such bound is given for TTFT (queueing is not bounded per turn).

Screened points (sim/tune/narrow.py: not simulated, ``metrics["screened"]``) carry ``bounds`` (lower,
upper) for their inexact figures; a point is off the frontier only if another is better for certain
(upper bounds against lower bounds), so screening never takes a point off the frontier the full
simulation would put on it; a screened point is never recommended (the narrowing simulated every point
that could be).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from impl.policy import catalogue
from sim.tune.grid import Candidate

VLLM_DEFAULT_THRESHOLD = str(catalogue.default("kv_recompute_threshold"))  # vLLM's, as a candidate names it
OBJECTIVES = {"ttft_p50": "ttft_p50_ms", "ttft_p90": "ttft_p90_ms", "ttft_p99": "ttft_p99_ms",
              "compute": "tokens_recomputed"}


@dataclass
class Point:
    candidate: Candidate
    metrics: dict[str, Any]
    compute_saving_pct_of_oracle: float = math.nan
    compute_saving_pct_of_bound: float = math.nan  # of the true bound: every turn reuses the most it can
    ttft_saving_pct_of_oracle: float = math.nan
    hbm_vs_default: float = math.nan
    mean_retained_hbm_gb: float = 0.0
    on_frontier: bool = False
    feasible: bool = True
    screened: bool = False  # figures from the screen, not a simulation (TTFT: lower bounds)


def _lo(p: Point, key: str) -> float:
    bounds = p.metrics.get("bounds", {}).get(key)
    return bounds[0] if bounds else p.metrics[key]


def _hi(p: Point, key: str) -> float:
    bounds = p.metrics.get("bounds", {}).get(key)
    return bounds[1] if bounds else p.metrics[key]


def _dominates(q: Point, p: Point, key: str) -> bool:
    """q is at least as good as p on the objective and retained HBM*s for certain, and better on one."""
    r = "retained_hbm_gb_s"
    return (_hi(q, key) <= _lo(p, key) and _hi(q, r) <= _lo(p, r)) and (_hi(q, key) < _lo(p, key) or _hi(q, r) < _lo(p, r))


def _pct(value: float, oracle: float) -> float:
    return value / oracle * 100.0 if oracle > 0 else math.nan


def analyse(candidates: Sequence[Candidate], metrics: Sequence[dict[str, Any]], objective: str,
            max_retained_hbm_pct: float, decode_hbm_gb: float, tolerance_pct: float,
            eligible: Callable[[Candidate], bool] | None = None,
            compute_bound_tokens: float | None = None) -> tuple[list[Point], Point | None]:
    """Points measured against the references; the recommendation among ``eligible`` simulated sweep points
    (all by default). ``compute_bound_tokens``: the fewest prompt tokens any configuration recomputes."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {sorted(OBJECTIVES)}, got {objective!r}")
    points = [Point(c, m, screened=bool(m.get("screened"))) for c, m in zip(candidates, metrics)]
    by_kind = {p.candidate.kind: p for p in points if p.candidate.kind != "sweep"}
    off, oracle, default = by_kind["baseline_off"], by_kind["oracle"], by_kind["default"]
    oracle_compute = off.metrics["tokens_recomputed"] - oracle.metrics["tokens_recomputed"]
    oracle_ttft = off.metrics["ttft_mean_ms"] - oracle.metrics["ttft_mean_ms"]
    budget_gb = max_retained_hbm_pct / 100.0 * decode_hbm_gb
    for p in points:
        m = p.metrics
        p.compute_saving_pct_of_oracle = _pct(off.metrics["tokens_recomputed"] - m["tokens_recomputed"], oracle_compute)
        if compute_bound_tokens is not None:
            p.compute_saving_pct_of_bound = _pct(off.metrics["tokens_recomputed"] - m["tokens_recomputed"],
                                                 off.metrics["tokens_recomputed"] - compute_bound_tokens)
        p.ttft_saving_pct_of_oracle = _pct(off.metrics["ttft_mean_ms"] - m["ttft_mean_ms"], oracle_ttft)
        p.hbm_vs_default = (m["retained_hbm_gb_s"] / default.metrics["retained_hbm_gb_s"]
                            if default.metrics["retained_hbm_gb_s"] > 0 else math.nan)
        p.mean_retained_hbm_gb = m["retained_hbm_gb_s"] / m["sim_time_s"] if m["sim_time_s"] > 0 else 0.0
        # (a screened point's HBM*s is the screen's estimate: its feasibility is for the table, never a choice)
        p.feasible = p.mean_retained_hbm_gb <= budget_gb and m["rejected"] == 0
    key = OBJECTIVES[objective]
    sweep = [p for p in points if p.candidate.kind in ("sweep", "default")]
    # Pareto over (objective, retained GB*s): nobody else is at least as good on both and better on one
    for p in sweep:
        p.on_frontier = not any(_dominates(q, p, key) for q in sweep)
    feasible = [p for p in sweep if p.feasible and not p.screened and (eligible is None or eligible(p.candidate))]
    if not feasible:
        return points, None
    best = min(p.metrics[key] for p in feasible)
    # within tolerance of the best objective, the one that pins the least HBM; on a tie vLLM's default
    # threshold (what a user already runs), then the simpler label
    near = [p for p in feasible if p.metrics[key] <= best * (1 + tolerance_pct / 100.0) + 1e-9]
    # (a lease ties a fixed TTL of its length when clients do not heartbeat: then the TTL, which needs
    # neither our connector nor heartbeating clients)
    chosen = min(near, key=lambda p: (p.metrics["retained_hbm_gb_s"], p.metrics[key],
                                      p.candidate.policy.get("retention") == "lease",
                                      p.candidate.threshold != VLLM_DEFAULT_THRESHOLD, p.candidate.label))
    return points, chosen
