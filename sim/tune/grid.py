"""Candidate configurations: what a sweep point changes, named for people and for vLLM."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from impl.policy import catalogue
from impl.policy.catalogue import CONNECTOR, UNDER_PRESSURE
from impl.policy.return_time import LearntRetentionSettings

# Finite only: vLLM's decoder_kv_blocks_ttl (and our connector and router) take a number of seconds,
# so a recommendation must be one; the oracle (clairvoyant retention, time-optimal pulls) is the reference,
# not a bound (sim/engine/oracle.py).
DEFAULT_TTLS_S = (0.0, 30.0, 60.0, 120.0, 240.0, 480.0, 900.0, 3600.0)
DEFAULT_THRESHOLDS = ("0", "64", "256", "1024", "break_even")
DEFAULT_LEASES_S = (30.0, 120.0)
DEFAULT_GAP_QUANTILES = (0.8, 0.9, 0.95)
# D's TTL under the learnt retention: its longest hold, so D cuts none short (the router asks for less)
LEARNT_D_TTL_S = LearntRetentionSettings().longest_hold_s
# what D does with retained blocks when its pool runs short (sim.engine.config.PolicyConfig.retained_under_pressure):
# vLLM's pinned blocks and bidikv's give-back, each configuration under both
DECODE_MODES = UNDER_PRESSURE.names(CONNECTOR)  # the deployable ones (not the simulator's instant_drop bound)
# vLLM's defaults, the reference every configuration is compared with
VLLM_TTL_S = catalogue.default("decoder_kv_blocks_ttl")
VLLM_THRESHOLD = catalogue.default("kv_recompute_threshold")


@dataclass(frozen=True)
class Candidate:
    label: str
    policy: dict[str, Any] = field(default_factory=dict)  # overrides of sim.engine.config.PolicyConfig fields
    kind: str = "sweep"  # sweep | baseline_off | oracle | default

    @property
    def threshold(self) -> str:
        return "break_even" if self.policy.get("recompute_policy") == "break_even" else str(self.policy.get("kv_recompute_threshold", VLLM_THRESHOLD))


def _threshold_policy(threshold: str) -> dict[str, Any]:
    if threshold == "break_even":
        return {"recompute_policy": "break_even"}
    try:
        tokens = int(threshold)
    except ValueError:
        raise ValueError(f"--thresholds: threshold {threshold!r} must be a token count or 'break_even'") from None
    if tokens < 0:
        raise ValueError(f"--thresholds: threshold {threshold!r} must be >= 0")
    return {"recompute_policy": "fixed", "kv_recompute_threshold": tokens}


def _fmt_s(seconds: float) -> str:
    return "inf" if math.isinf(seconds) else f"{seconds:g}s"


def build_grid(ttls_s: Sequence[float] = DEFAULT_TTLS_S, thresholds: Sequence[str] = DEFAULT_THRESHOLDS,
               leases_s: Sequence[float] = DEFAULT_LEASES_S, gap_quantiles: Sequence[float] = DEFAULT_GAP_QUANTILES,
               decode_modes: Sequence[str] = DECODE_MODES, learnt_retention_budget_pct: float | None = None) -> list[Candidate]:
    """Fixed TTL x threshold, then lease and gap-quantile retention x threshold, and the learnt per-turn
    retention within ``learnt_retention_budget_pct`` (None: not evaluated) x threshold, each under every decode mode
    (pinned rows keep their plain labels: vLLM's behaviour; give_back rows say so)."""
    for mode in decode_modes:
        if mode not in DECODE_MODES:
            raise ValueError(f"--decode-modes: {mode!r} must be one of {', '.join(DECODE_MODES)}")
    if not decode_modes:
        raise ValueError("--decode-modes: name at least one of " + ", ".join(DECODE_MODES))
    out: list[Candidate] = []
    for base in _retention_grid(ttls_s, thresholds, leases_s, gap_quantiles, learnt_retention_budget_pct):
        for mode in decode_modes:
            if mode == "pinned":
                out.append(Candidate(base.label, {**base.policy, "retained_under_pressure": "pinned"}))
            else:
                out.append(Candidate(f"{base.label} {mode}", {**base.policy, "retained_under_pressure": mode}))
    return out


def _retention_grid(ttls_s: Sequence[float], thresholds: Sequence[str], leases_s: Sequence[float],
                    gap_quantiles: Sequence[float], learnt_retention_budget_pct: float | None) -> list[Candidate]:
    out: list[Candidate] = []
    for threshold in thresholds:
        tp = _threshold_policy(threshold)
        for ttl in ttls_s:
            if not 0 <= ttl < math.inf:
                raise ValueError(f"--ttls: {ttl!r} must be a finite number of seconds >= 0 (vLLM's "
                                 "decoder_kv_blocks_ttl takes no infinity; for a very long hold give e.g. 86400)")
            out.append(Candidate(f"ttl={_fmt_s(ttl)} thr={threshold}", {"retention": "ttl", "decoder_kv_blocks_ttl": ttl, **tp}))
        for lease in leases_s:
            if not 0 < lease < math.inf:
                raise ValueError(f"--leases: {lease!r} must be a finite number of seconds > 0")
            out.append(Candidate(f"lease={_fmt_s(lease)} thr={threshold}",
                                 {"retention": "lease", "lease_s": lease, "heartbeat_interval_s": lease / 3, **tp}))
        for q in gap_quantiles:
            if not 0 < q <= 1:
                raise ValueError(f"--gap-quantiles: {q!r} must be in (0, 1]")
            out.append(Candidate(f"gap_q={q:g} thr={threshold}", {"retention": "gap_quantile", "gap_quantile": q, **tp}))
        if learnt_retention_budget_pct is not None:
            if not 0 < learnt_retention_budget_pct < math.inf:
                raise ValueError(f"learnt retention budget {learnt_retention_budget_pct!r} must be a finite percentage > 0")
            out.append(Candidate(f"learnt thr={threshold}", {"retention": "learnt", "learnt_retention_budget_pct": learnt_retention_budget_pct,
                                                             "decoder_kv_blocks_ttl": LEARNT_D_TTL_S, **tp}))
    return out


REFERENCES = (
    Candidate("OFF (one-way transfer)", {"bidirectional": False}, kind="baseline_off"),
    Candidate(f"vLLM default (ttl={_fmt_s(VLLM_TTL_S)} thr={VLLM_THRESHOLD})",
              {"retention": "ttl", "decoder_kv_blocks_ttl": VLLM_TTL_S, "recompute_policy": "fixed",
               "kv_recompute_threshold": VLLM_THRESHOLD}, kind="default"),
    Candidate("oracle", {"retention": "oracle", "recompute_policy": "break_even"}, kind="oracle"),
)


def parse_floats(text: str, name: str) -> list[float]:
    values = []
    for part in text.split(","):
        part = part.strip()
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"--{name}: {part!r} is not a number") from None
        if math.isnan(value):
            raise ValueError(f"--{name}: {part!r} is not a number")
        values.append(value)
    return values
