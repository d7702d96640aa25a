"""Fit a profile from your own cluster's measurements: the per-turn JSONL of ``bidikv bench``.

The published figures give two points per curve; a bench run gives hundreds of turns on your
hardware and model. Each turn's TTFT is modelled with the profile's own terms, per turn:

    TTFT = prefill_fixed_s + prefill_per_token_s * computed + [pulled > 0] * transfer_setup_s
           + per_pulled_token_s * pulled

where ``pulled`` is what P reported it did not compute (``prefill_cached_tokens``; 0 when OFF or
unreported) and ``computed = prompt - pulled``. ``per_pulled_token_s`` is wire time plus the reuse
overhead, which TTFT alone cannot separate: it is written as wire time (``transfer_bytes_per_s``)
and the reuse overhead is set to 0. Terms the bench cannot see (attention over context, decode,
HBM budget) are kept from ``base`` and named in the provenance. Bounded (non-negative) linear least
squares, ``scipy.optimize.lsq_linear``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np
from scipy.optimize import lsq_linear

from calibration.profile import LatencyProfile
from impl.bench.records import BenchRecord

TERMS = ("prefill_fixed_s", "prefill_per_token_s", "transfer_setup_s", "per_pulled_token_s")


def fit_from_bench(records: Sequence[BenchRecord], base: LatencyProfile, name: str | None = None) -> tuple[LatencyProfile, dict[str, Any]]:
    usable = [r for r in records if r.ok and math.isfinite(r.ttft_s) and r.prompt_tokens > 0]
    if len(usable) < len(TERMS) + 1:
        raise ValueError(f"need at least {len(TERMS) + 1} successful turns to fit, got {len(usable)}")
    rows, y = [], []
    for r in usable:
        pulled = min(r.prefill_cached_tokens or 0, r.prompt_tokens)
        rows.append([1.0, r.prompt_tokens - pulled, 1.0 if pulled else 0.0, pulled])
        y.append(r.ttft_s)
    a, b = np.array(rows), np.array(y)
    identifiable = [bool(np.any(a[:, j])) for j in range(len(TERMS))]
    cols = [j for j, ok in enumerate(identifiable) if ok]
    sol = lsq_linear(a[:, cols], b, bounds=(0, np.inf))
    x = np.zeros(len(TERMS))
    x[cols] = sol.x
    fitted = dict(zip(TERMS, (float(v) for v in x)))
    predicted = a @ x
    rel = (predicted - b) / b
    updates: dict[str, Any] = {"prefill_fixed_s": fitted["prefill_fixed_s"], "prefill_per_token_s": fitted["prefill_per_token_s"],
                               "prefill_attn_s": 0.0, "prefill_index_s": 0.0, "ttft_overhead_fixed_s": 0.0,
                               "ttft_overhead_per_prompt_token_s": 0.0, "ttft_overhead_per_reused_byte_s": 0.0,
                               "handoff_pays_transfer_setup": False, "pull_setup_overlaps_prefill_fixed": False}
    if identifiable[2]:
        updates["transfer_setup_s"] = fitted["transfer_setup_s"]
        updates["transfer_per_block_s"] = 0.0
        updates["reuse_overhead_per_token_s"] = 0.0
        if fitted["per_pulled_token_s"] > 0:
            updates["transfer_bytes_per_s"] = base.kv_bytes_per_token / fitted["per_pulled_token_s"]
    report = {
        "turns": len(usable), "turns_with_pull": int(np.sum(a[:, 2])),
        "terms": {t: (fitted[t] if ok else None) for t, ok in zip(TERMS, identifiable)},
        "rel_error_p50": float(np.median(np.abs(rel))), "rel_error_max": float(np.max(np.abs(rel))),
        "kept_from_base": sorted(set(f.name for f in dataclasses.fields(LatencyProfile)) - set(updates)
                                 - {"name", "model", "hardware", "tp", "kv_bytes_per_token", "block_size", "provenance"}),
    }
    if not identifiable[2]:
        report["note"] = "no turn pulled KV (an OFF run, or P did not report cached tokens): transfer terms kept from base"
    profile = dataclasses.replace(base, name=name or f"{base.name}+bench", provenance={
        "source": "calibration.from_bench.fit_from_bench: bounded linear least squares of per-turn TTFT "
                  "from a bidikv bench JSONL", "base_profile": base.name, **report}, **updates)
    return profile, report
