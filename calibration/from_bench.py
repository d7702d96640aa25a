"""Fit a profile from your own cluster's measurements: the per-turn JSONL of ``bidikv bench``.

The published figures give two points per curve; a bench run gives hundreds of turns on your
hardware and model. Two fits, each on what measures it.

**TTFT**, per turn, with the profile's own terms:

    TTFT = (1 + busy_factor * busy) * (prefill_fixed_s + prefill_per_token_s * computed
                                       + prefill_attn_s * computed * (pulled + computed / 2))
           + [pulled > 0] * transfer_setup_s + per_pulled_token_s * pulled

The attention term counts the (query, key) pairs of a dense causal prefill of ``computed`` new tokens
after ``pulled`` cached ones (:func:`calibration.prefill.causal_pairs`): an OFF turn recomputing a
1,300-token history pays it quadratically, a pulled turn computing 60 tokens hardly at all, so a fit
without it on ON runs charged the OFF runs' long recomputes by the first turns' per-token cost.

``pulled`` is what P reported it did not compute (``prefill_cached_tokens``; 0 when OFF or
unreported), ``computed = prompt - pulled``, ``busy`` is :func:`calibration.busy.busy_flags` (another
turn decoded within ``busy_window_s`` before this one started: on the CPU rehearsal P and D share two
cores). ``busy_factor`` is found by a bounded 1-D search; for each value the rest is a bounded
(non-negative) fit of log(predicted / measured), so a short turn counts as much as a long one and a
turn slowed 3x weighs as much as one sped up 3x, with a robust loss by default (``soft_l1``: see
``LOSSES``). ``per_pulled_token_s`` is
wire time plus the reuse overhead, which TTFT alone cannot separate: it is written as the reuse
overhead (``reuse_overhead_per_token_s``, paid by pulls only) and the wire rate is set to
``max_transfer_bytes_per_s``, a bound, said so in the report. Written as wire time, a ~0 cost divided
into bytes gave 3e23-8e35 bytes/s, and any rate made the simulator charge every turn's P->D hand-off
a second time (the measured TTFT already contains it, inside the fitted compute terms).

**Decode**, per turn with tokens after the first read, TPOT = (total - TTFT) / (output - tokens of the
first read) (:attr:`calibration.bench_records.BenchRecord.tpot_s`; tokens that came with the first were decoded
before TTFT was stamped):

    TPOT = decode_fixed_s + decode_per_seq_s * B + decode_per_ctx_token_s * C

with B and C the mean batch and total context over the turn's decode span
(:func:`calibration.busy.decode_loads`), the same bounded robust fit of the log ratio. A term
the records do not vary (B always 1 at concurrency 1) is not identifiable: it is set to 0 and its
share goes to the fixed term, and the report says so.

The deployment's block size and KV bytes per token come from ``settings``
(:class:`calibration.bench_settings.DeploymentSettings`); left at 0 they are kept from ``base`` and
named in the report. Terms the bench cannot see (HBM budget) are kept from ``base``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np
from scipy.optimize import least_squares, lsq_linear, minimize_scalar

from calibration.bench_settings import DeploymentSettings
from calibration.busy import DEFAULT_BUSY_WINDOW_S, busy_flags, decode_loads
from calibration.prefill import causal_pairs
from calibration.profile import LatencyProfile
from calibration.bench_records import BenchRecord

TERMS = ("prefill_fixed_s", "prefill_per_token_s", "prefill_attn_s", "transfer_setup_s", "per_pulled_token_s")
_COMPUTE = 3  # the first three terms are P's compute (slowed when busy); the rest are the pull's
DECODE_TERMS = ("decode_fixed_s", "decode_per_seq_s", "decode_per_ctx_token_s")
# 1 TB/s: above anything a pull the bench can resolve crosses (p5en: 8 x 400 Gbps EFA = 400 GB/s; a
# CPU's memory copy ~10 GB/s), so a bounded rate never makes a simulated pull slower than measured.
DEFAULT_MAX_TRANSFER_BYTES_PER_S = 1e12
# Robust loss: on a shared 2-core machine other tenants' load makes a few turns 3-5x slower than their
# like (measured: 95-token decodes of 2 s and of 17 s in one run). Squared error lets those few set
# the terms; soft_l1 (scipy.optimize.least_squares) weighs a log-ratio residual beyond ROBUST_SCALE (~10 %)
# linearly, so the terms describe the typical turn, which is what a median |error| measures.
# https://docs.scipy.org/doc/scipy/reference/generated/scipy.optimize.least_squares.html
LOSSES = ("soft_l1", "linear")
DEFAULT_LOSS = "soft_l1"
ROBUST_SCALE = 0.1
MAX_BUSY_FACTOR = 5.0  # the search's upper bound: measured ~1 (2x); 5 (6x) would mean something else is wrong


def _ttft_rows(usable: Sequence[BenchRecord], busy: Sequence[bool]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Columns (1, computed, attention pairs, [pulled], pulled), the busy flags and the measured TTFTs."""
    rows, flags, y = [], [], []
    for r, b in zip(usable, busy):
        pulled = min(r.prefill_cached_tokens or 0, r.prompt_tokens)
        computed = r.prompt_tokens - pulled
        rows.append([1.0, computed, causal_pairs(computed, pulled), 1.0 if pulled else 0.0, pulled])
        flags.append(1.0 if b else 0.0)
        y.append(r.ttft_s)
    return np.array(rows), np.array(flags), np.array(y)


def _bounded_fit(w: np.ndarray, loss: str) -> tuple[np.ndarray, float]:
    """Non-negative x minimising the loss of log(w @ x) (rows already divided by the measurement, so each
    residual is log(predicted / measured)).

    The log ratio, as calibration.fit does for the published figures: on a loaded machine the noise is
    multiplicative (a turn 3x slower is as likely as one 3x faster on a log scale), and a plain relative
    error (predicted/measured - 1) is bounded below by -1 but not above, which pulls every term low:
    fitted that way, the simulated TPOT came out 78 % below the measured median."""
    x0 = lsq_linear(w, np.ones(len(w)), bounds=(0, np.inf)).x
    floor = 1e-12

    def residual(v: np.ndarray) -> np.ndarray:
        return np.log(np.maximum(w @ v, floor))

    def jac(v: np.ndarray) -> np.ndarray:
        return w / np.maximum(w @ v, floor)[:, None]

    sol = least_squares(residual, np.maximum(x0, floor), jac=jac, bounds=(0, np.inf), loss=loss,
                        f_scale=ROBUST_SCALE, x_scale="jac", method="trf", ftol=1e-12, xtol=1e-12, gtol=1e-12)
    return sol.x, float(sol.cost)


def _fit_ttft(a: np.ndarray, busy: np.ndarray, y: np.ndarray, fit_busy: bool,
              loss: str = DEFAULT_LOSS) -> tuple[np.ndarray, float, list[bool]]:
    identifiable = [bool(np.any(a[:, j])) for j in range(len(TERMS))]
    cols = [j for j, ok in enumerate(identifiable) if ok]

    def solve(k: float) -> tuple[np.ndarray, float]:
        scaled = a.copy()
        scaled[:, :_COMPUTE] *= (1.0 + k * busy)[:, None]  # busy slows P's compute, not the pull
        w = scaled[:, cols] / y[:, None]  # divide each row by its measurement: residuals are ratios
        sol, cost = _bounded_fit(w, loss)
        x = np.zeros(len(TERMS))
        x[cols] = sol
        return x, cost

    k = 0.0
    if fit_busy and 0 < busy.sum() < len(busy):
        k = float(minimize_scalar(lambda v: solve(v)[1], bounds=(0.0, MAX_BUSY_FACTOR), method="bounded",
                                  options={"xatol": 1e-4}).x)
        if solve(0.0)[1] <= solve(k)[1]:
            k = 0.0
    x, _ = solve(k)
    return x, k, identifiable


def predict_ttft(terms: dict[str, float], busy_factor: float, prompt: int, pulled: int, busy: bool) -> float:
    """The fitted formula for one turn (what the report's errors are of)."""
    computed = prompt - pulled
    return ((1 + busy_factor * busy) * (terms["prefill_fixed_s"] + terms["prefill_per_token_s"] * computed
                                        + terms["prefill_attn_s"] * causal_pairs(computed, pulled))
            + (terms["transfer_setup_s"] if pulled else 0.0) + terms["per_pulled_token_s"] * pulled)


def _fit_decode(runs: Sequence[Sequence[BenchRecord]], loss: str = DEFAULT_LOSS) -> dict[str, Any] | None:
    loads = [d for run in runs for d in decode_loads(run) if d is not None and d.tpot_s > 0]
    if len(loads) < len(DECODE_TERMS) + 1:
        return None
    a = np.array([[1.0, d.batch, d.context_tokens] for d in loads])
    y = np.array([d.tpot_s for d in loads])
    # a term is identifiable only if its regressor varies; B = 1 throughout cannot be told from the fixed term
    identifiable = [True, float(np.ptp(a[:, 1])) > 1e-9, float(np.ptp(a[:, 2])) > 1e-9]
    cols = [j for j, ok in enumerate(identifiable) if ok]
    sol, _ = _bounded_fit(a[:, cols] / y[:, None], loss)
    x = np.zeros(len(DECODE_TERMS))
    x[cols] = sol
    rel = a @ x / y - 1.0
    return {"turns": len(loads), "terms": {t: (float(v) if ok else None) for t, v, ok in zip(DECODE_TERMS, x, identifiable)},
            "values": dict(zip(DECODE_TERMS, (float(v) for v in x))),
            "batch_range": [float(a[:, 1].min()), float(a[:, 1].max())],
            "rel_error_p50": float(np.median(np.abs(rel))), "rel_error_max": float(np.max(np.abs(rel)))}


def fit_from_bench(records: Sequence[BenchRecord], base: LatencyProfile, name: str | None = None,
                   settings: DeploymentSettings | None = None,
                   max_transfer_bytes_per_s: float = DEFAULT_MAX_TRANSFER_BYTES_PER_S,
                   busy_window_s: float = DEFAULT_BUSY_WINDOW_S, loss: str = DEFAULT_LOSS) -> tuple[LatencyProfile, dict[str, Any]]:
    """A profile and a report (terms, fit errors, what was kept from ``base`` and why), from one run."""
    return fit_from_runs([records], base, name, settings, max_transfer_bytes_per_s, busy_window_s, loss)


def fit_from_runs(runs: Sequence[Sequence[BenchRecord]], base: LatencyProfile, name: str | None = None,
                  settings: DeploymentSettings | None = None,
                  max_transfer_bytes_per_s: float = DEFAULT_MAX_TRANSFER_BYTES_PER_S,
                  busy_window_s: float = DEFAULT_BUSY_WINDOW_S, loss: str = DEFAULT_LOSS) -> tuple[LatencyProfile, dict[str, Any]]:
    """One fit over several runs (e.g. ON and OFF of one deployment). Each run keeps its own clock:
    which turns overlapped is decided within a run, never across two.

    ``busy_window_s`` 0 fits no busy term. The busy factor is in the report and the profile's
    provenance (``host_contention``), not in a profile field: :mod:`sim.engine.contention` replays it.
    """
    settings = settings or DeploymentSettings(block_size=0, kv_bytes_per_token=0.0)
    if max_transfer_bytes_per_s <= 0:
        raise ValueError("max_transfer_bytes_per_s must be > 0")
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    usable, busy = [], []
    for records in runs:
        # busy is decided over every record (a failed turn still occupied the cores), fitted on the usable ones
        for r, b in zip(records, busy_flags(records, busy_window_s)):
            if r.ok and math.isfinite(r.ttft_s) and r.prompt_tokens > 0:
                usable.append(r)
                busy.append(b)
    if len(usable) < len(TERMS) + 1:
        raise ValueError(f"need at least {len(TERMS) + 1} successful turns to fit, got {len(usable)}")
    a, flags, y = _ttft_rows(usable, busy)
    x, busy_factor, identifiable = _fit_ttft(a, flags, y, busy_window_s > 0, loss)
    fitted = dict(zip(TERMS, (float(v) for v in x)))
    predicted = np.array([predict_ttft(fitted, busy_factor, int(r.prompt_tokens), int(row[4]), bool(f))
                          for r, row, f in zip(usable, a, flags)])
    rel = (predicted - y) / y

    kept = []
    block_size = settings.block_size or base.block_size
    kv_bytes = settings.kv_bytes_per_token or base.kv_bytes_per_token
    if not settings.block_size:
        kept.append("block_size")
    if not settings.kv_bytes_per_token:
        kept.append("kv_bytes_per_token")
    updates: dict[str, Any] = {"block_size": block_size, "kv_bytes_per_token": kv_bytes,
                               "prefill_fixed_s": fitted["prefill_fixed_s"], "prefill_per_token_s": fitted["prefill_per_token_s"],
                               "prefill_attn_s": fitted["prefill_attn_s"], "attn_window_tokens": 0,
                               "prefill_index_s": 0.0, "ttft_overhead_fixed_s": 0.0,
                               "ttft_overhead_per_prompt_token_s": 0.0, "ttft_overhead_per_reused_byte_s": 0.0,
                               "handoff_pays_transfer_setup": False, "pull_setup_overlaps_prefill_fixed": False}
    report: dict[str, Any] = {"turns": len(usable), "turns_with_pull": int(np.sum(a[:, 3])), "turns_busy": int(flags.sum())}
    notes = []
    if identifiable[3]:
        updates["transfer_setup_s"] = fitted["transfer_setup_s"]
        updates["transfer_per_block_s"] = 0.0
        # TTFT cannot tell wire time from the rest of a pull's per-token cost, and the P->D hand-off of
        # every turn is already inside the fitted compute terms. Written as wire time (kv / cost), the
        # simulator would charge the hand-off a second time at that rate (130 MB/s fitted on the CPU rig:
        # +0.18 s on a 700-token first turn), and a ~0 cost gave 3e23-8e35 bytes/s. So the per-token cost
        # is the reuse overhead (paid by pulls only), and the wire runs at the bound.
        updates["reuse_overhead_per_token_s"] = fitted["per_pulled_token_s"]
        updates["transfer_bytes_per_s"] = max_transfer_bytes_per_s
        report["transfer_bytes_per_s_bounded"] = True
        notes.append(f"per-pulled-token cost written as reuse_overhead_per_token_s; transfer_bytes_per_s set to the bound "
                     f"{max_transfer_bytes_per_s:.3g} (--max-transfer-bytes-per-s): TTFT cannot separate wire time, "
                     "and the P->D hand-off is inside the fitted compute")
    else:
        notes.append("no turn pulled KV (an OFF run, or P did not report cached tokens): transfer terms kept from base")
    decode = _fit_decode(runs, loss)
    if decode is not None:
        updates.update(decode["values"])
        missing = [t for t, v in decode["terms"].items() if v is None]
        if missing:
            notes.append(f"decode: {', '.join(missing)} not identifiable (the regressor never varied: "
                         "e.g. one sequence at a time) and set to 0; the fixed term carries it")
    else:
        notes.append("decode: too few turns with two or more output tokens; decode terms kept from base")
    report.update({
        "terms": {t: (fitted[t] if ok else None) for t, ok in zip(TERMS, identifiable)},
        "busy_factor": busy_factor, "busy_window_s": busy_window_s, "loss": loss,
        "rel_error_p50": float(np.median(np.abs(rel))), "rel_error_max": float(np.max(np.abs(rel))),
        "decode": {k: v for k, v in decode.items() if k != "values"} if decode else None,
        "kept_from_base": sorted(set(f.name for f in dataclasses.fields(LatencyProfile)) - set(updates)
                                 - {"name", "model", "hardware", "tp", "provenance"}) + kept,
    })
    if notes:
        report["note"] = "; ".join(notes)
    profile = dataclasses.replace(base, name=name or f"{base.name}+bench", provenance={
        "source": "calibration.from_bench.fit_from_bench: bounded linear least squares (relative error) of per-turn "
                  "TTFT and TPOT from a bidikv bench JSONL", "base_profile": base.name,
        "host_contention": {"window_s": busy_window_s, "factor": busy_factor}, **report}, **updates)
    return profile, report
