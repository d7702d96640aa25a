"""Fit the latency models to the published figures; write the profiles and the hardware efficiencies.

What is fitted: the hardware-efficiency vector x (one entry per term, each with a unit and a cause,
see :data:`FIT_TERMS`). Every published metric is linear in x through the closed form
(calibration.closed_form: the simulator's assembly) and the per-model builders (calibration.compose), so

    predicted = c + A x,     minimise  sum_i log(predicted_i / measured_i)^2
                             subject to x >= physical lower bounds

a bounded least-squares problem (``scipy.optimize.least_squares``, started from the bounded linear
least-squares solution on relative errors, ``lsq_linear``). The log ratio treats over- and
under-prediction alike (a relative error cannot go below -100 %, so relative least squares favours
under-predicting when no parameter set fits, as in the two-model fit); for small errors it equals the
relative error. A and c are read off the
closed form itself (one evaluation per term), never re-derived, so the fit and the reported numbers
cannot drift apart. Lower bounds are physics: every MFU and the EFA efficiency <= 1 (cost factors >= 1),
every time >= 0. ``minimax_bound`` (``scipy.optimize.linprog``) is the smallest max relative error any x
within the bounds reaches: when it exceeds 3 %, no choice of parameters gets every figure within 3 %
under this model and assembly, whatever the fit's objective.

Fits run here:

* per measured model (its ten figures), the EFA efficiency fixed at the two-model value (one model's
  transfers cannot separate the bytes term from the per-descriptor term): the shipped profiles
  ``calibration/profiles/<model>@p5en-tp8.json``;
* both models at once, every efficiency shared: ``calibration/data/p5en_efficiencies.json`` (the
  compromise; profiles for unmeasured models carry calibration.shared_fit's split instead, with these
  prefill terms only for a kernel family nobody measured);
* leave one model out: fit on one model (EFA efficiency fixed at line rate, nothing from the other
  model), predict the other model's ten figures from its architecture alone.

Run ``python -m calibration.fit`` to print, ``--write`` to overwrite the shipped files, ``--assembly
serial`` to fit the all-in-series assembly instead of the shipped overlapped one (calibration.closed_form).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from calibration.architecture import Architecture, architecture_from_config_file
from calibration.compose import build_profile
from calibration.decode_fit import with_decode_overheads
from calibration.closed_form import OVERLAPPED_ASSEMBLY, SERIAL_ASSEMBLY, SHIPPED_ASSEMBLY, Assembly, turn_metrics
from calibration.efficiencies import HardwareEfficiencies, efficiencies_path
from calibration.floors import floor_rows
from calibration.hardware import Hardware, load_hardware
from calibration.profile import PROFILES_DIR, LatencyProfile
from calibration.published import MEASURED, BenchmarkShape, PublishedFigure, deployment, load_published

TOLERANCE = 0.03  # the fit's acceptance: every published figure within 3 %


@dataclass(frozen=True, slots=True)
class FitTerm:
    name: str
    lower: float  # physical lower bound
    scale: float  # a typical magnitude (the step that reads the term's column off the closed form)
    unit: str
    cause: str


FIT_TERMS = (
    FitTerm("prefill_fixed_per_layer_s", 0.0, 1e-3, "s per layer per forward pass",
            "fixed cost of a forward pass (launches, syncs, per-request work inside 'prefill duration')"),
    FitTerm("gemm_cost_factor", 1.0, 1.0, "1 / gemm_mfu", "linear layers at a fraction of dense peak FLOP/s"),
    FitTerm("attention_cost_factor", 1.0, 1.0, "1 / attention_mfu", "attention at a fraction of BF16 peak"),
    FitTerm("transfer_setup_s", 0.0, 1e-3, "s per transfer", "handshake, notification, scheduling of a read"),
    FitTerm("transfer_per_descriptor_s", 0.0, 1e-7, "s per NIXL descriptor", "per-descriptor work on every rank"),
    FitTerm("efa_cost_factor", 1.0, 1.0, "1 / efa_efficiency", "bytes at a fraction of EFA line rate"),
    FitTerm("reuse_overhead_per_token_s", 0.0, 1e-6, "s per reused token", "calibrated, not physical (ON)"),
    FitTerm("ttft_overhead_fixed_s", 0.0, 1e-3, "s", "proxy hops, D scheduling and first step"),
    FitTerm("ttft_overhead_per_prompt_token_s", 0.0, 1e-6, "s per prompt token",
            "D re-renders and re-tokenises the forwarded prompt"),
    FitTerm("ttft_overhead_per_reused_byte_s", 0.0, 1e-12, "s per reused KV byte", "calibrated, not physical (ON)"),
)
TERM_NAMES = tuple(t.name for t in FIT_TERMS)
_LOWER = np.array([t.lower for t in FIT_TERMS])
_SCALE = np.array([t.scale for t in FIT_TERMS])


def efficiencies_from_vector(x: Sequence[float], hardware: str, provenance: dict[str, Any] | None = None
                             ) -> HardwareEfficiencies:
    """The fitted terms, and the decode step's overheads from the cross-model decode fit (calibration.decode_fit):
    no published figure this fit sees constrains decode."""
    v = dict(zip(TERM_NAMES, (float(a) for a in x)))
    return with_decode_overheads(HardwareEfficiencies(
        hardware=hardware,
        prefill_fixed_per_layer_s=v["prefill_fixed_per_layer_s"],
        gemm_mfu=1.0 / v["gemm_cost_factor"], attention_mfu=1.0 / v["attention_cost_factor"],
        transfer_setup_s=v["transfer_setup_s"], transfer_per_descriptor_s=v["transfer_per_descriptor_s"],
        efa_efficiency=1.0 / v["efa_cost_factor"],
        reuse_overhead_per_token_s=v["reuse_overhead_per_token_s"],
        ttft_overhead_fixed_s=v["ttft_overhead_fixed_s"],
        ttft_overhead_per_prompt_token_s=v["ttft_overhead_per_prompt_token_s"],
        ttft_overhead_per_reused_byte_s=v["ttft_overhead_per_reused_byte_s"],
        provenance=provenance or {}))


@dataclass(frozen=True, slots=True)
class Target:
    """A measured model as the fit sees it."""

    model: str
    profile_name: str
    arch: Architecture
    hw: Hardware
    tp: int

    def profile(self, eff: HardwareEfficiencies, provenance: dict[str, Any] | None = None) -> LatencyProfile:
        return build_profile(self.arch, self.hw, self.tp, eff, name=self.profile_name, model=self.model,
                             provenance=provenance)


def target(model: str) -> Target:
    d = deployment(model)
    arch = architecture_from_config_file(d.config_path, kv_cache_dtype=d.kv_cache_dtype, name=d.model)
    return Target(d.model, d.profile_name, arch, load_hardware(d.hardware), d.tp)


def metric_s(profile: LatencyProfile, figure: PublishedFigure, shape: BenchmarkShape, assembly: Assembly) -> float:
    m = turn_metrics(profile, figure.prompt_tokens, figure.bidirectional, shape.user_tokens,
                     shape.local_hit_tokens, assembly)
    return m[f"{figure.metric}_s"]


def predict_s(figures: Sequence[PublishedFigure], targets: dict[str, Target], x: Sequence[float],
              shape: BenchmarkShape, assembly: Assembly) -> np.ndarray:
    out = []
    profiles: dict[str, LatencyProfile] = {}
    for fig in figures:
        t = targets[fig.model]
        if fig.model not in profiles:
            profiles[fig.model] = t.profile(efficiencies_from_vector(x, t.hw.key))
        out.append(metric_s(profiles[fig.model], fig, shape, assembly))
    return np.array(out)


def _reference_point() -> np.ndarray:
    """Where the columns are read: the lower bounds, with a non-zero fixed prefill cost so that the
    overlapped assembly's min(transfer setup, prefill fixed) is in its linear branch (setup < fixed)."""
    x = _LOWER.copy()
    x[TERM_NAMES.index("prefill_fixed_per_layer_s")] = 1e-3
    return x


def design(figures: Sequence[PublishedFigure], targets: dict[str, Target], shape: BenchmarkShape,
           assembly: Assembly) -> tuple[np.ndarray, np.ndarray]:
    """``(A, c)`` with predicted seconds = c + A x, read off the closed form term by term."""
    x0 = _reference_point()
    f0 = predict_s(figures, targets, x0, shape, assembly)
    cols = []
    for j, step in enumerate(_SCALE):
        x = x0.copy()
        x[j] += step
        cols.append((predict_s(figures, targets, x, shape, assembly) - f0) / step)
    a = np.column_stack(cols)
    return a, f0 - a @ x0


@dataclass
class FitResult:
    models: tuple[str, ...]
    assembly: Assembly
    fixed: dict[str, float]
    x: np.ndarray
    figures: list[PublishedFigure]
    fitted_ms: np.ndarray
    minimax_bound: float
    hardware: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rel_errors(self) -> np.ndarray:
        measured = np.array([f.measured_ms for f in self.figures])
        return self.fitted_ms / measured - 1.0

    @property
    def max_abs_rel_error(self) -> float:
        return float(np.max(np.abs(self.rel_errors)))

    def efficiencies(self, provenance: dict[str, Any] | None = None) -> HardwareEfficiencies:
        return efficiencies_from_vector(self.x, self.hardware, provenance)

    def parameters(self) -> dict[str, dict[str, Any]]:
        return {t.name: {"value": float(v), "unit": t.unit, "lower_bound": t.lower, "cause": t.cause,
                         "fixed": t.name in self.fixed, "at_bound": bool(np.isclose(v, t.lower, rtol=1e-9, atol=0))}
                for t, v in zip(FIT_TERMS, self.x)}

    def residual_rows(self) -> list[dict[str, Any]]:
        return [{"model": f.model, "prompt_tokens": f.prompt_tokens, "mode": f.mode, "metric": f.metric,
                 "measured_ms": f.measured_ms, "fitted_ms": float(p), "rel_error": float(e)}
                for f, p, e in zip(self.figures, self.fitted_ms, self.rel_errors)]


def solve_log_ratio(ms: np.ndarray, rhs: np.ndarray, lo: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Predicted / measured = 1 + ms z - rhs: the least-squares z on the log ratio (z >= lo), the
    minimax z and its max |relative error| (the smallest any z >= lo reaches; nan if the LP fails)."""
    from scipy.optimize import least_squares, linprog, lsq_linear

    hi = np.full(len(lo), np.inf)
    start = lsq_linear(ms, rhs, bounds=(lo, hi), method="bvls").x  # relative errors: linear, exact

    def log_ratio(z: np.ndarray) -> np.ndarray:  # log(predicted / measured)
        return np.log(np.maximum(1.0 + ms @ z - rhs, 1e-12))

    def jac(z: np.ndarray) -> np.ndarray:
        return ms / np.maximum(1.0 + ms @ z - rhs, 1e-12)[:, None]

    sol = least_squares(log_ratio, np.maximum(start, lo), jac=jac, bounds=(lo, hi), method="trf",
                        x_scale="jac", xtol=1e-12, ftol=1e-12, gtol=1e-12)
    z = np.where(sol.x - lo <= 1e-9 * np.maximum(1.0, np.abs(lo)), lo, sol.x)  # snap solver dust to the bound
    # minimax: min e  s.t. |ms z - rhs| <= e, z >= lo
    k, n = len(lo), len(rhs)
    cost = np.r_[np.zeros(k), 1.0]
    a_ub = np.block([[ms, -np.ones((n, 1))], [-ms, -np.ones((n, 1))]])
    b_ub = np.r_[rhs, -rhs]
    lp = linprog(cost, A_ub=a_ub, b_ub=b_ub, bounds=[(v, None) for v in lo] + [(0, None)], method="highs")
    if not lp.success:
        return z, z, float("nan")
    return z, lp.x[:k], float(lp.x[-1])


def fit(models: Sequence[str], *, figures: Sequence[PublishedFigure] | None = None,
        shape: BenchmarkShape = BenchmarkShape(), assembly: Assembly = SHIPPED_ASSEMBLY,
        fixed: dict[str, float] | None = None, objective: str = "lsq") -> FitResult:
    """Bounded linear least squares on relative errors of ``models``' published figures.

    ``objective="minimax"`` returns the linear program's solution instead (smallest max |error|; the
    other figures are then anywhere inside that band): a diagnostic, not what ships."""
    if objective not in ("lsq", "minimax"):
        raise ValueError(f"objective must be lsq or minimax, got {objective!r}")
    fixed = dict(fixed or {})
    unknown = sorted(set(fixed) - set(TERM_NAMES))
    if unknown:
        raise ValueError(f"unknown fit term(s) {unknown}; terms: {', '.join(TERM_NAMES)}")
    targets = {m: target(m) for m in models}
    hardware = {t.hw.key for t in targets.values()}
    if len(hardware) != 1:
        raise ValueError(f"a fit needs one hardware, got {sorted(hardware)}")
    figs = [f for f in (figures if figures is not None else load_published()) if f.model in targets]
    if not figs:
        raise ValueError(f"no published figures for {list(models)}")
    a, c = design(figs, targets, shape, assembly)
    y = np.array([f.measured_ms for f in figs]) / 1e3
    free = [j for j, name in enumerate(TERM_NAMES) if name not in fixed]
    x = _LOWER.copy()
    for name, value in fixed.items():
        x[TERM_NAMES.index(name)] = value
    fixed_idx = [j for j in range(len(TERM_NAMES)) if j not in free]
    rhs = 1.0 - (c + a[:, fixed_idx] @ x[fixed_idx]) / y
    m = a[:, free] / y[:, None]
    # solve in scaled units (x_j / scale_j) so the columns are comparable
    ms = m * _SCALE[free]
    lo = _LOWER[free] / _SCALE[free]
    z, lp_z, bound = solve_log_ratio(ms, rhs, lo)
    x[free] = (lp_z if objective == "minimax" else z) * _SCALE[free]
    fitted_ms = predict_s(figs, targets, x, shape, assembly) * 1e3  # the closed form itself, not A x
    if not np.allclose(fitted_ms, (c + a @ x) * 1e3, rtol=1e-7, atol=1e-6):
        raise RuntimeError("the closed form is not linear in the fit terms at the solution")
    return FitResult(tuple(models), assembly, fixed, x, figs, fitted_ms, bound, hardware.pop())


# --- the fits this project ships --------------------------------------------------------------------

def joint_fit(shape: BenchmarkShape = BenchmarkShape(), assembly: Assembly = SHIPPED_ASSEMBLY) -> FitResult:
    """Both models, every efficiency shared. Attention is fixed at its floor (MFU 1), where both
    single-model fits put it: left free, it absorbs GLM-5's slow linear layers (its attention is
    windowed, Qwen's is not) and the split stops meaning anything."""
    return fit([d.model for d in MEASURED], shape=shape, assembly=assembly,
               fixed={"attention_cost_factor": 1.0})


def model_fit(model: str, efa_cost_factor: float, shape: BenchmarkShape = BenchmarkShape(),
              assembly: Assembly = SHIPPED_ASSEMBLY) -> FitResult:
    return fit([model], shape=shape, assembly=assembly, fixed={"efa_cost_factor": efa_cost_factor})


def leave_one_out(shape: BenchmarkShape = BenchmarkShape(), assembly: Assembly = SHIPPED_ASSEMBLY
                  ) -> list[dict[str, Any]]:
    """Fit on one model (EFA at line rate), predict the other's figures from its architecture alone."""
    rows = []
    figures = load_published()
    models = [d.model for d in MEASURED]
    for train in models:
        trained = fit([train], shape=shape, assembly=assembly, fixed={"efa_cost_factor": 1.0})
        eff = trained.efficiencies()
        for test in models:
            if test == train:
                continue
            t = target(test)
            profile = t.profile(eff)
            for fig in (f for f in figures if f.model == test):
                predicted_ms = metric_s(profile, fig, shape, assembly) * 1e3
                rows.append({"trained_on": train, "model": test, "prompt_tokens": fig.prompt_tokens,
                             "mode": fig.mode, "metric": fig.metric, "measured_ms": fig.measured_ms,
                             "predicted_ms": predicted_ms, "rel_error": predicted_ms / fig.measured_ms - 1})
    return rows


def assembly_variants(efa_cost_factor: float, shape: BenchmarkShape = BenchmarkShape()) -> list[dict[str, Any]]:
    """Per model and assembly variant: the least-squares max |error| and the minimax bound, to show
    which proposed change buys what."""
    rows = []
    for handoff_setup in (True, False):
        for overlap in (False, True):
            assembly = Assembly(handoff_pays_transfer_setup=handoff_setup, pull_setup_overlaps_prefill_fixed=overlap)
            for d in MEASURED:
                r = model_fit(d.model, efa_cost_factor, shape, assembly)
                rows.append({"model": d.model, **assembly.describe(), "max_abs_rel_error": r.max_abs_rel_error,
                             "minimax_bound": r.minimax_bound})
    return rows


def _not_within(result: FitResult) -> list[dict[str, Any]]:
    return [r for r in result.residual_rows() if abs(r["rel_error"]) > TOLERANCE]


def fitted_profile(result: FitResult, other: FitResult | None = None,
                   shape: BenchmarkShape = BenchmarkShape()) -> LatencyProfile:
    """The shipped profile of a single-model fit, with its provenance and floors."""
    (model,) = result.models
    t = target(model)
    d = deployment(model)
    profile = dataclasses.replace(t.profile(result.efficiencies()),
                                  handoff_pays_transfer_setup=result.assembly.handoff_pays_transfer_setup,
                                  pull_setup_overlaps_prefill_fixed=result.assembly.pull_setup_overlaps_prefill_fixed)
    measured = {(f.prompt_tokens, "prefill_off"): f.measured_ms
                for f in result.figures if f.mode == "off" and f.metric == "prefill"}
    measured.update({(f.prompt_tokens, "transfer_on"): f.measured_ms
                     for f in result.figures if f.mode == "on" and f.metric == "transfer"})
    prompts = sorted({f.prompt_tokens for f in result.figures})
    provenance = {
        "source": "calibration.fit: bounded least squares (scipy.optimize.least_squares) on log(predicted/measured) "
                  "of the closed form (calibration.closed_form, under the profile's assembly) against "
                  "the published figures (calibration/data/published_figures.csv)",
        "inputs": {
            "figures": [{"prompt_tokens": f.prompt_tokens, "mode": f.mode, "metric": f.metric,
                         "measured_ms": f.measured_ms, "approximate": f.approximate, "source": f.source}
                        for f in result.figures],
            "config": f"calibration/data/{d.config_file}", "hardware": f"calibration/data/hardware_{d.hardware}.json",
            "tp": d.tp, "kv_cache_dtype": d.kv_cache_dtype, "benchmark": dataclasses.asdict(shape),
            "assembly": result.assembly.describe(), "fixed": result.fixed,
        },
        "architecture": t.arch.summary(t.tp),
        "parameters": result.parameters(),
        "residuals": result.residual_rows(),
        "max_abs_rel_error": result.max_abs_rel_error,
        "minimax_bound": result.minimax_bound,
        "not_within_3_percent": _not_within(result),
        "floors": floor_rows(profile, t.arch, t.hw, prompts, shape.user_tokens, measured),
    }
    if other is not None:
        provenance["other_assembly"] = {
            "assembly": other.assembly.describe(), "max_abs_rel_error": other.max_abs_rel_error,
            "minimax_bound": other.minimax_bound, "residuals": other.residual_rows(),
            "note": "errors of a refit under the other assembly of calibration.closed_form, for comparison"}
    return dataclasses.replace(profile, provenance=provenance)


def run(write: bool = False, assembly: Assembly = SHIPPED_ASSEMBLY, shape: BenchmarkShape = BenchmarkShape()
        ) -> dict[str, Any]:
    joint = joint_fit(shape, assembly)
    efa = float(joint.x[TERM_NAMES.index("efa_cost_factor")])
    per_model = {d.model: model_fit(d.model, efa, shape, assembly) for d in MEASURED}
    other = SERIAL_ASSEMBLY if assembly == OVERLAPPED_ASSEMBLY else OVERLAPPED_ASSEMBLY
    other_fits = {d.model: model_fit(d.model, efa, shape, other) for d in MEASURED}
    loo = leave_one_out(shape, assembly)
    profiles = {m: fitted_profile(r, other_fits.get(m), shape) for m, r in per_model.items()}
    eff = joint.efficiencies({
        "source": "calibration.fit.joint_fit: both measured models, every efficiency shared "
                  "(bounded least squares on log(predicted/measured), closed form)",
        "assembly": joint.assembly.describe(),
        "parameters": joint.parameters(),
        "residuals": joint.residual_rows(),
        "max_abs_rel_error": joint.max_abs_rel_error,
        "minimax_bound": joint.minimax_bound,
        "leave_one_out": loo,
    })
    if write:
        for p in profiles.values():
            (PROFILES_DIR / f"{p.name}.json").write_text(p.to_json())
        efficiencies_path(joint.hardware).write_text(eff.to_json())
    return {"joint": joint, "per_model": per_model, "other_assembly": other_fits, "leave_one_out": loo,
            "profiles": profiles, "efficiencies": eff}


def _print_fit(title: str, result: FitResult, out) -> None:
    print(f"\n{title}: max |error| {100 * result.max_abs_rel_error:.2f} %, best achievable max |error| "
          f"(minimax bound) {100 * result.minimax_bound:.2f} %", file=out)
    for r in result.residual_rows():
        flag = "" if abs(r["rel_error"]) <= TOLERANCE else "  > 3 %"
        print(f"  {r['model']:10} {r['prompt_tokens']:6d} {r['mode']:3} {r['metric']:8} "
              f"measured {r['measured_ms']:7.1f} ms  fitted {r['fitted_ms']:7.1f} ms  {100 * r['rel_error']:+6.2f} %{flag}",
              file=out)
    for name, p in result.parameters().items():
        mark = " (fixed)" if p["fixed"] else (" (at bound)" if p["at_bound"] else "")
        print(f"    {name:34} {p['value']:.6g} {p['unit']}{mark}", file=out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m calibration.fit", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="overwrite the shipped profiles and efficiencies")
    parser.add_argument("--assembly", choices=("overlapped", "serial"), default="overlapped",
                        help="how the parts assemble (calibration.closed_form; default: %(default)s, the shipped one)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    assembly = OVERLAPPED_ASSEMBLY if args.assembly == "overlapped" else SERIAL_ASSEMBLY
    res = run(write=args.write, assembly=assembly)
    if args.json:
        print(json.dumps({"joint": res["joint"].residual_rows(),
                          "per_model": {m: r.residual_rows() for m, r in res["per_model"].items()},
                          "leave_one_out": res["leave_one_out"]}, indent=2))
        return 0
    out = sys.stdout
    print(f"assembly: {assembly.describe()}", file=out)
    for m, r in res["per_model"].items():
        _print_fit(f"{m} (own figures)", r, out)
    for m, r in res["other_assembly"].items():
        _print_fit(f"{m} under the other assembly", r, out)
    _print_fit("both models, shared efficiencies", res["joint"], out)
    print("\nassembly variants (per-model fits): least-squares max |error| / minimax bound", file=out)
    efa = float(res["joint"].x[TERM_NAMES.index("efa_cost_factor")])
    for r in assembly_variants(efa):
        print(f"  {r['model']:10} handoff pays setup={r['handoff_pays_transfer_setup']!s:5} "
              f"pull setup overlaps fixed={r['pull_setup_overlaps_prefill_fixed']!s:5}  "
              f"{100 * r['max_abs_rel_error']:6.2f} % / {100 * r['minimax_bound']:6.2f} %", file=out)
    print("\nleave one model out (trained on -> predicted):", file=out)
    for r in res["leave_one_out"]:
        print(f"  {r['trained_on']:10} -> {r['model']:10} {r['prompt_tokens']:6d} {r['mode']:3} {r['metric']:8} "
              f"measured {r['measured_ms']:7.1f} predicted {r['predicted_ms']:8.1f} ms {100 * r['rel_error']:+7.1f} %",
              file=out)
    if args.write:
        print("\nwrote: " + ", ".join(str(PROFILES_DIR / f"{p.name}.json") for p in res["profiles"].values())
              + f", {efficiencies_path(res['joint'].hardware)}", file=out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
