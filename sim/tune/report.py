"""What the tuner prints and draws: the table, the recommendation as vLLM settings, the plots."""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any, Sequence

from sim.tune.frontier import OBJECTIVES, Point


def _n(x: float, fmt: str = ",.0f") -> str:
    return "-" if x is None or (isinstance(x, float) and (math.isnan(x))) else format(x, fmt)


def table(points: Sequence[Point], chosen: Point | None, objective: str) -> str:
    head = (f"{'configuration':<34}{'TTFT p50':>9}{'p90':>8}{'p99':>8}{'HBM GB*s':>11}{'peak GB':>8}"
            f"{'vs 480s':>8}{'compute%':>9}{'TTFT%':>7}{'preempt':>8}{'rej':>5}  ")
    lines = [f"objective: minimise {objective} (ms: TTFT; HBM: retained decode KV; %: share of the oracle's saving "
             "over bidirectional OFF)", head]
    order = sorted(points, key=lambda p: (p.candidate.kind != "sweep", p.metrics[OBJECTIVES[objective]]))
    for p in order:
        m = p.metrics
        mark = "*" if p is chosen else ("F" if p.on_frontier else " ")
        mark += "" if p.feasible else " over budget"
        lines.append(f"{p.candidate.label:<34}{_n(m['ttft_p50_ms']):>9}{_n(m['ttft_p90_ms']):>8}{_n(m['ttft_p99_ms']):>8}"
                     f"{_n(m['retained_hbm_gb_s']):>11}{_n(m['peak_retained_hbm_gb'], ',.1f'):>8}"
                     f"{_n(p.hbm_vs_default, '.2f'):>8}{_n(p.compute_saving_pct_of_oracle, '.1f'):>9}"
                     f"{_n(p.ttft_saving_pct_of_oracle, '.1f'):>7}{m['preemptions']:>8}{m['rejected']:>5}  {mark}")
    lines.append("(* recommended, F on the Pareto frontier of objective vs retained HBM*s)")
    return "\n".join(lines)


HEARTBEAT_PORT = 8200  # D's heartbeat listener in the recommended settings (impl.connector.heartbeat)


def vllm_settings(point: Point, profile_name: str = "<profile name or path>") -> dict[str, Any]:
    """``--kv-transfer-config`` for P and D (keys of impl.connector.config), and the router command."""
    pol = point.candidate.policy
    retention = pol.get("retention", "ttl")
    ours = retention != "ttl" or pol.get("recompute_policy") == "break_even"
    p_extra: dict[str, Any] = {"bidirectional_kv_xfer": True}
    d_extra: dict[str, Any] = {"bidirectional_kv_xfer": True}
    if pol.get("recompute_policy") == "break_even":
        p_extra["bidikv_recompute_policy"] = "break_even"
        p_extra["bidikv_cost_profile"] = profile_name
    else:
        p_extra["kv_recompute_threshold"] = pol.get("kv_recompute_threshold", 64)
    if retention == "ttl":
        ttl = pol.get("decoder_kv_blocks_ttl", 480.0)
        d_extra["decoder_kv_blocks_ttl"] = "inf" if math.isinf(ttl) else ttl
    elif retention == "lease":
        # the listener the router relays client heartbeats to; without it a lease is a fixed TTL
        d_extra.update(bidikv_retention="lease", bidikv_lease_s=pol["lease_s"],
                       bidikv_heartbeat_interval_s=pol["heartbeat_interval_s"],
                       bidikv_heartbeat_port=HEARTBEAT_PORT)
    elif retention == "gap_quantile":
        d_extra.update(bidikv_retention="gap_quantile", bidikv_gap_quantile=pol["gap_quantile"])
    base = {"kv_connector": "NixlConnector"}
    if ours:
        base["kv_connector_module_path"] = "impl.connector"
    prefill = {**base, "kv_role": "kv_producer", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": p_extra}
    decode = {**base, "kv_role": "kv_consumer", "kv_connector_extra_config": d_extra}
    router = ["bidikv", "router", "--prefill", "http://P:8000", "--decode", "http://D:8000"]
    if retention == "ttl":
        ttl = pol.get("decoder_kv_blocks_ttl", 480.0)
        router += ["--decoder-kv-blocks-ttl-s", "inf" if math.isinf(ttl) else f"{ttl:g}"]
    out = {"prefill_kv_transfer_config": prefill, "decode_kv_transfer_config": decode, "router_command": " ".join(router)}
    if retention == "lease":
        out["caveat"] = (f"the lease is renewed only by heartbeats: D listens on bidikv_heartbeat_port ({HEARTBEAT_PORT} "
                         "here: any port the router can reach, plus the engine's data-parallel index) and tells the "
                         "router in its notifications; clients POST /v1/conversations/{id}/heartbeat to the router "
                         f"every {pol['heartbeat_interval_s']:g} s while a conversation is live. A client that does "
                         f"not heartbeat gets a {pol['lease_s']:g} s TTL")
    return out


def recommendation_text(chosen: Point | None, profile_name: str = "<profile name or path>") -> str:
    if chosen is None:
        return "no configuration meets the HBM budget: raise --max-retained-hbm-pct or decode memory"
    s = vllm_settings(chosen, profile_name)
    return "\n".join([
        f"recommended: {chosen.candidate.label}  ({chosen.compute_saving_pct_of_oracle:.1f} % of the oracle's compute "
        f"saving, {chosen.ttft_saving_pct_of_oracle:.1f} % of its TTFT saving, {chosen.hbm_vs_default:.2f}x the "
        "retained HBM*s of vLLM's default)",
        f"  prefill: --kv-transfer-config '{json.dumps(s['prefill_kv_transfer_config'])}'",
        f"  decode:  --kv-transfer-config '{json.dumps(s['decode_kv_transfer_config'])}'",
        f"  router:  {s['router_command']}",
        *([f"  caveat:  {s['caveat']}"] if "caveat" in s else []),
    ])


def as_json(points: Sequence[Point], chosen: Point | None, objective: str,
            profile_name: str = "<profile name or path>") -> dict[str, Any]:
    def row(p: Point) -> dict[str, Any]:
        m = {k: v for k, v in p.metrics.items() if k not in ("ttft_cdf_ms", "retained_series")}
        return {"label": p.candidate.label, "kind": p.candidate.kind, "policy": p.candidate.policy, **m,
                "compute_saving_pct_of_oracle": p.compute_saving_pct_of_oracle,
                "ttft_saving_pct_of_oracle": p.ttft_saving_pct_of_oracle, "hbm_vs_default": p.hbm_vs_default,
                "mean_retained_hbm_gb": p.mean_retained_hbm_gb, "on_frontier": p.on_frontier, "feasible": p.feasible}

    return {"objective": objective, "points": [row(p) for p in points],
            "frontier": [p.candidate.label for p in points if p.on_frontier],
            "recommendation": None if chosen is None else {**row(chosen), **vllm_settings(chosen, profile_name)}}


def plots(points: Sequence[Point], chosen: Point | None, objective: str, out: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    key = OBJECTIVES[objective]
    written = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in points:
        if p.candidate.kind == "baseline_off":
            continue
        x, y = p.metrics["retained_hbm_gb_s"], p.metrics[key]
        style = {"oracle": ("k", "*"), "default": ("tab:red", "s")}.get(p.candidate.kind, ("tab:blue" if p.on_frontier else "0.7", "o"))
        ax.scatter([x], [y], c=style[0], marker=style[1], s=60 if p is chosen else 20, zorder=3)
        if p.on_frontier or p.candidate.kind != "sweep":
            ax.annotate(p.candidate.label, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    front = sorted((p.metrics["retained_hbm_gb_s"], p.metrics[key]) for p in points if p.on_frontier)
    if front:
        ax.plot(*zip(*front), color="tab:blue", lw=1)
    ax.set_xlabel("retained decode HBM (GB*s)")
    ax.set_ylabel(f"{objective} (ms)" if objective != "compute" else "prompt tokens recomputed")
    ax.set_title("Pareto frontier: TTFT vs retained HBM")
    written += _save(fig, out / "frontier")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    shown = [p for p in points if p.on_frontier or p.candidate.kind != "sweep"]
    for p in shown:
        cdf = p.metrics["ttft_cdf_ms"]
        if cdf:
            ax.plot(cdf, [i / len(cdf) for i in range(1, len(cdf) + 1)], label=p.candidate.label, lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of turns")
    ax.legend(fontsize=6)
    ax.set_title("TTFT CDF per configuration")
    written += _save(fig, out / "ttft_cdf")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in shown:
        series = p.metrics["retained_series"]
        if series:
            ax.plot([t for t, _ in series], [g for _, g in series], label=p.candidate.label, lw=1)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("retained decode HBM (GB)")
    ax.legend(fontsize=6)
    ax.set_title("Retained HBM over time")
    written += _save(fig, out / "retained_hbm")
    plt.close("all")
    return written


def _save(fig: Any, stem: pathlib.Path) -> list[pathlib.Path]:
    fig.tight_layout()
    paths = [stem.with_suffix(".png"), stem.with_suffix(".svg")]
    for path in paths:
        fig.savefig(path, dpi=120)
    return paths
