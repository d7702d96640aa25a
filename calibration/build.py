"""Profiles from an architecture: config.json + hardware + TP + hardware efficiencies -> LatencyProfile.

``profile_from_architecture`` is what ``bidikv profile --model-config config.json --hardware p5en --tp N``
runs: calibration.compose turns the efficiencies into the profile, calibration.portable says which
efficiencies a model nobody measured carries and where each field comes from.
"""

from __future__ import annotations

import dataclasses
import pathlib

from calibration.architecture import Architecture, architecture_from_config_file
from calibration.compose import build_profile
from calibration.decode_fit import DECODE_SOURCE, load_record
from calibration.efficiencies import HardwareEfficiencies, efficiencies_path, load_efficiencies
from calibration.floors import floor_rows
from calibration.hardware import MEASURED_ON, Hardware, load_hardware
from calibration.portable import ENGINE_SOURCE, carried_efficiencies, field_sources, kernel_family
from calibration.published import MEASURED
from calibration.profile import LatencyProfile

DEFAULT_FLOOR_PROMPTS = (2048, 24576)


def profile_from_architecture(config_path: str | pathlib.Path, hardware: str | Hardware = "p5en", tp: int = 8,
                              efficiencies: HardwareEfficiencies | str | None = None, *, name: str | None = None,
                              kv_cache_dtype: str = "auto", block_size: int | None = None,
                              user_tokens: int = 140) -> LatencyProfile:
    """A profile for a model nobody measured: its architecture with efficiencies fitted elsewhere.

    ``efficiencies`` defaults, on the hardware the measured models ran on, to calibration.portable's
    carried fit (engine overheads from both measured models, prefill terms from the same kernel family
    or the compromise), elsewhere to ``calibration/data/<hardware>_efficiencies.json``. The provenance
    says which, field by field.
    """
    hw = hardware if isinstance(hardware, Hardware) else load_hardware(hardware)
    arch = architecture_from_config_file(config_path, kv_cache_dtype=kv_cache_dtype, name=name)
    caveats: list[str] = []
    if efficiencies is None:
        eff, family_source, engine_source, same_family = _default_efficiencies(arch, hw)
        caveats = hardware_caveats(hw, carried=_carried_suffix(hw) in engine_source)
    else:
        eff = efficiencies if isinstance(efficiencies, HardwareEfficiencies) else load_efficiencies(efficiencies)
        family_source = engine_source = f"given efficiencies ({efficiencies if isinstance(efficiencies, str) else 'object'})"
        same_family = False
        caveats = hardware_caveats(hw, carried=False)  # given terms are not borrowed, but Neuron is still unknown
    model = name or arch.name
    # every efficiency calibration.fit builds carries the cross-model decode fit; given ones carry their own
    decode_source = DECODE_SOURCE if efficiencies is None else f"the decode constants of {engine_source}"
    profile_name = f"{model}@{hw.key}-tp{tp}"
    profile = build_profile(arch, hw, tp, eff, name=profile_name, model=model, block_size=block_size)
    fitted_under = eff.provenance.get("assembly")  # the efficiencies only mean something under their assembly
    if fitted_under:
        profile = dataclasses.replace(profile, **fitted_under)
    provenance = {
        "source": "calibration.build.profile_from_architecture: architecture x hardware efficiencies; "
                  "not measured (see the leave-one-model-out errors for how far to trust it)",
        "config": str(config_path),
        "hardware": hw.key,
        "architecture": arch.summary(tp),
        "efficiencies": {k: v for k, v in dataclasses.asdict(eff).items() if k != "provenance"},
        "efficiencies_source": eff.provenance.get("source", "given"),
        "kernel_family": kernel_family(arch).describe(),
        "carried_from": family_source,
        "engine_terms_from": engine_source,
        "same_family_fit": same_family,
        "fields": field_sources(profile, family_source, engine_source, decode_source),
        "decode_terms_from": decode_source,
        "floors": floor_rows(profile, arch, hw, list(DEFAULT_FLOOR_PROMPTS), user_tokens),
    }
    if caveats:  # only off the measured hardware: a p5en profile stays what it was
        provenance["hardware_caveats"] = caveats
    return dataclasses.replace(profile, provenance=provenance)


def _carried_suffix(hw: Hardware) -> str:
    return f", fitted on {MEASURED_ON} (H200) measurements and carried over to {hw.key} unfitted"


def hardware_caveats(hw: Hardware, *, carried: bool) -> list[str]:
    """What ``bidikv profile`` must say about a profile built off the measured hardware: the fitted terms
    were carried over from p5en, and on a Neuron accelerator vLLM's engine overheads are not known."""
    lines = []
    if carried:
        lines.append(f"the prefill, transfer and TTFT terms were fitted on {MEASURED_ON} (H200) measurements and "
                     f"carried over to {hw.key} ({hw.name}, {hw.accelerator or 'its accelerator'}) unfitted: only "
                     f"the physics (HBM, FLOP/s, EFA and intra-node link rates of the {hw.key} preset) follows "
                     f"this hardware, and the prefill/TTFT error bands below were measured on {MEASURED_ON}, not "
                     f"here (the decode step's overheads were fitted across {', '.join(decode_fit_gpus())} rows)")
    if hw.is_neuron:
        borrowed = (": the transfer and TTFT costs below are CUDA-on-H200 values and the decode step's overheads "
                    "CUDA-GPU values, borrowed as placeholders, not estimates for Neuron" if carried else "")
        lines.append(f"vLLM's engine overheads on Neuron ({hw.accelerator}) are unknown to this project{borrowed}; "
                     f"--tp counts {hw.accelerator} chips (1..{hw.gpus_per_node}); measure with the bench commands "
                     "below before trusting any engine term")
    return lines


def decode_fit_gpus() -> list[str]:
    """The GPUs the shipped decode fit saw (calibration.decode_fit)."""
    return list(load_record()["gpus"])


def _default_efficiencies(arch: Architecture, hw: Hardware) -> tuple[HardwareEfficiencies, str, str, bool]:
    """The carried fit on the hardware the measured models ran on, else that hardware's efficiencies file:
    efficiencies, where the prefill terms and the engine terms come from, same-family or not."""
    if hw.key in {d.hardware for d in MEASURED}:
        eff, family_source, same_family = carried_efficiencies(arch)
        return eff, family_source, ENGINE_SOURCE, same_family
    if efficiencies_path(hw.key).is_file():
        source = f"{hw.key}'s efficiencies (calibration/data/{hw.key}_efficiencies.json)"
        return load_efficiencies(hw.key), source, source, False
    # no fit on this hardware: the measured hardware's carried fit, said to be carried (hardware_caveats)
    eff, family_source, same_family = carried_efficiencies(arch)
    return eff, family_source + _carried_suffix(hw), ENGINE_SOURCE + _carried_suffix(hw), same_family
