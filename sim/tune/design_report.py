"""What the design tune prints: one row per design at its best setting, the references, and what to paste
for the recommended design (sim/tune/designs.py decides; this module only words it)."""

from __future__ import annotations

import math
import shlex
from typing import Any, Sequence

from sim.tune.designs import DesignRow, DesignTuning, setting_label
from sim.tune.frontier import Point
from sim.tune.report import paste_lines, vllm_settings

# The figures of a design row, in the order of the table and of the JSON (benchmarks/designs.py's keys too).
ROW_KEYS = ("design", "setting", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "oracle_saving_pct",
            "d_wait_s", "d_waits_behind_retained", "preemptions", "preemptions_behind_retained", "retained_hbm_gb_s",
            "hbm_s_vs_default", "dram_s", "nic_bytes", "acceptable", "why_not")


def figures(design: str, setting: str, p: Point, acceptable: bool | None = None,
            why_not: Sequence[str] = ()) -> dict[str, Any]:
    """One row's figures (``dram_s``: host DRAM GB*s; ``nic_bytes``: bytes over the NICs)."""
    m = p.metrics
    return {"design": design, "setting": setting, "ttft_p50_ms": m["ttft_p50_ms"], "ttft_p90_ms": m["ttft_p90_ms"],
            "tpot_p50_ms": m["tpot_p50_ms"], "tpot_p90_ms": m["tpot_p90_ms"],
            "oracle_saving_pct": p.compute_saving_pct_of_oracle, "d_wait_s": m["d_wait_total_s"],
            "d_waits_behind_retained": m["d_waits_behind_retained"], "preemptions": m["preemptions"],
            "preemptions_behind_retained": m["preemptions_behind_retained"],
            "retained_hbm_gb_s": m["retained_hbm_gb_s"], "hbm_s_vs_default": p.hbm_vs_default,
            "dram_s": m["host_dram_gb_s"], "nic_bytes": m["bytes_moved"], "acceptable": acceptable,
            "why_not": list(why_not)}


REFERENCE_NAMES = {"baseline_off": "OFF (one-way transfer)", "oracle": "oracle (clairvoyant reference)"}


def rows(tuning: DesignTuning) -> list[dict[str, Any]]:
    """OFF, every design's row, the oracle: the table as data."""
    out = [figures(REFERENCE_NAMES["baseline_off"], "", tuning.references["baseline_off"])]
    for r in tuning.rows:
        if r.best is not None:
            out.append(figures(r.design.key, setting_label(r.best.candidate.policy), r.best, r.acceptable, r.why_not))
    out.append(figures(REFERENCE_NAMES["oracle"], "", tuning.references["oracle"]))
    return out


def _n(x: Any, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def table(tuning: DesignTuning, max_tpot_increase_pct: float) -> str:
    data = rows(tuning)
    chosen = tuning.chosen.design.key if tuning.chosen else None
    width = max(len(r["design"]) for r in data) + 2
    swidth = max(9, *(len(r["setting"]) for r in data)) + 2
    head = (f"{'design':<{width}}{'setting':<{swidth}}{'TTFT p50':>9}{'p90':>8}{'TPOT p50':>9}{'p90':>7}"
            f"{'HBM GB*s':>11}{'vs 480s':>8}{'DRAM GB*s':>11}{'NIC TB':>8}{'oracle%':>8}{'D wait s':>10}{'preempt':>8}")
    lines = [f"designs, each at its best setting (objective: minimise {tuning.objective}; ms, TTFT and TPOT p50/p90)",
             head]
    for r in data:
        mark = ("*" if r["design"] == chosen else "" if r["acceptable"] is None else
                " " if r["acceptable"] else "x")
        cells = ((_n(r["ttft_p50_ms"], ",.0f"), 9), (_n(r["ttft_p90_ms"], ",.0f"), 8), (_n(r["tpot_p50_ms"], ".2f"), 9),
                 (_n(r["tpot_p90_ms"], ".2f"), 7), (_n(r["retained_hbm_gb_s"], ",.0f"), 11),
                 (_n(r["hbm_s_vs_default"], ".2f"), 8), (_n(r["dram_s"], ",.0f"), 11),
                 (_n(r["nic_bytes"] / 1e12, ",.1f"), 8), (_n(r["oracle_saving_pct"], ".1f"), 8),
                 (_n(r["d_wait_s"], ",.0f"), 10), (f"{r['preemptions']:,}", 8))
        lines.append(f"{r['design']:<{width}}{r['setting']:<{swidth}}" + "".join(f"{' ' + t:>{w}}" for t, w in cells)
                     + f"  {mark}".rstrip())
    lines.append(f"(* recommended; x not acceptable: the reason below. Acceptable: within the HBM budget, no turn "
                 f"rejected, no wait at D or preemption caused by retained KV, TPOT p50 within "
                 f"{max_tpot_increase_pct:g} % of OFF's. HBM GB*s: retained decode KV; vs 480s: relative to vLLM's "
                 "default; DRAM GB*s: host-tier KV; NIC TB: bytes over the NICs; oracle%: share of the oracle's "
                 "compute saving over OFF (a clairvoyant reference, not a bound); D wait s: turns' time waiting at D "
                 "for blocks, summed)")
    for r in data:
        if r["acceptable"] is False:
            lines.append(f"  x {r['design']}: {'; '.join(r['why_not'])}")
    return "\n".join(lines)


def design_settings(row: DesignRow, profile_name: str, topology: tuple[int, int],
                    decode_kv_tokens: int | None) -> dict[str, Any]:
    """What to deploy for ``row``'s best setting (sim/tune/report.py's ``vllm_settings`` form), with the
    router's flags for the other settings it shares with the simulator (prefill on D: impl.policy.catalogue's
    ROUTER surface) added to its command and to the deploy recipe's [router] extra_args."""
    policy = row.best.candidate.policy
    s = vllm_settings(row.best, profile_name, topology, decode_kv_tokens)
    flags = router_flags(policy, s["router_argv"])
    if flags:
        s["router_argv"] = [*s["router_argv"], *flags]
        s["router_command"] = shlex.join(s["router_argv"])
        s["deploy_router_extra_args"] = [*s["deploy_router_extra_args"], *flags]
    if policy.get("host_tier"):
        with_host_tier(s, policy, profile_name)
    return s


def with_host_tier(s: dict[str, Any], policy: dict[str, Any], profile_name: str) -> None:
    """Both servers' --kv-transfer-config as the two-tier MultiConnector (impl/connector/two_tier.py renders it):
    bidikv's (or vLLM's) NixlConnector and vLLM's OffloadingConnector with the P2P tier, ``cpu_bytes_to_use`` per
    instance (the policy's, else half the instance's host DRAM), D storing its answers too."""
    from calibration.host_tier import default_cpu_bytes
    from calibration.profile import LatencyProfile
    from impl.connector.two_tier import HostTierConfig, two_tier_kv_transfer_config

    size = int(policy.get("cpu_bytes_to_use") or default_cpu_bytes(LatencyProfile.load(profile_name)))
    eviction = policy.get("eviction_policy", "lru")
    s["prefill_kv_transfer_config"] = two_tier_kv_transfer_config(
        s["prefill_kv_transfer_config"], HostTierConfig(cpu_bytes_to_use=size, eviction_policy=eviction))
    s["decode_kv_transfer_config"] = two_tier_kv_transfer_config(
        s["decode_kv_transfer_config"], HostTierConfig(cpu_bytes_to_use=size, eviction_policy=eviction,
                                                       offload_prompt_only=policy.get("offload_prompt_only", False)))
    s["host_tier"] = {"cpu_bytes_to_use": size, "eviction_policy": eviction,
                      "min_cached_token_delta": policy.get("min_cached_token_delta")}
    s["caveat"] = ("P reads D's host tier only for a request that names it (kv_transfer_params.remote_kv_source = "
                   "{kv_request_id, remote_host, remote_port}: vLLM's P2P tier, v1/kv_offload/tiering/p2p/manager.py); "
                   "bidikv router stamps it for a turn D's HBM no longer holds when started with --host-tier-capacity-tokens "
                   "(D's host tier in KV tokens) and impl/deploy's [host_tier] table sets it up (docs/guides/"
                   "host-tier.md). Set VLLM_P2P_SIDE_CHANNEL_HOST to each instance's routable address; every instance "
                   "needs the same --block-size and PYTHONHASHSEED (block hashes must agree)")


def router_flags(policy: dict[str, Any], argv: Sequence[str] = ()) -> list[str]:
    """``bidikv router`` flags for ``policy``'s prefill on D (impl.policy.catalogue's PREFILL_ON_D family:
    its selector and the settings its policy reads, those the router carries, one name on both surfaces)
    that differ from their default and ``argv`` does not set yet."""
    from impl.policy.catalogue import PREFILL_ON_D, ROUTER, setting

    rule = policy.get(PREFILL_ON_D.selector, setting(PREFILL_ON_D.selector).default)
    out: list[str] = []
    for name in (PREFILL_ON_D.selector, *PREFILL_ON_D.settings(rule)):
        entry, flag = setting(name), f"--{name.replace('_', '-')}"
        value = policy.get(name, entry.default)
        if ROUTER in entry.surfaces and value != entry.default and flag not in argv:
            out += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return out


def recommendation_text(tuning: DesignTuning, profile_name: str, topology: tuple[int, int],
                        decode_kv_tokens: int | None) -> str:
    if tuning.chosen is None:
        return ("no design is acceptable: every one is over the HBM budget, makes turns wait at D or preempts "
                "because of retained KV, or slows TPOT beyond the limit (see why above); raise "
                "--max-retained-hbm-pct or --max-tpot-increase-pct, or add decode memory")
    row, p = tuning.chosen, tuning.chosen.best
    oracle, off = tuning.references["oracle"].metrics, tuning.references["baseline_off"].metrics
    s = design_settings(row, profile_name, topology, decode_kv_tokens)
    return "\n".join([
        f"recommended design: {row.design.name} ({setting_label(p.candidate.policy)}): {row.design.what}",
        f"  {p.compute_saving_pct_of_oracle:.1f} % of the oracle's compute saving; TTFT p90 "
        f"{p.metrics['ttft_p90_ms']:,.0f} ms ({_ratio(p.metrics['ttft_p90_ms'], oracle['ttft_p90_ms'])} the oracle's); "
        f"TPOT p50 {_n(p.metrics['tpot_p50_ms'], '.2f')} ms ({_ratio(p.metrics['tpot_p50_ms'], off['tpot_p50_ms'])} OFF's); "
        f"{p.hbm_vs_default:.2f}x the retained HBM*s of vLLM's default",
        *paste_lines(s, p.metrics)])


def _ratio(value: float | None, ref: float | None) -> str:
    return f"{(value / ref - 1) * 100:+.1f} % on" if value is not None and ref else "- of"


def as_json(tuning: DesignTuning, profile_name: str, topology: tuple[int, int],
            decode_kv_tokens: int | None) -> dict[str, Any]:
    chosen = tuning.chosen
    return {"objective": tuning.objective, "designs": rows(tuning),
            "settings_simulated": {r.design.key: r.settings for r in tuning.rows},
            "recommendation": None if chosen is None else {
                "design": chosen.design.key, "setting": setting_label(chosen.best.candidate.policy),
                **design_settings(chosen, profile_name, topology, decode_kv_tokens)}}
