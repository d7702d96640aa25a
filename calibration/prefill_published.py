"""Prefill carried to other models and GPUs: the TTFT of published vLLM runs at concurrency 1, predicted by what
``bidikv profile`` builds for them.

The rows are calibration.decode_published's with a TTFT, one request in flight, vLLM's V1 engine on a GPU with a
hardware preset, a config.json here (calibration.decode_fit's rules) and a checkpoint precision the prefill model
runs (the config's: BF16, or FP8 when its quantization_config says so). In an aggregated run the prefill forward
itself samples the first token, so TTFT is predicted as that forward: ``LatencyProfile.prefill_step_s`` of the
input with nothing cached, from the profile ``bidikv profile --model-config ... --hardware ... --tp ...`` builds
(its kernel family's prefill terms, fitted on p5en and carried to the row's GPU). What the API server adds
(tokenising, streaming the first chunk) is not in it.

``python -m calibration.prefill_published`` prints every row and the median / max |error| per model.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Sequence

from calibration.architecture import DTYPE_BYTES, Architecture, architecture_from_config_file
from calibration.build import profile_from_architecture
from calibration.decode_fit import GPU_PRESETS, config_for, exclusion
from calibration.decode_published import DecodeFigure, load_decode_published
from calibration.hardware import DATA_DIR, load_hardware
from calibration.error_bands import error_band
from calibration.portable import carried_efficiencies, kernel_family

PRECISION_DTYPE = {"BF16": "bf16", "FP16": "bf16", "FP8": "fp8"}


def usable(f: DecodeFigure) -> str | None:
    """Why a row cannot be a prefill point, or None."""
    why = exclusion(f)
    if why:
        return why
    if f.ttft_ms is None:
        return "no TTFT"
    if f.batch_or_concurrency != 1:
        return "more than one request in flight (TTFT includes waiting)"
    arch = _arch(f)
    if PRECISION_DTYPE.get(f.precision) != arch.weight_dtype or arch.weight_dtype not in DTYPE_BYTES:
        return f"{f.precision} checkpoint, the config's matmuls run {arch.weight_dtype}"
    return None


def _arch(f: DecodeFigure) -> Architecture:
    return architecture_from_config_file(DATA_DIR / config_for(f.model))  # type: ignore[operator]


def rows(figures: Sequence[DecodeFigure] | None = None) -> list[dict[str, Any]]:
    out = []
    for f in figures if figures is not None else load_decode_published():
        if usable(f) is not None:
            continue
        hw = load_hardware(GPU_PRESETS[f.gpu])
        arch = _arch(f)
        tp = f.num_gpus_tp or 1
        eff, carried_from, _ = carried_efficiencies(arch)
        # the row ran, so its weights fit: above vLLM's default gpu_memory_utilization if need be (Qwen2.5-72B in BF16
        # on two 80 GB H100s); only the decode KV budget depends on it, and TTFT does not
        needed = min(1.0, 1.01 * arch.weight_bytes() / (tp * hw.hbm_bytes_per_gpu))
        eff = dataclasses.replace(eff, gpu_memory_utilization=max(eff.gpu_memory_utilization, needed))
        profile = profile_from_architecture(DATA_DIR / config_for(f.model), hw, tp, eff)  # type: ignore[operator]
        n = int(round(f.input_tokens or 0))
        predicted = 1e3 * profile.prefill_step_s(((n, 0),))
        out.append({"model": f.model, "gpu": f.gpu, "tp": f.num_gpus_tp, "input_tokens": n,
                    "family": kernel_family(arch).describe(),
                    "prefill_from": carried_from, "measured_ms": f.ttft_ms,
                    "predicted_ms": predicted, "rel_error": predicted / f.ttft_ms - 1, "source_url": f.source_url})
    return out


def summary(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], list[float]] = {}
    for p in points:
        groups.setdefault((f"{p['model']} ({p['gpu']} TP{p['tp']})", p["family"]), []).append(p["rel_error"])
    return [{"model": m, "family": fam, **error_band(e)} for (m, fam), e in groups.items()]


def main(argv: Sequence[str] | None = None) -> int:
    points = rows()
    for p in points:
        print(f"{p['model']:24} {p['gpu']:9} TP{p['tp']} {p['input_tokens']:6d} tokens  measured {p['measured_ms']:8.1f} ms"
              f"  predicted {p['predicted_ms']:8.1f} ms  {100 * p['rel_error']:+7.1f} %")
    print("\n| predicted (prefill terms from) | family | points | \\|error\\| median | \\|error\\| max | signed range |")
    print("|---|---|---:|---:|---:|---|")
    for s in summary(points):
        print(f"| {s['model']} | {s['family']} | {s['points']} | {100 * s['median_abs_error']:.1f} % | "
              f"{100 * s['max_abs_error']:.1f} % | {100 * s['min_error']:+.1f} % to {100 * s['max_error']:+.1f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
