"""The designs a deployment can pick to keep a conversation's KV between turns, each tuned, side by side.

A design is a way of serving the next turn (vLLM's TTL, bidikv's give-back, the learnt per-turn hold, a
host tier, prefill on D, ...); each has settings (a TTL, a threshold, a host tier's size) that the tuner
sweeps. :func:`tune_designs` simulates every design's settings on one workload with the references (OFF,
vLLM's default, the clairvoyant oracle), keeps per design its best setting within the budgets, and
recommends one design among those that are *acceptable*:

* within the HBM budget (time-averaged retained decode KV) and rejecting no turn;
* no turn waits at D for blocks that retained KV holds, and no sequence is preempted while it holds them
  (the cost pinned retention trades for reuse: it is what a deployment must not pay);
* TPOT p50 within ``max_tpot_increase_pct`` of OFF's (work a D takes on is paid by its other sequences).

Among those, the rule is the single-design tuner's (sim/tune/frontier.py): the best objective, and within
``tolerance_pct`` of it the one holding the least HBM*s, then the least host DRAM*s, then the design
listed first (:data:`DESIGNS` is in order of what a deployment must change: vLLM's own settings first).
Every figure is the simulation's: a design whose simulator side is missing is not listed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from sim.tune.evaluate import run_with_twins
from sim.tune.frontier import OBJECTIVES, Point, analyse
from sim.tune.grid import LEARNT_D_TTL_S, REFERENCES, Candidate, _fmt_s, _threshold_policy

PINNED = {"retained_under_pressure": "pinned"}
GIVE_BACK = {"retained_under_pressure": "give_back"}
DEFAULT_MAX_TPOT_INCREASE_PCT = 3.0
# the design tune's thresholds unless given: vLLM's default and bidikv's break-even (the single-design tune sweeps
# more; here every design multiplies them)
DESIGN_THRESHOLDS = ("64", "break_even")


@dataclass(frozen=True)
class Settings:
    """What the design tune sweeps: the single-design tuner's TTLs and thresholds, the learnt retention's
    budget (a share of all decode KV, the HBM budget by default)."""

    ttls_s: Sequence[float]
    thresholds: Sequence[str]
    learnt_retention_budget_pct: float
    # the host tier's bytes per instance (vLLM's cpu_bytes_to_use); 0: half the instance's host DRAM
    # (calibration.host_tier.default_cpu_bytes, from the profile's hardware preset)
    cpu_bytes_to_use: float = 0.0


@dataclass(frozen=True)
class Design:
    key: str  # one word, for --designs and JSON
    name: str  # for people
    what: str  # one line: what a deployment runs
    grid: Callable[[Settings], list[dict[str, Any]]]  # policy overrides (sim.engine.config.PolicyConfig fields)


def _ttls(modes: dict[str, Any]) -> Callable[[Settings], list[dict[str, Any]]]:
    def grid(s: Settings) -> list[dict[str, Any]]:
        out = []
        for threshold in s.thresholds:
            for ttl in s.ttls_s:
                if ttl > 0:  # a TTL of 0 keeps nothing: OFF, a reference
                    out.append({"retention": "ttl", "decoder_kv_blocks_ttl": float(ttl), **_threshold_policy(threshold),
                                **modes})
        return out
    return grid


def _prefill_on_d(modes: dict[str, Any]) -> Callable[[Settings], list[dict[str, Any]]]:
    """Each TTL of the sweep with the rules of Dynamo's conditional disaggregation at their defaults
    (impl.policy.prefill_on_d): a short suffix alone, or a short suffix or a busy P."""
    ttls = _ttls(modes)
    return lambda s: [{**policy, "prefill_on_d": rule} for rule in PREFILL_ON_D_RULES for policy in ttls(s)]


PREFILL_ON_D_RULES = ("isl_bounding", "isl_or_load")


def _host(s: Settings, eviction_policy: str = "lru") -> dict[str, Any]:
    """D's host tier as it serves multi-turn reuse: D's answers stored too (vLLM's default stores prompts only,
    so P would find the history without the last answer)."""
    return {"host_tier": True, "cpu_bytes_to_use": float(s.cpu_bytes_to_use), "eviction_policy": eviction_policy,
            "offload_prompt_only": False}


def _host_only(s: Settings) -> list[dict[str, Any]]:
    """llm-d's deployment: D keeps nothing in HBM (a TTL of 0: one-way NIXL transfer), P pulls from D's host tier."""
    return [{"retention": "ttl", "decoder_kv_blocks_ttl": 0.0, **_threshold_policy(threshold), **_host(s, eviction)}
            for threshold in s.thresholds for eviction in HOST_EVICTION_POLICIES]


def _hbm_and_host(s: Settings) -> list[dict[str, Any]]:
    """Each give_back TTL of the sweep and the learnt hold in D's HBM, and D's host tier behind them."""
    return [{**policy, **_host(s)} for policy in [*_ttls(GIVE_BACK)(s), *(p for p in _learnt(s)
                                                                         if p["retained_under_pressure"] == "give_back")]]


HOST_EVICTION_POLICIES = ("lru", "arc")  # vLLM's CPU cache policies (kv_offload/cpu/policies/)


def _learnt(s: Settings) -> list[dict[str, Any]]:
    return [{"retention": "learnt", "learnt_retention_budget_pct": s.learnt_retention_budget_pct, "decoder_kv_blocks_ttl": LEARNT_D_TTL_S,
             **_threshold_policy(threshold), **mode} for threshold in s.thresholds for mode in (PINNED, GIVE_BACK)]


VLLM_DEFAULT_POLICY = dict(REFERENCES[1].policy, **PINNED)

DESIGNS: tuple[Design, ...] = (
    Design("vllm_default", "vLLM default", "NixlConnector as shipped: D pins a finished turn's blocks 480 s, P pulls "
           "when 64 tokens or more are reusable", lambda s: [dict(VLLM_DEFAULT_POLICY)]),
    Design("fixed_ttl", "fixed TTL", "NixlConnector with a tuned decoder_kv_blocks_ttl and threshold; D pins the "
           "blocks until read or expired", _ttls(PINNED)),
    Design("give_back", "give_back", "bidikv's connector: a tuned TTL, and D gives retained blocks back under memory "
           "pressure at their last published expiry", _ttls(GIVE_BACK)),
    Design("learnt", "learnt", "bidikv's router asks D to hold each turn as long as its estimated return is worth, "
           "within the HBM budget (pinned or giving back)", _learnt),
    Design("host_tier", "host tier", "llm-d's P/D deployment: D keeps nothing in HBM, offloads each finished turn to its "
           "host DRAM (vLLM's OffloadingConnector) and P pulls it host-to-host over the P2P tier", _host_only),
    Design("hbm_and_host_tier", "HBM retention and host tier", "give_back retention in D's HBM (a tuned TTL or the "
           "learnt hold), and a turn D's HBM no longer holds pulled from D's host tier", _hbm_and_host),
    Design("prefill_on_d", "prefill on D", "the router sends a later turn whole to the D holding its conversation "
           "(Dynamo's conditional disaggregation rules), which computes the suffix between its decode steps; other "
           "turns pull from D's HBM as vLLM does, pinned", _prefill_on_d(PINNED)),
    Design("prefill_on_d_give_back", "prefill on D, give_back", "prefill on D, with D giving retained blocks back "
           "under memory pressure (bidikv's connector)", _prefill_on_d(GIVE_BACK)),
)
DESIGN_KEYS = tuple(d.key for d in DESIGNS)


def parse_designs(text: str) -> list[Design]:
    """``all`` or comma-separated keys of :data:`DESIGNS` (the error names the known ones)."""
    if text.strip() == "all":
        return list(DESIGNS)
    by_key = {d.key: d for d in DESIGNS}
    out = []
    for key in (k.strip() for k in text.split(",") if k.strip()):
        if key not in by_key:
            raise ValueError(f"--designs: unknown design {key!r} (known: all, {', '.join(DESIGN_KEYS)})")
        if by_key[key] not in out:
            out.append(by_key[key])
    if not out:
        raise ValueError(f"--designs: name at least one of all, {', '.join(DESIGN_KEYS)}")
    return out


def setting_label(policy: dict[str, Any]) -> str:
    """A design's setting in words (the design names the rest)."""
    parts = []
    retention = policy.get("retention", "ttl")
    if retention == "learnt":
        parts.append(f"learnt (budget {policy['learnt_retention_budget_pct']:g} %)")
    elif retention == "ttl":
        parts.append(f"ttl={_fmt_s(policy.get('decoder_kv_blocks_ttl', 480.0))}")
    else:
        parts.append(retention)
    parts.append("thr=break_even" if policy.get("recompute_policy") == "break_even"
                 else f"thr={policy.get('kv_recompute_threshold', 64)}")
    if policy.get("retained_under_pressure", "pinned") != "pinned":
        parts.append(policy["retained_under_pressure"])
    if policy.get("host_tier"):
        size = policy.get("cpu_bytes_to_use", 0.0)
        parts.append(f"host {size / 1e9:,.0f} GB {policy.get('eviction_policy', 'lru')}" if size
                     else f"host tier {policy.get('eviction_policy', 'lru')}")
    if policy.get("prefill_on_d", "off") != "off":
        parts.append(f"on_d={policy['prefill_on_d']}")
    return " ".join(parts)


def design_candidates(designs: Sequence[Design], settings: Settings) -> tuple[list[Candidate], list[str]]:
    """(candidates, the design key of each): every design's settings, then the references (design '')."""
    candidates, keys = [], []
    for d in designs:
        for policy in d.grid(settings):
            candidates.append(Candidate(f"{d.key}: {setting_label(policy)}", policy))
            keys.append(d.key)
    for ref in REFERENCES:
        candidates.append(ref)
        keys.append("")
    return candidates, keys


@dataclass
class DesignRow:
    design: Design
    best: Point | None  # the acceptable setting the rule picks, else the best feasible one, else None
    acceptable: bool  # best meets every condition of the recommendation
    why_not: list[str] = field(default_factory=list)  # what the best setting fails, when not acceptable
    settings: int = 0  # how many settings were simulated


@dataclass
class DesignTuning:
    rows: list[DesignRow]
    references: dict[str, Point]  # baseline_off, default, oracle
    chosen: DesignRow | None
    objective: str
    points: list[Point]


def failures(p: Point, off: Point, max_tpot_increase_pct: float) -> list[str]:
    """Which conditions of an acceptable design ``p`` fails (the module docstring's list), in words."""
    m, out = p.metrics, []
    if not p.feasible:
        out.append("over the HBM budget" if m["rejected"] == 0 else f"{m['rejected']} turns rejected")
    waits, preempted = m.get("d_waits_behind_retained", 0), m.get("preemptions_behind_retained", 0)
    if waits or preempted:
        out.append(f"retained KV made {waits:,} turns wait at D and {preempted:,} preemptions")
    tpot, off_tpot = m["tpot_p50_ms"], off.metrics["tpot_p50_ms"]
    if tpot is not None and off_tpot is not None and tpot > off_tpot * (1 + max_tpot_increase_pct / 100.0) + 1e-9:
        out.append(f"TPOT p50 {m['tpot_p50_ms']:.2f} ms, over OFF's {off.metrics['tpot_p50_ms']:.2f} ms + "
                   f"{max_tpot_increase_pct:g} %")
    return out


def _pick(points: Sequence[Point], key: str, tolerance_pct: float,
          order: Callable[[Point], Any] = lambda p: p.candidate.label) -> Point | None:
    """The best ``key`` and, within ``tolerance_pct`` of it, the least HBM*s, host DRAM*s, ``key``, ``order``."""
    if not points:
        return None
    best = min(p.metrics[key] for p in points)
    near = [p for p in points if p.metrics[key] <= best * (1 + tolerance_pct / 100.0) + 1e-9]
    return min(near, key=lambda p: (p.metrics["retained_hbm_gb_s"], p.metrics.get("host_dram_gb_s", 0.0), p.metrics[key],
                                    order(p)))


def choose(candidates: Sequence[Candidate], design_keys: Sequence[str], metrics: Sequence[dict[str, Any]],
           designs: Sequence[Design], objective: str, max_retained_hbm_pct: float, decode_hbm_gb: float,
           tolerance_pct: float, max_tpot_increase_pct: float = DEFAULT_MAX_TPOT_INCREASE_PCT,
           compute_bound_tokens: float | None = None) -> DesignTuning:
    """Per design its best setting, and the recommended design (the module docstring's rule)."""
    points, _ = analyse(candidates, metrics, objective, max_retained_hbm_pct, decode_hbm_gb, tolerance_pct,
                        compute_bound_tokens=compute_bound_tokens)
    refs = {p.candidate.kind: p for p in points if p.candidate.kind != "sweep"}
    off, key = refs["baseline_off"], OBJECTIVES[objective]
    rows = []
    for d in designs:
        mine = [p for p, k in zip(points, design_keys) if k == d.key]
        ok = [p for p in mine if not failures(p, off, max_tpot_increase_pct)]
        best = _pick(ok, key, tolerance_pct)
        if best is None:  # nothing acceptable: show the best that fits the budget, else the best at all
            best = _pick([p for p in mine if p.feasible], key, tolerance_pct) or _pick(mine, key, tolerance_pct)
        why = failures(best, off, max_tpot_increase_pct) if best is not None else ["not simulated"]
        rows.append(DesignRow(d, best, best is not None and not why, why, len(mine)))
    acceptable = [r for r in rows if r.acceptable]
    # on a tie of every figure the design listed first (the least a deployment must change)
    rank = {id(r.best): i for i, r in enumerate(acceptable)}
    chosen_point = _pick([r.best for r in acceptable], key, tolerance_pct, order=lambda p: rank[id(p)])
    chosen = next((r for r in acceptable if r.best is chosen_point), None)
    return DesignTuning(rows, refs, chosen, objective, points)



def tune_designs(config: Any, designs: Sequence[Design], settings: Settings,
                 run: Callable[[list[Any], list[dict[str, Any]]], list[dict[str, Any]]], objective: str,
                 max_retained_hbm_pct: float, decode_hbm_gb: float, tolerance_pct: float,
                 max_tpot_increase_pct: float = DEFAULT_MAX_TPOT_INCREASE_PCT,
                 compute_bound_tokens: float | None = None) -> DesignTuning:
    """Simulate every design's settings and the references on ``config``'s workload (``run``: configs and
    policy overrides to figures, sim/tune/executor.py), then :func:`choose`."""
    candidates, keys = design_candidates(designs, settings)
    metrics = run_with_twins([config] * len(candidates), [c.policy for c in candidates], run)
    return choose(candidates, keys, metrics, designs, objective, max_retained_hbm_pct, decode_hbm_gb, tolerance_pct,
                  max_tpot_increase_pct, compute_bound_tokens)

