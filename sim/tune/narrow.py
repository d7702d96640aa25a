"""Which screened points still need a full simulation: branch and bound on the recommendation.

The screen (sim/tune/screen.py) gives a fixed-TTL point's reuse figures exactly and bounds the rest:
TTFT from below, retained HBM*s between two bounds. A screened point is simulated in full when the
recommendation could be it: its objective's lower bound is within the tolerance of the best objective
simulated so far (among fixed TTLs, gap quantiles and vLLM's default: leases, which could only lower
that best, are left out, so this simulates at least as much as needed), and it may fit the HBM budget.
"May fit" is the one judgement not made on a bound: the lower bound of retained HBM*s counts nothing
for a conversation's last blocks (only the simulation knows where the run ends), far too loose to rule
anything out, so the screen's estimate is used, less a slack: twice the largest relative error the
estimate showed on the points simulated so far (vLLM's default and the probe at least), and never less
than ``MIN_HBM_SLACK``. Points are simulated best-bound first, the next as soon as a worker frees,
until none is left open; every other point keeps its screened figures, marked ``screened``, and is
never recommended. A point with the same TTL and the same pulls on every turn as a simulated one (vLLM's
default included) takes its figures: the same simulation, event for event.

The probe: the screened point holding blocks longest is always simulated, since it retains the most.
Every simulated point checks the screen: it must show no memory pressure on D (the premise that makes
screened hits exact), and a simulated fixed-TTL point's reuse figures must equal the screened ones. If
either fails, every screened point is simulated and a note says why.
"""

from __future__ import annotations

import collections
import math
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from sim.tune.frontier import OBJECTIVES
from sim.tune.screen import pressure_seen

# Figures the screen claims exactly (under its premises): a simulated point must repeat them.
EXACT_KEYS = ("tokens_recomputed", "tokens_reused", "tokens_pulled", "tokens_offered", "tokens_verified")
# How far a screened run's length may be from the simulated ones' (it divides retained GB*s into a mean):
# runs differ by the service times of their last turns, seconds against the workload's span.
RUN_LENGTH_SLACK = 0.01
MIN_HBM_SLACK = 0.02  # the least the retained HBM*s estimate is trusted to be off by (relative)


@dataclass
class Narrowing:
    results: list[dict[str, Any]]  # per job: the simulation's figures, or the screen's (marked screened)
    simulated: set[int] = field(default_factory=set)
    screened: set[int] = field(default_factory=set)
    same_as_simulated: int = 0  # of the simulated: took a twin's figures (same retention, same pulls on every turn)
    give_back_twins: int = 0  # give_back jobs not screened that took their pinned twin's figures
    same_decisions: int = 0  # jobs not screened that took the figures of one differing only in a recompute policy
    # that decides alike on every candidate the workload can offer (sim/tune/screen.py Screener.same_simulation_key)
    notes: list[str] = field(default_factory=list)


def screened_metrics(figures: dict[str, Any], run_length_s: tuple[float, float]) -> dict[str, Any]:
    """A screened point in the simulated points' form: TTFT at its lower bounds, HBM*s at the estimate,
    and ``bounds`` (lower, upper) for every figure that is not exact."""
    ttft = figures["ttft_lower_bound_ms"]
    retained_lo, retained_hi = figures["retained_hbm_gb_s_bounds"]
    out = {k: figures[k] for k in (*EXACT_KEYS, "reuse_hit_rate")}
    out.update({
        "ttft_p50_ms": ttft["p50"], "ttft_p90_ms": ttft["p90"], "ttft_p99_ms": ttft["p99"], "ttft_mean_ms": ttft["mean"],
        "retained_hbm_gb_s": figures["retained_hbm_gb_s_estimate"], "peak_retained_hbm_gb": math.nan,
        "preemptions": 0, "rejected": 0, "dropped_under_pressure": 0, "heartbeats": 0, "d_wait_total_s": 0.0,
        "d_wait_p99_ms": 0.0, "d_waits_behind_retained": 0, "preemptions_behind_retained": 0, "given_back": 0,
        "sim_time_s": sum(run_length_s) / 2, "prefill_utilisation_max": math.nan, "queue_share_of_ttft": math.nan,
        "ttft_cdf_ms": [], "retained_series": [], "screened": True,
        "bounds": {**{k: (ttft[k.split("_")[1]], math.inf) for k in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
                                                                       "ttft_mean_ms")},
                   "retained_hbm_gb_s": (retained_lo, retained_hi), "sim_time_s": run_length_s},
    })
    return out


def narrow(screened: dict[int, dict[str, Any]], pending: Sequence[int], jobs: int,
           counts_for_best: Callable[[int], bool], submit: Callable[[list[int]], list[Future]],
           objective: str, budget_gb: float, tolerance_pct: float, batch: int,
           references: dict[int, dict[str, Any]] | None = None,
           pinned_twins: dict[int, int] | None = None, same_run: dict[int, int] | None = None) -> Narrowing:
    """``screened``: job -> screen figures; ``pending``: the jobs to simulate anyway (every job not
    screened: they start first, with the probe); ``submit`` starts simulating jobs and returns their
    futures; ``counts_for_best``: may the job's simulated objective set the best (a non-lease sweep point
    or vLLM's default); ``references``: screen figures of simulated jobs (vLLM's default), to check the
    screen against; ``batch``: simulations kept running at once (one per worker); ``pinned_twins``: give_back
    job -> its pinned twin's job (sim/tune/evaluate.py ``pinned_twin``): a pending give_back job waits for
    its twin and takes its figures when that run shows giving back would not have acted, else is simulated;
    ``same_run``: pending job -> the pending job whose simulation it is (it runs no simulation of its own).

    Results are taken in the order the simulations started, and the next point is chosen after each
    one, from those taken so far: the same points are simulated whatever the executor and however
    long each simulation takes."""
    key = OBJECTIVES[objective]
    results: dict[int, dict[str, Any]] = {}
    out = Narrowing([], screened=set(screened))
    open_ = set(screened)  # screened jobs with no simulated figures yet
    checks = dict(references or {})  # job -> screen figures, for every simulated job the screen also covers
    twin = {j: f["same_simulation_key"] for j, f in {**screened, **checks}.items()}
    running: collections.deque[tuple[int, Future]] = collections.deque()  # in the order they started
    running_twins: set[Any] = set()
    trusted = True  # the screen held on every simulation so far (else every open job is simulated on its own)

    def hbm_slack() -> float:
        errors = [abs(f["retained_hbm_gb_s_estimate"] - results[j]["retained_hbm_gb_s"]) / results[j]["retained_hbm_gb_s"]
                  for j, f in checks.items() if j in results and results[j]["retained_hbm_gb_s"] > 0]
        return max([MIN_HBM_SLACK, *(2 * e for e in errors)])

    def lengths() -> tuple[float, float]:
        simulated = [m["sim_time_s"] for m in results.values()]
        return (min(simulated) * (1 - RUN_LENGTH_SLACK), max(simulated) * (1 + RUN_LENGTH_SLACK))

    def objective_lo(job: int) -> float:
        fig = screened[job]
        return fig["tokens_recomputed"] if key == "tokens_recomputed" else fig["ttft_lower_bound_ms"][key.split("_")[1]]

    def start(chosen: list[int]) -> None:
        running.extend(zip(chosen, submit(chosen)))
        running_twins.update(twin[j] for j in chosen if j in twin)

    def distrust(note: str) -> None:
        """The screen's hits are not exact here: simulate every open job, each on its own."""
        nonlocal trusted
        out.notes.append(note)
        if trusted:
            trusted = False
            own = {j for j, _ in running}
            start(sorted(j for j in open_ if j not in own))

    def take(job: int, metrics: dict[str, Any]) -> None:
        results[job] = metrics
        for waiting in waiting_for.pop(job, ()):
            if metrics.get("give_back_idle"):
                results[waiting] = metrics
                out.give_back_twins += 1
            else:
                start([waiting])
        if job in open_:
            open_.discard(job)
            out.simulated.add(job)
            out.screened.discard(job)
            checks[job] = screened[job]
        wrong = [k for k in EXACT_KEYS if job in checks and metrics[k] != checks[job][k]]
        if pressure_seen(metrics):
            distrust("a simulated point showed memory pressure on D (drops, preemptions or rejections): screened "
                     "hits are not exact here, every point was simulated")
        elif wrong:
            distrust(f"a simulated point's {', '.join(wrong)} differ from the screen's: every point was simulated "
                     "(please report this workload)")
        elif trusted and job in twin:
            # same retention, same pulls on every turn: the same simulation event for event, while the
            # screen's hits are exact (a twin not yet started takes these figures instead of a run)
            own = {j for j, _ in running}
            for j in sorted(open_):
                if twin[j] == twin[job] and j not in own:
                    results[j] = metrics
                    open_.discard(j)
                    out.simulated.add(j)
                    out.screened.discard(j)
                    out.same_as_simulated += 1

    def next_candidate() -> int | None:
        """The open job with the lowest objective bound that the recommendation could still be."""
        _, longest = lengths()
        feasible = [m[key] for j, m in results.items()
                    if counts_for_best(j) and m["rejected"] == 0 and m["retained_hbm_gb_s"] <= budget_gb * m["sim_time_s"]]
        best = min(feasible, default=math.inf)
        least = 1 - hbm_slack()
        candidates = [(objective_lo(j), j) for j in open_ if twin[j] not in running_twins
                      and screened[j]["retained_hbm_gb_s_estimate"] * least <= budget_gb * longest
                      and objective_lo(j) <= best * (1 + tolerance_pct / 100.0) + 1e-9]
        return min(candidates)[1] if candidates else None

    # the probe for pressure: the longest hold retains the most, so it is simulated whatever it scores
    # (unless it is a reference's twin: then that simulation is its own); it starts with the jobs
    # that are simulated anyway
    waiting_for: dict[int, list[int]] = {}  # a pending pinned job -> the give_back twins waiting for it
    same_run = same_run or {}
    pending_set = set(pending)
    for gb, pin in sorted((pinned_twins or {}).items()):
        if gb in pending_set and pin in pending_set and gb not in same_run:
            waiting_for.setdefault(same_run.get(pin, pin), []).append(gb)
    deferred = {gb for waiting in waiting_for.values() for gb in waiting}
    start([j for j in pending if j not in deferred and j not in same_run])
    probe = min(open_, key=lambda j: (-twin[j][0], objective_lo(j))) if open_ else None
    if probe is not None and twin[probe] not in running_twins:
        start([probe])
    while running:
        job, future = running.popleft()
        running_twins.discard(twin.get(job))
        take(job, future.result())
        while trusted and len(running) < batch and (job := next_candidate()) is not None:
            start([job])
    for job, rep in same_run.items():
        results[job] = results[rep]
        out.same_decisions += 1
    out.notes = list(dict.fromkeys(out.notes))
    run_length = lengths() if results else (math.nan, math.nan)
    out.results = [results[j] if j in results else screened_metrics(screened[j], run_length) for j in range(jobs)]
    return out
