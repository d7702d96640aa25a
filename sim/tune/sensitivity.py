"""The tuner across client renewal behaviours: recommend for the behaviour the user states, and show
how the recommendation moves when clients renew otherwise.

A lease keeps KV only as long as clients heartbeat (:mod:`sim.clients.renewal`), while a fixed or learnt TTL
reads no heartbeat. So each lease candidate is simulated once per behaviour, and every other
candidate (with the references: OFF, vLLM's default, the oracle) once, shared by all behaviours; the
"% of the oracle's saving" denominators are therefore the same in every row.

Without a stated behaviour the recommendation must be safe whether clients renew while the session is
open or never renew: each candidate is judged on the worse of the two for every figure (slower TTFT,
more recomputation, more retained HBM, fewer reused tokens), which for a TTL is simply its value.
The clairvoyant ``until_next_turn`` is shown as an upper bound and never decides the safe choice.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from sim.engine.config import RENEWAL_BEHAVIOURS, SimConfig
from sim.tune.evaluate import pinned_twin, run_with_twins, twin_key
from sim.tune.frontier import OBJECTIVES, Point, analyse
from sim.tune.grid import VLLM_TTL_S, Candidate

SAFE_UNDER = ("never", "while_open")
UNSTATED = "unstated"
# figures where more is worse (taken as the max across behaviours) and where less is worse (the min)
_MORE_IS_WORSE = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "ttft_mean_ms", "tokens_recomputed",
                  "retained_hbm_gb_s", "peak_retained_hbm_gb", "preemptions", "rejected", "dropped_under_pressure",
                  "heartbeats")
_LESS_IS_WORSE = ("tokens_reused", "reuse_hit_rate", "sim_time_s")  # a shorter run spreads retained GB*s over less time


@dataclass
class Outcome:
    """One analysis of the whole grid: per behaviour, the safe worst case, or fixed TTLs only."""

    behaviour: str
    points: list[Point]
    chosen: Point | None

    def point(self, label: str) -> Point | None:
        return next((p for p in self.points if p.candidate.label == label), None)


@dataclass
class Tuning:
    main: Outcome  # the recommendation: for the stated behaviour, or the safe worst case
    per_behaviour: dict[str, Outcome]
    tuned_ttl: Outcome  # fixed TTLs only: what a lease has to beat (reads no heartbeat)
    best_lease: dict[str, Outcome]  # leases only, per behaviour
    narrowing: Any = None  # sim.tune.narrow.Narrowing when screening ran: which jobs were simulated


def depends_on_clients(candidate: Candidate) -> bool:
    return candidate.policy.get("retention") == "lease"


def stated_renewal(args: Any) -> str | None:
    """The behaviour the user stated with --client-renewal or [clients] client_renewal, else None."""
    flag = getattr(args, "cfg__clients__client_renewal", None)
    if flag is not None:
        return flag
    if getattr(args, "config", None):
        with open(args.config, "rb") as fh:
            value = tomllib.load(fh).get("clients", {}).get("client_renewal")
        return value if isinstance(value, str) else None
    return None


def worst_case(metrics: Sequence[dict[str, Any]], objective_key: str) -> dict[str, Any]:
    """Per figure, the worse value across behaviours (curves kept from the behaviour worse on the objective)."""
    out = dict(max(metrics, key=lambda m: m[objective_key]))
    for key in _MORE_IS_WORSE:
        if key in out:
            out[key] = max(m[key] for m in metrics)
    for key in _LESS_IS_WORSE:
        if key in out:
            values = [m[key] for m in metrics if not (isinstance(m[key], float) and math.isnan(m[key]))]
            out[key] = min(values) if values else math.nan
    return out


def sweep_jobs(config: SimConfig, candidates: Sequence[Candidate]) -> tuple[list[SimConfig], list[dict[str, Any]],
                                                                            list[dict[str, int]]]:
    """Every simulation the grid can need, as (configs, overrides, per candidate: behaviour or '*' -> job):
    each lease once per client behaviour, every other candidate once."""
    configs: list[SimConfig] = []
    overrides: list[dict[str, Any]] = []
    index: list[dict[str, int]] = []
    for c in candidates:
        jobs = {}
        for behaviour in (RENEWAL_BEHAVIOURS if depends_on_clients(c) else ("*",)):
            cfg = config if behaviour == "*" else dataclasses.replace(
                config, clients=dataclasses.replace(config.clients, client_renewal=behaviour))
            jobs[behaviour] = len(configs)
            configs.append(cfg)
            overrides.append(c.policy)
        index.append(jobs)
    return configs, overrides, index


def surely_simulated(config: SimConfig, candidates: Sequence[Candidate], screening: bool) -> list[int]:
    """The jobs of :func:`sweep_jobs` simulated whatever a screen finds, in job order: all of them
    without screening; with it, all but the sweep's points the screen can stand for (sim/tune/screen.py
    ``screenable``), which the screen must see first, and but those differing from an earlier one only in
    their recompute policy (the screen may find them the same simulation: :func:`same_runs`). The tuner
    starts these before it screens."""
    from sim.tune.screen import RECOMPUTE_SETTINGS, screenable

    configs, overrides, index = sweep_jobs(config, candidates)
    twins = pinned_twin_jobs(configs, overrides)  # simulated only if their pinned twin comes near the limit
    sure = sorted(j for c, jobs in zip(candidates, index) for j in jobs.values()
                  if (not screening or c.kind != "sweep" or depends_on_clients(c)
                      or not screenable(dataclasses.replace(config.policy, **c.policy))) and j not in twins)
    if not screening:
        return sure
    seen: set[str] = set()
    out = []
    for j in sure:
        rest = repr(configs[j]) + repr(sorted((k, v) for k, v in overrides[j].items() if k not in RECOMPUTE_SETTINGS))
        if rest not in seen:
            seen.add(rest)
            out.append(j)
    return out


def pinned_twin_jobs(configs: Sequence[SimConfig], overrides: Sequence[dict[str, Any]]) -> dict[int, int]:
    """give_back job -> the job of its pinned twin (sim/tune/evaluate.py ``pinned_twin``), where there is one."""
    by_key = {twin_key(c, o): j for j, (c, o) in enumerate(zip(configs, overrides))}
    out = {}
    for j, (c, o) in enumerate(zip(configs, overrides)):
        twin = pinned_twin(o)
        if twin is not None and twin_key(c, twin) in by_key:
            out[j] = by_key[twin_key(c, twin)]
    return out


def tune_across_behaviours(config: SimConfig, candidates: Sequence[Candidate],
                           run: Callable[[list[SimConfig], list[dict[str, Any]]], list[dict[str, Any]]],
                           objective: str, max_retained_hbm_pct: float, decode_hbm_gb: float, tolerance_pct: float,
                           stated: str | None, screen: Callable[[Candidate], dict[str, Any] | None] | None = None,
                           batch: int = 1, compute_bound_tokens: float | None = None,
                           submit: Callable[[list[SimConfig], list[dict[str, Any]]], list[Future]] | None = None) -> Tuning:
    """Simulate the grid (leases once per behaviour) and analyse it per behaviour, safe, TTL-only, lease-only.

    ``run`` simulates points and returns their figures; ``submit``, if given, starts them and returns
    futures (sim/tune/executor.py Runs), so screening keeps ``batch`` simulations running at once.
    ``screen``: a candidate's screened figures (sim/tune/screen.py) or None; screened candidates are
    simulated only where the recommendation could be them (sim/tune/narrow.py)."""
    configs, overrides, index = sweep_jobs(config, candidates)
    if submit is None:
        submit = lambda cfgs, ovs: [_done(m) for m in run(cfgs, ovs)]  # noqa: E731
    if screen is None:
        results = run_with_twins(configs, overrides, run)
        narrowing = None
    else:
        narrowing = _narrowed(candidates, index, configs, overrides, submit, screen, objective,
                              max_retained_hbm_pct / 100.0 * decode_hbm_gb, tolerance_pct, batch)
        results = narrowing.results

    def metrics_for(behaviour: str) -> list[dict[str, Any]]:
        return [results[jobs.get(behaviour, jobs.get("*", -1))] for jobs in index]

    analysed = {}
    for behaviour in RENEWAL_BEHAVIOURS:
        points, chosen = analyse(candidates, metrics_for(behaviour), objective, max_retained_hbm_pct, decode_hbm_gb,
                                 tolerance_pct, compute_bound_tokens=compute_bound_tokens)
        analysed[behaviour] = Outcome(behaviour, points, chosen)
    if stated is not None:
        main = analysed[stated]
    else:
        key = OBJECTIVES[objective]
        worst = [worst_case(group, key) for group in zip(*(metrics_for(b) for b in SAFE_UNDER))]
        points, chosen = analyse(candidates, worst, objective, max_retained_hbm_pct, decode_hbm_gb, tolerance_pct,
                                 compute_bound_tokens=compute_bound_tokens)
        main = Outcome(UNSTATED, points, chosen)
    def subset(keep: Callable[[Candidate], bool], behaviour: str) -> Outcome:
        # the references stay in (analyse measures every point against them) but are not a choice
        points_, best = analyse(candidates, metrics_for(behaviour), objective, max_retained_hbm_pct, decode_hbm_gb,
                                tolerance_pct, eligible=lambda c: c.kind == "sweep" and keep(c),
                                compute_bound_tokens=compute_bound_tokens)
        return Outcome(behaviour, points_, best)

    tuned_ttl = subset(lambda c: c.policy.get("retention") == "ttl", "never")
    best_lease = {b: subset(depends_on_clients, b) for b in RENEWAL_BEHAVIOURS}
    return Tuning(main, analysed, tuned_ttl, best_lease, narrowing)


def _narrowed(candidates: Sequence[Candidate], index: list[dict[str, int]], configs: list[SimConfig],
              overrides: list[dict[str, Any]],
              submit: Callable[[list[SimConfig], list[dict[str, Any]]], list[Future]],
              screen: Callable[[Candidate], dict[str, Any] | None], objective: str, budget_gb: float,
              tolerance_pct: float, batch: int) -> Any:
    """Simulate what the screen cannot stand for, then what the recommendation could be."""
    from sim.tune.narrow import narrow

    screened: dict[int, dict[str, Any]] = {}
    references: dict[int, dict[str, Any]] = {}  # always simulated; their screen figures check the screen
    counts: set[int] = set()
    for c, jobs in zip(candidates, index):
        if c.kind in ("sweep", "default") and not depends_on_clients(c):
            counts.update(jobs.values())
            figures = screen(c)
            if figures is not None:
                (screened if c.kind == "sweep" else references)[jobs["*"]] = figures
    pending = [j for j in range(len(configs)) if j not in screened]
    return narrow(screened, pending, len(configs), counts.__contains__,
                  lambda jobs: submit([configs[j] for j in jobs], [overrides[j] for j in jobs]),
                  objective, budget_gb, tolerance_pct, batch, references, pinned_twin_jobs(configs, overrides),
                  same_runs(pending, configs, overrides, screen))


def same_runs(jobs: Sequence[int], configs: Sequence[SimConfig], overrides: Sequence[dict[str, Any]],
              screen: Any) -> dict[int, int]:
    """job -> the first of ``jobs`` that runs the same simulation, for points differing only in recompute
    policies that decide alike wherever the workload lets them decide (sim/tune/screen.py)."""
    key_of = getattr(screen, "same_simulation_key", None)
    if key_of is None:
        return {}
    first: dict[Any, int] = {}
    out = {}
    for j in jobs:
        key = key_of(configs[j], overrides[j])
        if key is None:
            continue
        if key in first:
            out[j] = first[key]
        else:
            first[key] = j
    return out


def _done(metrics: dict[str, Any]) -> Future:
    future: Future = Future()
    future.set_result(metrics)
    return future


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def sensitivity_rows(tuning: Tuning, objective: str) -> list[dict[str, Any]]:
    key = OBJECTIVES[objective]
    main = tuning.main
    label = main.chosen.candidate.label if main.chosen else None

    def figures(p: Point | None) -> dict[str, Any]:
        if p is None:
            return {}
        return {"label": p.candidate.label, objective: p.metrics[key], "compute_saving_pct_of_oracle":
                p.compute_saving_pct_of_oracle, "ttft_saving_pct_of_oracle": p.ttft_saving_pct_of_oracle,
                "compute_saving_pct_of_bound": p.compute_saving_pct_of_bound,
                "hbm_vs_default": p.hbm_vs_default, "feasible": p.feasible, "heartbeats": p.metrics.get("heartbeats", 0)}

    rows = []
    for behaviour in RENEWAL_BEHAVIOURS:
        o = tuning.per_behaviour[behaviour]
        rows.append({"client_renewal": behaviour, "recommended_for_it": figures(o.chosen),
                     "best_lease_under_it": figures(tuning.best_lease[behaviour].chosen),
                     "recommendation_under_it": figures(o.point(label)) if label else {}})
    rows.append({"client_renewal": "any (no heartbeat read)", "recommended_for_it": figures(tuning.tuned_ttl.chosen),
                 "best_lease_under_it": {}, "recommendation_under_it": {}, "note": "best fixed TTL"})
    return rows


def lease_points(tuning: Tuning) -> dict[str, list[dict[str, Any]]]:
    """Every lease candidate's figures under each behaviour (the sensitivity rows show only the chosen)."""
    out = {}
    for behaviour, outcome in tuning.per_behaviour.items():
        out[behaviour] = [{"label": p.candidate.label, **{k: p.metrics[k] for k in (*OBJECTIVES.values(), "heartbeats",
                                                                                    "retained_hbm_gb_s")},
                           "compute_saving_pct_of_oracle": p.compute_saving_pct_of_oracle,
                           "ttft_saving_pct_of_oracle": p.ttft_saving_pct_of_oracle,
                           "compute_saving_pct_of_bound": p.compute_saving_pct_of_bound, "hbm_vs_default": p.hbm_vs_default,
                           "mean_retained_hbm_gb": p.mean_retained_hbm_gb, "feasible": p.feasible}
                          for p in outcome.points if depends_on_clients(p.candidate)]
    return out


def sensitivity_table(rows: Sequence[dict[str, Any]], main: Outcome, objective: str) -> str:
    label = main.chosen.candidate.label if main.chosen else "none"
    who = ("for the stated client behaviour" if main.behaviour != UNSTATED
           else "safe under never and while_open: the worse of the two per figure")
    figs = f"{objective:>9}{'comp%':>7}{'TTFT%':>7}{'bnd%':>6}{f'vs {VLLM_TTL_S:g}s':>8}"

    def cells(f: dict[str, Any], width: int) -> str:
        if not f:
            return f"{'-':<{width}}{'':>37}"
        return (f"{f['label']:<{width}}{_f(f.get(objective), ',.0f'):>9}{_f(f['compute_saving_pct_of_oracle'], '.1f'):>7}"
                f"{_f(f['ttft_saving_pct_of_oracle'], '.1f'):>7}{_f(f.get('compute_saving_pct_of_bound'), '.1f'):>6}"
                f"{_f(f['hbm_vs_default'], '.2f'):>8}"
                + ("" if f.get("feasible", True) else "!"))

    lines = [f"client renewal sensitivity (recommended: {label}, {who}; --client-renewal states a behaviour)",
             f"{'client renewal':<24}{'recommended for it':<24}{figs} | {'best lease for it':<24}{figs}"
             f" | {'the recommendation, under it':>28}{figs}"]
    for row in rows:
        name = row["client_renewal"] + (" (bound)" if row["client_renewal"] == "until_next_turn" else "")
        under = row["recommendation_under_it"]
        lines.append(f"{name:<24}{cells(row['recommended_for_it'], 24)} | {cells(row['best_lease_under_it'], 24)}"
                     + (f" | {'':>28}{cells(under, 0)[len(under.get('label', '')):]}" if under else ""))
    lines.append("(comp% / TTFT%: share of the oracle's compute / mean-TTFT saving over bidirectional OFF -- the "
                 "oracle is a clairvoyant reference, not a bound; bnd%: share of the most compute any configuration "
                 f"can save, a true bound; vs {VLLM_TTL_S:g}s: retained HBM*s relative to vLLM's default; ! over the HBM budget; "
                 "'-' none within budget; until_next_turn knows the future: no client renews better)")
    return "\n".join(lines)
