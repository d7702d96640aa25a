"""The decode step's engine overheads, fitted once across the published decode measurements, and how far they carry.

Data: ``data/decode_published.csv`` (calibration.decode_published). A row enters the fit when it is vLLM on a GPU
with a hardware preset (calibration.hardware: H100 SXM = p5, H200 = p5en/p5e, B200 = p6-b200), without
speculative decoding, states TP, the requests in flight and the input and output lengths, and its model has a
config.json here (:data:`MODEL_CONFIGS`); the held-out row (vLLM PR #32553) never does. Every other row is listed
with the reason it is out (``python -m calibration.decode_fit --excluded``).

Model (calibration.decode_step): each row's mean TPOT = one decode step at B = the requests in flight (capped by
the requests sent and by the sequences of input + output tokens the KV pool holds) and c = input + output / 2
tokens of context, plus, in an aggregated closed- or open-loop run, the (B - 1) prefills of replacing requests
chunked into its steps, spread over its output tokens. Five parameters
(``hbm_efficiency``, per layer, per all-reduce, per sequence, ``mixed_prefill_mfu``) minimise the
log ratio predicted / measured, each model's rows weighted 1 / its row count (every model counts once), squared
up to 15 % and linear beyond (soft L1: a few published runs are outliers no step model explains), bounded
(scipy.optimize.least_squares).

How far it carries: leave one model out (fit on every other model's rows, predict this model's) and leave one
GPU out, per row and as median / max |error| (``python -m calibration.decode_fit``). ``bidikv profile`` uses the
all-rows fit (``data/decode_overheads.json``, written by ``--write``; a test refits it from the CSV).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Iterable, Sequence

from calibration.architecture import Architecture, architecture_from_config_file
from calibration.decode_published import DecodeFigure, load_decode_published
from calibration.decode_step import (WEIGHT_BYTES, DecodeOverheads, DecodePhysics, kv_capacity_sequences,
                                     prefill_compute_s, step_physics, step_s)
from calibration.efficiencies import HardwareEfficiencies
from calibration.hardware import DATA_DIR, Hardware, load_hardware
from calibration.error_bands import error_band

OVERHEADS_JSON = DATA_DIR / "decode_overheads.json"

# GPU named in the CSV -> the hardware preset holding its facts
GPU_PRESETS = {"H100 SXM": "p5", "H200": "p5en", "B200": "p6-b200"}

# model as the CSV names it (lower case, prefix) -> config.json in data/ (architecture only: the row's precision
# sets the weight bytes). Llama 3, 3.1 and 3.3 70B share one architecture.
MODEL_CONFIGS = {
    "llama-3.3-70b": "config_llama-3.3-70b.json",
    "meta-llama-3-70b": "config_llama-3.3-70b.json",
    "meta-llama-3.1-70b": "config_llama-3.3-70b.json",
    "llama-3.1-70b": "config_llama-3.3-70b.json",
    "mistral-7b": "config_mistral-7b-v0.3.json",
    "mixtral-8x7b": "config_mixtral-8x7b.json",
    "qwen3-8b": "config_qwen3-8b.json",
    "qwen3-14b": "config_qwen3-14b.json",
    "qwen3-32b": "config_qwen3-32b.json",
    "qwen3-30b-a3b": "config_qwen3-30b-a3b.json",
    "qwen3-235b-a22b": "config_qwen3-235b-a22b.json",
    "gpt-oss-20b": "config_gpt-oss-20b.json",
    "gpt-oss-120b": "config_gpt-oss-120b.json",
    "deepseek-r1": "config_deepseek-r1.json",
    "llama-3.1-8b": "config_llama-3.1-8b.json",
    "qwen2.5-72b": "config_qwen2.5-72b.json",
    "minimax-m2": "config_minimax-m2.json",
    "kimi-k2": "config_kimi-k2.json",
}

# A P/D decode instance runs no prefill between its steps, nor does an all-at-once run once its prompts are in
# (they are prefilled first); closed- and open-loop aggregated runs do.
MIXED_PREFILL_KINDS = ("max_concurrency", "request_rate")

PARAMS = ("hbm_efficiency", "per_layer_s", "per_allreduce_s", "per_seq_s", "mixed_prefill_mfu")
LOWER = (0.2, 0.0, 0.0, 0.0, 0.02)
UPPER = (1.0, 1e-3, 1e-3, 1e-3, 1.0)
START = (0.7, 30e-6, 10e-6, 20e-6, 0.3)
# Published runs include outliers no step model explains (an InferenceX gpt-oss run at concurrency 32 twice as slow as
# at 64): a robust loss (soft L1 beyond a 15 % log error) keeps one such row from moving every parameter.
ROBUST_SCALE = 0.15


def config_for(model: str) -> str | None:
    low = model.lower()
    for prefix, config in MODEL_CONFIGS.items():
        if low.startswith(prefix):
            return config
    return None


@dataclass(frozen=True, slots=True)
class DecodeRow:
    """One published row resolved for the fit: the architecture and hardware its physics needs."""

    figure: DecodeFigure
    model_key: str  # the config.json stem: rows of one architecture are one model for leave-one-out
    arch: Architecture
    hw: Hardware
    tp: int
    batch: float
    context_tokens: float
    mixed_prefill: bool
    physics: DecodePhysics  # what one step moves and computes: fixed by the row, whatever the overheads

    @property
    def measured_s(self) -> float:
        return self.figure.decode_ms_per_token / 1e3

    def label(self) -> str:
        f = self.figure
        return (f"{f.model} {f.precision} {f.gpu} TP{self.tp} B={self.batch:g} "
                f"{f.input_tokens:g}/{f.output_tokens:g}")


def exclusion(figure: DecodeFigure) -> str | None:
    """Why a published row cannot enter the fit, or None."""
    if figure.heldout:
        return "held out (vLLM PR #32553): predicted, never fitted"
    if not figure.is_vllm or figure.engine.lower() != "vllm":
        return f"engine {figure.engine}, not vLLM on CUDA"
    v0 = _v0_engine(figure)
    if v0:
        return v0
    if figure.spec_decode:
        return f"speculative decoding ({figure.spec_decode}): TPOT is not one step per token"
    if figure.gpu not in GPU_PRESETS:
        return f"no hardware preset for {figure.gpu}"
    if config_for(figure.model) is None:
        return f"no config.json here for {figure.model}"
    if figure.precision not in WEIGHT_BYTES:
        return f"precision {figure.precision}"
    missing = [n for n in ("num_gpus_tp", "batch_or_concurrency", "input_tokens", "output_tokens")
               if getattr(figure, n) is None]
    if missing:
        return f"not stated: {', '.join(missing)}"
    if figure.tpot_ms is None and figure.itl_ms is None:
        return "no TPOT or ITL (a per-user rate includes TTFT)"
    return None


# vLLM's V1 engine became the default in 0.8.0 (March 2025); this feature needs vLLM >= 0.21, so rows of the V0
# engine describe an engine nobody deploys it with. Lambda's vllm-benchmark runs (2024) name no version in their
# result files; their repository served v0.5.4-v0.6.0.
V1_FIRST = (0, 8)
V0_SOURCES = {"github.com/LambdaLabsML/vllm-benchmark": "2024 runs (the repository served vLLM v0.5.4-v0.6.0)",
              "github.com/triton-inference-server/triton_distributed": "an early-2025 example (before V1 was the default)"}


def _v0_engine(figure: DecodeFigure) -> str | None:
    for fragment, why in V0_SOURCES.items():
        if fragment in figure.source_url:
            return f"vLLM's V0 engine: {why}"
    digits = figure.engine_version.lstrip("v").split(".")
    try:
        version = (int(digits[0]), int(digits[1]))
    except (IndexError, ValueError):
        return None
    return f"vLLM's V0 engine ({figure.engine_version} < 0.8.0)" if version < V1_FIRST else None


@lru_cache(maxsize=None)
def _arch(config: str, kv_cache_dtype: str) -> Architecture:
    return architecture_from_config_file(DATA_DIR / config, kv_cache_dtype=kv_cache_dtype,
                                         name=config.removeprefix("config_").removesuffix(".json"))


def resolve(figure: DecodeFigure) -> DecodeRow:
    config = config_for(figure.model)
    assert config is not None and figure.num_gpus_tp and figure.batch_or_concurrency
    assert figure.input_tokens is not None and figure.output_tokens is not None
    kv = "fp8" if figure.kv_cache_dtype.lower().startswith("fp8") else "auto"
    batch = float(figure.batch_or_concurrency)
    if figure.num_requests:
        batch = min(batch, float(figure.num_requests))
    arch, hw = _arch(config, kv), load_hardware(GPU_PRESETS[figure.gpu])
    fits = kv_capacity_sequences(arch, hw, figure.num_gpus_tp, figure.precision, figure.input_tokens + figure.output_tokens)
    batch = max(1.0, min(batch, float(int(fits))))  # more requests than the KV pool holds queue; they do not decode
    context = figure.input_tokens + figure.output_tokens / 2
    return DecodeRow(figure=figure, model_key=config.removeprefix("config_").removesuffix(".json"),
                     arch=arch, hw=hw, tp=figure.num_gpus_tp, batch=batch, context_tokens=context,
                     mixed_prefill=figure.serving == "aggregated" and figure.concurrency_kind in MIXED_PREFILL_KINDS,
                     physics=step_physics(arch, hw, figure.num_gpus_tp, figure.precision, batch, context))


def split_rows(figures: Iterable[DecodeFigure]) -> tuple[list[DecodeRow], list[tuple[DecodeFigure, str]]]:
    rows, out = [], []
    for f in figures:
        reason = exclusion(f)
        if reason is None:
            rows.append(resolve(f))
        else:
            out.append((f, reason))
    return rows, out


def predict_s(row: DecodeRow, o: DecodeOverheads) -> float:
    precision = row.figure.precision
    t = step_s(row.physics, row.hw, precision, row.batch, o)
    if row.mixed_prefill and row.batch > 1:
        f = row.figure
        prefill = prefill_compute_s(row.arch, row.hw, row.tp, precision, f.input_tokens, o.mixed_prefill_mfu)
        t += (row.batch - 1) * prefill / f.output_tokens
    return t


def overheads_from(x: Sequence[float]) -> DecodeOverheads:
    return DecodeOverheads(**dict(zip(PARAMS, (float(v) for v in x))))


def fit(rows: Sequence[DecodeRow]) -> DecodeOverheads:
    """Bounded least squares on log(predicted / measured) over ``rows``."""
    import numpy as np
    from scipy.optimize import least_squares

    if not rows:
        raise ValueError("decode fit: no rows to fit")
    measured = np.array([r.measured_s for r in rows])
    per_model = Counter(r.model_key for r in rows)
    # every model counts once, however many rows its page published: the terms must carry across models, and one
    # model's 29-row sweep would otherwise set them for all
    weight = np.sqrt(np.array([1.0 / per_model[r.model_key] for r in rows]))
    scale = np.array(START)  # fit in units of the start point: the parameters span six decades

    def residuals(z: np.ndarray) -> np.ndarray:
        o = overheads_from(z * scale)
        return weight * np.log(np.array([predict_s(r, o) for r in rows]) / measured)

    sol = least_squares(residuals, np.ones(len(PARAMS)), bounds=(np.array(LOWER) / scale, np.array(UPPER) / scale),
                        method="trf", x_scale="jac", loss="soft_l1", f_scale=ROBUST_SCALE)
    return overheads_from(sol.x * scale)


def _errors(rows: Sequence[DecodeRow], o: DecodeOverheads, held_out: str, trained_on: str) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        p = predict_s(r, o)
        out.append({"held_out": held_out, "trained_on": trained_on, "row": r.label(), "model": r.model_key,
                    "gpu": r.figure.gpu, "measured_ms": 1e3 * r.measured_s, "predicted_ms": 1e3 * p,
                    "rel_error": p / r.measured_s - 1.0, "source_url": r.figure.source_url})
    return out


def leave_one_out(rows: Sequence[DecodeRow], key: Callable[[DecodeRow], str]) -> list[dict[str, Any]]:
    """Per group of ``key``: fit on every other group's rows, predict this group's."""
    groups = sorted({key(r) for r in rows})
    out: list[dict[str, Any]] = []
    for g in groups:
        train = [r for r in rows if key(r) != g]
        test = [r for r in rows if key(r) == g]
        if not train:
            continue
        out += _errors(test, fit(train), g, f"{len(train)} rows of {', '.join(sorted({key(r) for r in train}))}")
    return out


def by_model(r: DecodeRow) -> str:
    return r.model_key


def by_gpu(r: DecodeRow) -> str:
    return r.figure.gpu


def summarise(errors: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[str, list[float]] = {}
    for e in errors:
        groups.setdefault(e["held_out"], []).append(e["rel_error"])
    rows = [{"held_out": g, **error_band(v)} for g, v in groups.items()]
    if errors:
        # two medians: over every held-out row (a model with a long sweep weighs more) and over the held-out groups'
        # own medians (every model, or GPU, once)
        rows.append({"held_out": "all", **error_band([e["rel_error"] for e in errors]),
                     "median_of_group_medians": statistics.median(r["median_abs_error"] for r in rows)})
    return rows


def fitted_rows() -> list[DecodeRow]:
    return split_rows(load_decode_published())[0]


DECODE_COMMAND = "python -m calibration.decode_fit"


def overheads_record(rep: dict[str, Any]) -> dict[str, Any]:
    """What ``--write`` ships: the all-rows fit and the leave-one-out summaries ``bidikv profile`` prints."""
    rows = rep["residuals"]
    return {"_source": "calibration.decode_fit: bounded robust least squares on log(predicted/measured) TPOT over "
                       f"{len(rows)} rows of data/decode_published.csv ({DECODE_COMMAND} --write)",
            "models": sorted({r["model"] for r in rows}), "gpus": sorted({r["gpu"] for r in rows}),
            "rows": len(rows), **rep["overheads"],
            "leave_one_model_out_summary": rep["leave_one_model_out_summary"],
            "leave_one_gpu_out_summary": rep["leave_one_gpu_out_summary"]}


def load_record() -> dict[str, Any]:
    return json.loads(OVERHEADS_JSON.read_text())


@lru_cache(maxsize=1)
def load_overheads() -> DecodeOverheads:
    """The shipped all-rows fit (``data/decode_overheads.json``)."""
    data = load_record()
    return overheads_from([data[p] for p in PARAMS])


DECODE_SOURCE = "published vLLM decode measurements across models and GPUs (calibration.decode_fit)"


def with_decode_overheads(eff: HardwareEfficiencies, o: DecodeOverheads | None = None) -> HardwareEfficiencies:
    """``eff`` with its decode terms replaced by the cross-model decode fit's (the shipped one by default): every
    efficiency calibration.fit builds carries them, so the shipped profiles and ``bidikv profile`` decode alike."""
    o = o or load_overheads()
    return dataclasses.replace(eff, hbm_efficiency=o.hbm_efficiency, decode_per_layer_overhead_s=o.per_layer_s,
                               decode_per_allreduce_s=o.per_allreduce_s, decode_per_seq_overhead_s=o.per_seq_s)


def report() -> dict[str, Any]:
    rows, excluded = split_rows(load_decode_published())
    every = fit(rows)
    lomo = leave_one_out(rows, by_model)
    logo = leave_one_out(rows, by_gpu)
    return {"overheads": dataclasses.asdict(every), "rows": len(rows),
            "residuals": _errors(rows, every, "none", "all rows"),
            "leave_one_model_out": lomo, "leave_one_model_out_summary": summarise(lomo),
            "leave_one_gpu_out": logo, "leave_one_gpu_out_summary": summarise(logo),
            "excluded": [{"row": f"{f.model} {f.gpu} {f.engine}", "reason": why} for f, why in excluded]}


def _pct(x: float) -> str:
    return f"{100 * x:+.1f} %"


def format_summary_markdown(summary: Sequence[dict[str, Any]], what: str) -> str:
    lines = [f"| {what} held out | rows | \\|error\\| median | \\|error\\| max | signed range |",
             "|---|---:|---:|---:|---|"]
    for s in summary:
        name = f"**{s['held_out']}** (every row)" if s["held_out"] == "all" else s["held_out"]
        lines.append(f"| {name} | {s['points']} | {100 * s['median_abs_error']:.1f} % | {100 * s['max_abs_error']:.1f} % "
                     f"| {_pct(s['min_error'])} to {_pct(s['max_error'])} |")
        if s["held_out"] == "all":
            lines.append(f"| **median of the {what}s' medians** | {len(summary) - 1} {what}s | "
                         f"{100 * s['median_of_group_medians']:.1f} % | | |")
    return "\n".join(lines)


def format_text(rep: dict[str, Any], excluded: bool = False) -> str:
    o = rep["overheads"]
    lines = [f"decode step fitted on {rep['rows']} published rows (data/decode_published.csv):",
             f"  hbm_efficiency {o['hbm_efficiency']:.3f}, per layer {1e6 * o['per_layer_s']:.1f} us, "
             f"per all-reduce {1e6 * o['per_allreduce_s']:.1f} us, per sequence {1e6 * o['per_seq_s']:.1f} us, "
             f"mixed prefill {100 * o['mixed_prefill_mfu']:.1f} % of peak",
             "", "residuals of the all-rows fit:"]
    lines += [f"  {r['row']:58} measured {r['measured_ms']:7.2f} ms  fitted {r['predicted_ms']:7.2f} ms  "
              f"{_pct(r['rel_error']):>9}" for r in rep["residuals"]]
    for title, key in (("leave one model out", "leave_one_model_out"), ("leave one GPU out", "leave_one_gpu_out")):
        lines += ["", f"{title} (fit on the others, predict these):"]
        lines += [f"  {r['row']:58} measured {r['measured_ms']:7.2f} ms  predicted {r['predicted_ms']:7.2f} ms  "
                  f"{_pct(r['rel_error']):>9}" for r in rep[key]]
        lines += [f"  {s['held_out']:22} {s['points']:3d} rows  |error| median {100 * s['median_abs_error']:5.1f} %, "
                  f"max {100 * s['max_abs_error']:5.1f} % ({_pct(s['min_error'])} to {_pct(s['max_error'])})"
                  + (f"; median of the groups' medians {100 * s['median_of_group_medians']:.1f} %"
                     if s["held_out"] == "all" else "")
                  for s in rep[key + "_summary"]]
    if excluded:
        lines += ["", "not in the fit:"] + [f"  {e['row']:50} {e['reason']}" for e in rep["excluded"]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m calibration.decode_fit", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write the all-rows fit to {OVERHEADS_JSON.name}")
    parser.add_argument("--markdown", action="store_true", help="print the leave-one-out summaries as markdown")
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    parser.add_argument("--excluded", action="store_true", help="also list the rows not in the fit, with why")
    args = parser.parse_args(argv)
    rep = report()
    if args.json:
        print(json.dumps(rep, indent=2))
    elif args.markdown:
        print(format_summary_markdown(rep["leave_one_model_out_summary"], "model"))
        print()
        print(format_summary_markdown(rep["leave_one_gpu_out_summary"], "GPU"))
    else:
        print(format_text(rep, args.excluded))
    if args.write:
        OVERHEADS_JSON.write_text(json.dumps(overheads_record(rep), indent=2, sort_keys=True) + "\n")
        print(f"wrote {OVERHEADS_JSON}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
