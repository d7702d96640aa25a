"""What the tuner prints and draws: the table, the recommendation as vLLM settings, the plots.

Configurations that produce identical results (every figure equal, e.g. one TTL under every threshold
when no reusable prefix is short enough for the threshold to matter) are one row, named by the
representative the recommendation would pick: vLLM's default threshold (64) when it is among them.

The recommendation pastes into the deployment this repo ships (impl/deploy/deploy.toml): P and D on
the recipe's HTTP ports, D's heartbeat listener on a port of its own, and a router command naming
every P and D of the tuned topology.
"""

from __future__ import annotations

import json
import math
import pathlib
import shlex
from typing import Any, Sequence

from impl.policy import catalogue
from impl.policy.catalogue import CONNECTOR, RETENTION, UNDER_PRESSURE
from sim.tune.frontier import OBJECTIVES, VLLM_DEFAULT_THRESHOLD, Point
from sim.tune.grid import VLLM_TTL_S

# The deploy recipe's ports (impl/deploy/deploy.toml): P's and D's HTTP servers, the router, and D's
# lease-heartbeat listener (apart from D's HTTP 8200 and NIXL side channel 5601, which it would clash with).
PREFILL_HTTP_PORT = 8100
DECODE_HTTP_PORT = 8200
ROUTER_PORT = 9000
HEARTBEAT_PORT = 5700
# Scalar figures that decide whether two configurations gave the same result.
_SAME_RESULT = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "ttft_mean_ms", "tokens_recomputed", "tokens_reused",
                "retained_hbm_gb_s", "peak_retained_hbm_gb", "preemptions", "rejected", "d_wait_total_s")


def _n(x: float | None, fmt: str = ",.0f") -> str:
    return "-" if x is None or (isinstance(x, float) and (math.isnan(x))) else format(x, fmt)


def _base_label(label: str) -> tuple[str, str]:
    base, sep, threshold = label.rpartition(" thr=")
    return (base, threshold) if sep else (label, "")


def collapse(points: Sequence[Point], chosen: Point | None = None) -> list[tuple[Point, list[Point]]]:
    """(representative, the points with its exact results) in first-seen order: sweep points that differ
    only in threshold and give identical figures become one. The representative is the recommended point
    if it is among them, else vLLM's default threshold, else the first."""
    groups: dict[Any, list[Point]] = {}
    for p in points:
        if p.candidate.kind != "sweep":
            key: Any = ("ref", id(p))
        else:
            key = (_base_label(p.candidate.label)[0], p.feasible, tuple(p.metrics.get(k) for k in _SAME_RESULT))
        groups.setdefault(key, []).append(p)
    out = []
    for members in groups.values():
        rep = next((p for p in members if p is chosen), None) or next(
            (p for p in members if p.candidate.threshold == VLLM_DEFAULT_THRESHOLD), members[0])
        out.append((rep, members))
    return out


def row_label(rep: Point, members: Sequence[Point]) -> str:
    if len(members) == 1:
        return rep.candidate.label
    others = [_base_label(p.candidate.label)[1] for p in members if p is not rep]
    return f"{rep.candidate.label} (= thr {','.join(others)})"


def table(points: Sequence[Point], chosen: Point | None, objective: str) -> str:
    rows = collapse(points, chosen)
    width = max(34, *(len(row_label(r, m)) + 2 for r, m in rows))
    head = (f"{'configuration':<{width}}{'TTFT p50':>9}{'p90':>8}{'p99':>8}{'HBM GB*s':>11}{'peak GB':>8}"
            f"{f'vs {VLLM_TTL_S:g}s':>8}{'compute%':>9}{'TTFT%':>7}{'bound%':>7}{'D wait s':>9}{'preempt':>8}{'rej':>5}  ")
    lines = [f"objective: minimise {objective} (ms: TTFT; HBM: retained decode KV; compute% / TTFT%: share of the "
             "oracle's saving over bidirectional OFF -- the oracle is clairvoyant retention with time-optimal pulls, "
             "a reference, not a bound: over 100 beats it; bound%: share of the most compute any configuration can "
             "save, every turn reusing all P could verify of D's blocks, a true bound; D wait s: turns' time waiting "
             "for decode blocks, summed; preempt: running sequences preempted; give_back rows: D gives retained KV "
             "back under pressure, the others pin it as vLLM does)", head]
    order = sorted(rows, key=lambda rm: (rm[0].candidate.kind != "sweep", rm[0].metrics[OBJECTIVES[objective]]))
    for p, members in order:
        m = p.metrics
        mark = "*" if p is chosen else ("F" if p.on_frontier else " ")
        mark += "" if p.feasible else " over budget"
        mark += " ~ screened" if p.screened else ""
        at_least = ">" if p.screened else ""  # a screened TTFT is a lower bound
        cells = ((at_least + _n(m["ttft_p50_ms"]), 9), (at_least + _n(m["ttft_p90_ms"]), 8),
                 (at_least + _n(m["ttft_p99_ms"]), 8), (_n(m["retained_hbm_gb_s"]), 11),
                 (_n(m["peak_retained_hbm_gb"], ",.1f"), 8), (_n(p.hbm_vs_default, ".2f"), 8),
                 (_n(p.compute_saving_pct_of_oracle, ".1f"), 9), (_n(p.ttft_saving_pct_of_oracle, ".1f"), 7),
                 (_n(p.compute_saving_pct_of_bound, ".1f"), 7), (_n(m.get("d_wait_total_s", 0.0), ",.0f"), 9),
                 (str(m["preemptions"]), 8), (str(m["rejected"]), 5))
        # a leading space in every cell: a figure wider than its column (minutes of TTFT, a million seconds of
        # D wait) pushes the row right instead of running into its neighbour
        lines.append(f"{row_label(p, members):<{width}}" + "".join(f"{' ' + text:>{w}}" for text, w in cells)
                     + f"  {mark}")
    lines.append("(* recommended, F on the Pareto frontier of objective vs retained HBM*s; \"= thr ...\": those "
                 "thresholds gave exactly the same results" + ("; ~ screened, not simulated: reuse figures exact, TTFT "
                 "a lower bound (>), HBM*s an estimate within bounds (--json), never recommended)"
                 if any(p.screened for p in points) else ")"))
    return "\n".join(lines)


def vllm_settings(point: Point, profile_name: str = "<profile name or path>",
                  topology: tuple[int, int] = (1, 1), decode_kv_tokens: int | None = None) -> dict[str, Any]:
    """``--kv-transfer-config`` for P and D (keys of impl.connector.config), the keys for the deploy
    recipe's [connector] table, and the router command for ``topology`` = (prefill, decode) instances.
    ``decode_kv_tokens``: the KV tokens of all D together (the learnt retention's budget is a share of them)."""
    pol = point.candidate.policy
    key, flag = (lambda name: catalogue.setting(name).key()), (lambda name: catalogue.setting(name).flag())
    retention = pol.get("retention", catalogue.default("retention"))
    if retention not in RETENTION.names(CONNECTOR) and retention != "learnt":
        raise ValueError(f"{point.candidate.label}: retention {retention!r} has no vLLM setting (simulator only)")
    learnt = retention == "learnt"
    if learnt:
        if decode_kv_tokens is None:
            raise ValueError(f"{point.candidate.label}: the learnt retention's budget needs the decode KV tokens")
        retention = "ttl"  # on D: a TTL, the longest hold; the router asks each turn for less
    ttl = pol.get("decoder_kv_blocks_ttl", catalogue.default("decoder_kv_blocks_ttl"))
    # D keeping nothing is one-way transfer: say so, rather than a TTL of 0 (the router refuses one)
    off = retention == "ttl" and ttl == 0
    break_even = pol.get("recompute_policy") == "break_even"
    # the learnt holds are read by bidikv's connector (stock vLLM ignores the router's per-turn ask)
    ours = retention != "ttl" or break_even or learnt
    p_extra: dict[str, Any] = {"bidirectional_kv_xfer": not off}
    d_extra: dict[str, Any] = {"bidirectional_kv_xfer": not off}
    if break_even:
        p_extra[key("recompute_policy")] = "break_even"
        p_extra[key("cost_profile")] = profile_name
    else:
        p_extra[key("kv_recompute_threshold")] = pol.get("kv_recompute_threshold",
                                                          catalogue.default("kv_recompute_threshold"))
    if retention == "ttl" and not off:
        if not math.isfinite(ttl):
            raise ValueError(f"{point.candidate.label}: vLLM's decoder_kv_blocks_ttl must be finite")
        d_extra[key("decoder_kv_blocks_ttl")] = ttl
    elif retention != "ttl":
        d_extra[key("retention")] = retention
        d_extra.update(_connector_keys(RETENTION.settings(retention), pol))
        if retention == "lease":
            # the listener the router relays client heartbeats to; without it a lease is a fixed TTL
            d_extra[key("heartbeat_port")] = HEARTBEAT_PORT
    if pol.get("retained_under_pressure") == "give_back" and not off:
        # the router renews each retained turn through D's listener before P reads it
        ours = True
        d_extra.update({key("retained_under_pressure"): "give_back", key("heartbeat_port"): HEARTBEAT_PORT})
        d_extra.update(_connector_keys(UNDER_PRESSURE.settings("give_back"), pol))
    base = {"kv_connector": "NixlConnector"}
    if ours:
        base["kv_connector_module_path"] = "impl.connector"
    prefill = {**base, "kv_role": "kv_producer", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": p_extra}
    decode = {**base, "kv_role": "kv_consumer", "kv_connector_extra_config": d_extra}
    num_prefill, num_decode = topology
    router = ["bidikv", "router", "--prefill", *(f"http://P{i}:{PREFILL_HTTP_PORT}" for i in range(num_prefill)),
              "--decode", *(f"http://D{i}:{DECODE_HTTP_PORT}" for i in range(num_decode)), "--port", str(ROUTER_PORT)]
    if retention == "ttl" and not off:
        router += [flag("decoder_kv_blocks_ttl"), f"{ttl:g}"]
    learnt_flags: list[str] = []
    if learnt and not off:
        budget = int(pol["learnt_retention_budget_pct"] / 100.0 * decode_kv_tokens)
        fallback = pol.get("learnt_retention_fallback_s", catalogue.default("learnt_retention_fallback_s"))
        learnt_flags = [flag("learnt_retention_budget_tokens"), str(max(budget, 1)),
                        flag("learnt_retention_fallback_s"), f"{fallback:g}"]
        router += learnt_flags
    # deploy.toml's [connector] is one table for P and D, without bidirectional_kv_xfer (its --mode sets it)
    connector = {k: v for k, v in {**p_extra, **d_extra}.items() if k != "bidirectional_kv_xfer"}
    if retention == "ttl":
        connector[key("retention")] = "ttl"  # the recipe's table may name another retention
    out = {"prefill_kv_transfer_config": prefill, "decode_kv_transfer_config": decode,
           "router_command": shlex.join(router), "router_argv": router, "deploy_connector": connector,
           "deploy_mode": "off" if off else "on", "deploy_router_extra_args": learnt_flags}
    if retention == "lease":
        out["caveat"] = (f"the lease is renewed only by heartbeats: D listens on bidikv_heartbeat_port ({HEARTBEAT_PORT} "
                         "here: any port the router can reach, plus the engine's data-parallel index) and tells the "
                         "router in its notifications; clients POST /v1/conversations/{id}/heartbeat to the router "
                         f"every {pol['heartbeat_interval_s']:g} s while a conversation is live. A client that does "
                         f"not heartbeat gets a {pol['lease_s']:g} s TTL")
    return out


def _connector_keys(settings: Sequence[str], policy: dict[str, Any]) -> dict[str, Any]:
    """The connector keys of the settings a candidate sets (the others keep the connector's defaults)."""
    return {catalogue.setting(name).key(): policy[name] for name in settings
            if name in policy and CONNECTOR in catalogue.setting(name).surfaces}


def recommendation_text(chosen: Point | None, profile_name: str = "<profile name or path>",
                        topology: tuple[int, int] = (1, 1), decode_kv_tokens: int | None = None) -> str:
    if chosen is None:
        return "no configuration meets the HBM budget: raise --max-retained-hbm-pct or decode memory"
    s = vllm_settings(chosen, profile_name, topology, decode_kv_tokens)
    bound = chosen.compute_saving_pct_of_bound
    of_bound = ("" if bound is None or math.isnan(bound)  # the caller gave no bound: say nothing of it
                else f"{bound:.1f} % of the most compute any configuration can save; ")
    return "\n".join([
        f"recommended: {chosen.candidate.label}  ({chosen.compute_saving_pct_of_oracle:.1f} % of the oracle's compute "
        f"saving, {chosen.ttft_saving_pct_of_oracle:.1f} % of its TTFT saving -- a clairvoyant reference, not a bound; "
        f"{of_bound}{chosen.hbm_vs_default:.2f}x the retained HBM*s of vLLM's default)",
        *paste_lines(s, chosen.metrics)])


def paste_lines(s: dict[str, Any], metrics: dict[str, Any]) -> list[str]:
    """What to paste for ``s`` (:func:`vllm_settings`'s dict): both servers' --kv-transfer-config, the router
    command, the deploy recipe's keys; and the reuse the simulation saw (``metrics``)."""
    toml = ", ".join(f"{k} = {json.dumps(v)}" for k, v in s["deploy_connector"].items())
    return [
        f"  prefill: vllm serve ... --kv-transfer-config '{json.dumps(s['prefill_kv_transfer_config'])}'",
        f"  decode:  vllm serve ... --kv-transfer-config '{json.dumps(s['decode_kv_transfer_config'])}'",
        f"  router:  {s['router_command']}   (P0.., D0..: your instances' addresses)",
        *(["  that is bidirectional transfer OFF: D keeps no blocks for P to read back"] if s["deploy_mode"] == "off"
          else []),
        f"  or, with impl/deploy: in deploy.toml's [connector] set {toml}"
        + (f", and in [router] extra_args = {json.dumps(s['deploy_router_extra_args'])}" if s["deploy_router_extra_args"]
           else "")
        + (f" (without them D keeps every turn for its {s['deploy_connector']['decoder_kv_blocks_ttl']:g} s TTL)"
           if "--learnt-retention-budget-tokens" in s["deploy_router_extra_args"] else "")
        + f"; run its scripts with --mode {s['deploy_mode']}",
        *([f"  caveat:  {s['caveat']}"] if "caveat" in s else []),
        *([f"  reuse:   D's tokens offered {m['tokens_offered']:,}, verified {m['tokens_verified']:,} (equal to the "
           f"prompt's token ids), pulled {m['tokens_pulled']:,}"] if (m := metrics).get("tokens_offered") else []),
    ]


def as_json(points: Sequence[Point], chosen: Point | None, objective: str,
            profile_name: str = "<profile name or path>", topology: tuple[int, int] = (1, 1),
            decode_kv_tokens: int | None = None) -> dict[str, Any]:
    """Every configuration (``same_results_as``: labels of the configurations collapsed into it), the
    frontier and the recommendation. Run through sim.commands.simulate.dumps: null, never NaN or Infinity."""

    def row(p: Point, members: Sequence[Point] = ()) -> dict[str, Any]:
        m = {k: v for k, v in p.metrics.items() if k not in ("ttft_cdf_ms", "retained_series", "screened")}
        return {"label": p.candidate.label, "kind": p.candidate.kind, "policy": p.candidate.policy, **m,
                "compute_saving_pct_of_oracle": p.compute_saving_pct_of_oracle,
                "compute_saving_pct_of_bound": p.compute_saving_pct_of_bound, "screened": p.screened,
                "ttft_saving_pct_of_oracle": p.ttft_saving_pct_of_oracle, "hbm_vs_default": p.hbm_vs_default,
                "mean_retained_hbm_gb": p.mean_retained_hbm_gb, "on_frontier": p.on_frontier, "feasible": p.feasible,
                "same_results_as": [q.candidate.label for q in members if q is not p]}

    rows = collapse(points, chosen)
    return {"objective": objective, "points": [row(p, members) for p, members in rows],
            "frontier": [p.candidate.label for p, _ in rows if p.on_frontier],
            "recommendation": None if chosen is None else {**row(chosen), **vllm_settings(chosen, profile_name, topology,
                                                                                           decode_kv_tokens)}}


# One colour and marker per reference, the same in all three plots.
_STYLE = {"baseline_off": ("OFF (one-way transfer)", "tab:gray", "X"),
          "default": (f"vLLM default ({VLLM_TTL_S:g} s, {VLLM_DEFAULT_THRESHOLD})", "tab:red", "s"),
          "oracle": ("oracle (clairvoyant reference)", "black", "*"),
          "chosen": ("recommended", "tab:green", "D")}


def _story(points: Sequence[Point], chosen: Point | None) -> list[tuple[str, Point]]:
    """The lines that tell the story: OFF, vLLM's default, the recommendation, the oracle."""
    by_kind = {p.candidate.kind: p for p in points if p.candidate.kind != "sweep"}
    out = [(k, by_kind[k]) for k in ("baseline_off", "default") if k in by_kind]
    if chosen is not None:
        out.append(("chosen", chosen))
    if "oracle" in by_kind:
        out.append(("oracle", by_kind["oracle"]))
    return out


def _name(kind: str, p: Point) -> str:
    return f"recommended: {p.candidate.label}" if kind == "chosen" else _STYLE[kind][0]


def plots(points: Sequence[Point], chosen: Point | None, objective: str, out: pathlib.Path,
          budget_gb: float | None = None) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    key = OBJECTIVES[objective]
    y_label = f"TTFT {objective.split('_')[1]} (ms)" if objective != "compute" else "prompt tokens recomputed"
    written = []
    rows = collapse(points, chosen)
    sweep = [p for p, _ in rows if p.candidate.kind == "sweep"]

    fig, ax = plt.subplots(figsize=(8, 5))
    families = {"ttl": ("fixed TTL", "tab:blue", "o"), "lease": ("heartbeat lease", "tab:purple", "^"),
                "gap_quantile": ("gap-quantile TTL", "tab:orange", "v")}
    for retention, (name, colour, marker) in families.items():
        fam = [p for p in sweep if p.candidate.policy.get("retention") == retention]
        for screened in (False, True):  # hollow: screened, not simulated (TTFT a lower bound)
            pts = [p for p in fam if p.screened == screened]
            if pts:
                ax.scatter([p.mean_retained_hbm_gb for p in pts], [p.metrics[key] for p in pts], marker=marker, s=28,
                           alpha=0.75, zorder=2, label=f"{name}{' (screened)' if screened else ''}",
                           **({"facecolors": "none", "edgecolors": colour} if screened else {"c": colour}))
    front = sorted((p.mean_retained_hbm_gb, p.metrics[key]) for p, _ in rows if p.on_frontier)
    if front:
        ax.plot(*zip(*front), color="tab:blue", lw=1, ls="--", label="Pareto frontier", zorder=1)
    for kind, p in _story(points, chosen):
        _, colour, marker = _STYLE[kind]
        ax.scatter([p.mean_retained_hbm_gb], [p.metrics[key]], c=colour, marker=marker, s=130 if kind == "oracle" else 90,
                   edgecolors="white", linewidths=0.8, label=_name(kind, p), zorder=4)
    if budget_gb is not None:
        ax.axvline(budget_gb, color="tab:red", lw=1, ls=":", label=f"HBM budget ({budget_gb:,.0f} GB mean)", zorder=1)
    # name only the fixed TTLs on the frontier, once each, so labels do not overprint
    named = set()
    for p, _ in rows:
        base = _base_label(p.candidate.label)[0]
        if p.on_frontier and p.candidate.kind == "sweep" and p.candidate.policy.get("retention") == "ttl" \
                and base not in named:
            named.add(base)
            ax.annotate(base.replace("ttl=", ""), (p.mean_retained_hbm_gb, p.metrics[key]), fontsize=8,
                        xytext=(5, 4), textcoords="offset points", color="tab:blue")
    ax.set_xlabel("retained decode HBM, time-averaged (GB)")
    ax.set_ylabel(y_label)
    ax.set_title("TTFT vs decode memory held for reuse (lower left is better)")
    ax.legend(fontsize=8, loc="upper right", framealpha=0.9)
    ax.grid(alpha=0.3)
    written += _save(fig, out / "frontier")

    fig, ax = plt.subplots(figsize=(8, 5))
    for kind, p in _story(points, chosen):
        cdf = p.metrics["ttft_cdf_ms"]
        if cdf:
            ax.plot(cdf, [i / len(cdf) for i in range(1, len(cdf) + 1)], label=_name(kind, p), color=_STYLE[kind][1],
                    lw=2 if kind == "chosen" else 1.3, ls="--" if kind == "oracle" else "-")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log scale)")
    ax.set_ylabel("fraction of turns with TTFT at most x")
    ax.set_title("TTFT distribution")
    ax.legend(fontsize=9, loc="lower right")
    ax.grid(alpha=0.3, which="both")
    written += _save(fig, out / "ttft_cdf")

    fig, ax = plt.subplots(figsize=(8, 5))
    for kind, p in _story(points, chosen):
        if kind == "baseline_off":
            continue  # retains nothing: a line on zero
        series = p.metrics["retained_series"]
        if series:
            ax.plot([t / 60 for t, _ in series], [g for _, g in series], label=_name(kind, p), color=_STYLE[kind][1],
                    lw=1.5 if kind == "chosen" else 1.1, ls="--" if kind == "oracle" else "-")
    if budget_gb is not None:
        ax.axhline(budget_gb, color="tab:red", lw=1, ls=":", label=f"HBM budget ({budget_gb:,.0f} GB, time-averaged)")
    ax.set_xlabel("simulated time (min)")
    ax.set_ylabel("retained decode HBM (GB)")
    ax.set_title("Decode memory held for reuse over time")
    ax.legend(fontsize=9, loc="upper left")  # every curve starts from zero: the corner stays clear
    ax.grid(alpha=0.3)
    written += _save(fig, out / "retained_hbm")
    plt.close("all")
    return written


def _save(fig: Any, stem: pathlib.Path) -> list[pathlib.Path]:
    fig.tight_layout()
    paths = [stem.with_suffix(".png"), stem.with_suffix(".svg")]
    for path in paths:
        # SVG embeds a date by default; without it the same run draws the same bytes
        fig.savefig(path, dpi=120, metadata={"Date": None} if path.suffix == ".svg" else None)
    return paths


def screening_summary(narrowing: Any, not_screened: Sequence[str], requested: bool) -> dict[str, Any]:
    """Which jobs the screen stood for and which were simulated, in words and numbers."""
    if not requested:
        return {"requested": False, "screened": 0, "simulated_after_screening": 0, "notes": [],
                "text": "off (every configuration simulated; --screen screens fixed TTLs)"}
    if narrowing is None:
        return {"requested": True, "screened": 0, "simulated_after_screening": 0, "notes": list(not_screened),
                "text": "not applicable, every configuration simulated: " + "; ".join(not_screened)}
    screened, simulated = len(narrowing.screened), len(narrowing.simulated)
    runs = (len(narrowing.results) - screened - narrowing.same_as_simulated - narrowing.give_back_twins
            - narrowing.same_decisions)
    text = (f"{screened} fixed-TTL configurations screened (one pass over the workload, not simulated), "
            f"{simulated} more simulated: {simulated - narrowing.same_as_simulated} because the recommendation could "
            "be them or to probe for memory pressure"
            + (f", {narrowing.same_as_simulated} the same simulation as one of those or a reference (same TTL, same "
               "pulls on every turn)" if narrowing.same_as_simulated else "")
            + (f"; {narrowing.give_back_twins} give_back points the same simulation as their pinned twin (giving "
               "back never acted there)" if narrowing.give_back_twins else "")
            + (f"; {narrowing.same_decisions} the same simulation as another point not screened (only their "
               "recompute policies differ, and those decide alike on every pull the workload can offer)"
               if narrowing.same_decisions else "") + "; "
            f"{runs} simulations run in all, references included")
    return {"requested": True, "screened": screened, "simulated_after_screening": simulated,
            "same_simulation_as_another": narrowing.same_as_simulated, "give_back_twins": narrowing.give_back_twins,
            "same_decisions": narrowing.same_decisions,
            "simulated": len(narrowing.results) - screened, "simulations_run": runs, "notes": list(narrowing.notes),
            "text": text + "".join(f"; {n}" for n in narrowing.notes)}
