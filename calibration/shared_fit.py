"""Which fitted terms are the engine's and which are the model's: both measured models fitted at once,
some terms shared, the rest one value per model.

calibration.portable calls the transfer, reuse and TTFT terms engine overheads (seconds that do not
follow from a model's size) and the GEMM/attention fractions of peak and the fixed cost per forward
kernel-family properties. This module tests that split on the data: if a term is the engine's, one value
for both models should fit the twenty published figures about as well as each model's own fit does; if
sharing it costs a lot, it belongs to the model (or its kernels) and cannot be carried to another one.

    predicted_i = c_i + A_i x_{model(i)},   x_m = shared terms + model m's own terms

solved like calibration.fit (least squares on log(predicted / measured), physical bounds, the minimax
bound beside it). ``python -m calibration.shared_fit`` prints every variant of :data:`VARIANTS`.
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from calibration.closed_form import SHIPPED_ASSEMBLY, Assembly
from calibration.fit import _LOWER, _SCALE, TERM_NAMES, design, predict_s, solve_log_ratio, target
from calibration.published import MEASURED, BenchmarkShape, PublishedFigure, load_published

PREFILL_EFFICIENCIES = ("gemm_cost_factor", "attention_cost_factor")
# variant name -> the terms each model fits for itself (every other term is one value for both)
VARIANTS: dict[str, tuple[str, ...]] = {
    "every term per model": tuple(TERM_NAMES),
    "engine overheads shared; prefill fixed cost and GEMM/attention efficiency per model":
        ("prefill_fixed_per_layer_s",) + PREFILL_EFFICIENCIES,
    "engine overheads and prefill fixed cost shared; GEMM/attention efficiency per model": PREFILL_EFFICIENCIES,
    "every term shared (the two-model compromise, data/p5en_efficiencies.json)": (),
}


@dataclass(frozen=True)
class SharedFit:
    per_model_terms: tuple[str, ...]
    x: dict[str, np.ndarray]  # model -> full term vector
    rows: list[dict[str, Any]]
    minimax_bound: float

    def max_abs_error(self, model: str) -> float:
        return max(abs(r["rel_error"]) for r in self.rows if r["model"] == model)

    def value(self, model: str, term: str) -> float:
        return float(self.x[model][TERM_NAMES.index(term)])


def fit_shared(per_model_terms: Sequence[str], *, shape: BenchmarkShape = BenchmarkShape(),
               assembly: Assembly = SHIPPED_ASSEMBLY, fixed: dict[str, float] | None = None,
               figures: Sequence[PublishedFigure] | None = None) -> SharedFit:
    """Both measured models' figures (default: the published ones); ``per_model_terms`` take one value
    per model, the rest one shared value."""
    fixed = dict(fixed or {})
    unknown = sorted((set(per_model_terms) | set(fixed)) - set(TERM_NAMES))
    if unknown:
        raise ValueError(f"unknown fit term(s) {unknown}; terms: {', '.join(TERM_NAMES)}")
    models = [d.model for d in MEASURED]
    targets = {m: target(m) for m in models}
    figures = list(figures if figures is not None else load_published())
    blocks = []  # (model, figures, A, c)
    for m in models:
        figs = [f for f in figures if f.model == m]
        a, c = design(figs, {m: targets[m]}, shape, assembly)
        blocks.append((m, figs, a, c))
    columns: list[tuple[int, str | None]] = []  # (term index, model or None when shared)
    for j, name in enumerate(TERM_NAMES):
        if name in fixed:
            continue
        columns += [(j, m) for m in models] if name in per_model_terms else [(j, None)]
    x_fixed = np.zeros(len(TERM_NAMES))
    for name, v in fixed.items():
        x_fixed[TERM_NAMES.index(name)] = v
    ms_rows, rhs, ys = [], [], []
    for m, figs, a, c in blocks:
        y = np.array([f.measured_ms for f in figs]) / 1e3
        rhs.append(1.0 - (c + a @ x_fixed) / y)
        ms_rows.append(np.column_stack([a[:, j] * _SCALE[j] if owner in (None, m) else np.zeros(len(figs))
                                        for j, owner in columns]) / y[:, None])
        ys.append(y)
    lo = np.array([_LOWER[j] / _SCALE[j] for j, _ in columns])
    z, _, bound = solve_log_ratio(np.vstack(ms_rows), np.concatenate(rhs), lo)
    x = {m: x_fixed.copy() for m in models}
    for (j, owner), v in zip(columns, z):
        for m in ([owner] if owner else models):
            x[m][j] = v * _SCALE[j]
    rows = []
    for m, figs, _, _ in blocks:
        fitted = predict_s(figs, {m: targets[m]}, x[m], shape, assembly) * 1e3  # the closed form, not A x
        rows += [{"model": m, "prompt_tokens": f.prompt_tokens, "mode": f.mode, "metric": f.metric,
                  "measured_ms": f.measured_ms, "fitted_ms": float(p), "rel_error": float(p) / f.measured_ms - 1}
                 for f, p in zip(figs, fitted)]
    return SharedFit(tuple(per_model_terms), x, rows, bound)


ENGINE_SHARED = VARIANTS["engine overheads shared; prefill fixed cost and GEMM/attention efficiency per model"]


def _fixed_for(per_model_terms: Sequence[str]) -> dict[str, float] | None:
    """Attention at its floor when it is shared: left free, one value cannot serve a windowed (GLM) and a
    dense (Qwen) attention, and it absorbs GLM-5's slow GEMMs (as calibration.fit.joint_fit says)."""
    return None if "attention_cost_factor" in per_model_terms else {"attention_cost_factor": 1.0}


@functools.lru_cache(maxsize=None)
def carried_fit() -> SharedFit:
    """What profiles for unmeasured models carry: engine overheads fitted on both models at once, the
    prefill fixed cost and GEMM/attention efficiency per model (kernel family)."""
    return fit_shared(ENGINE_SHARED, fixed=_fixed_for(ENGINE_SHARED))


@functools.lru_cache(maxsize=None)
def compromise_fit() -> SharedFit:
    """Every term shared: the prefill terms a model of an unmeasured kernel family falls back to."""
    return fit_shared((), fixed=_fixed_for(()))


def variant_rows(shape: BenchmarkShape = BenchmarkShape(), assembly: Assembly = SHIPPED_ASSEMBLY
                 ) -> list[dict[str, Any]]:
    """Per variant: each model's max |error|, the minimax bound, and the shared terms' values."""
    out = []
    for name, own in VARIANTS.items():
        result = fit_shared(own, shape=shape, assembly=assembly, fixed=_fixed_for(own))
        first = MEASURED[0].model
        out.append({"variant": name, "per_model_terms": list(own), "minimax_bound": result.minimax_bound,
                    "max_abs_error": {d.model: result.max_abs_error(d.model) for d in MEASURED},
                    "shared": {t: result.value(first, t) for t in TERM_NAMES if t not in own},
                    "per_model": {d.model: {t: result.value(d.model, t) for t in own} for d in MEASURED}})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m calibration.shared_fit", description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    for r in variant_rows():
        errors = ", ".join(f"{m} {100 * e:.1f} %" for m, e in r["max_abs_error"].items())
        print(f"{r['variant']}\n  max |error|: {errors}; minimax bound {100 * r['minimax_bound']:.1f} %")
        if r["shared"]:
            print("  shared: " + ", ".join(f"{t} {v:.4g}" for t, v in r["shared"].items()))
        for m, terms in r["per_model"].items():
            if terms:
                print(f"  {m}: " + ", ".join(f"{t} {v:.4g}" for t, v in terms.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
