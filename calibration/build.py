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
from calibration.efficiencies import HardwareEfficiencies, load_efficiencies
from calibration.floors import floor_rows
from calibration.hardware import Hardware, load_hardware
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
    if efficiencies is None:
        eff, family_source, engine_source, same_family = _default_efficiencies(arch, hw)
    else:
        eff = efficiencies if isinstance(efficiencies, HardwareEfficiencies) else load_efficiencies(efficiencies)
        family_source = engine_source = f"given efficiencies ({efficiencies if isinstance(efficiencies, str) else 'object'})"
        same_family = False
    model = name or arch.name
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
        "fields": field_sources(profile, family_source, engine_source),
        "floors": floor_rows(profile, arch, hw, list(DEFAULT_FLOOR_PROMPTS), user_tokens),
    }
    return dataclasses.replace(profile, provenance=provenance)


def _default_efficiencies(arch: Architecture, hw: Hardware) -> tuple[HardwareEfficiencies, str, str, bool]:
    """The carried fit on the hardware the measured models ran on, else that hardware's efficiencies file:
    efficiencies, where the prefill terms and the engine terms come from, same-family or not."""
    if hw.key in {d.hardware for d in MEASURED}:
        eff, family_source, same_family = carried_efficiencies(arch)
        return eff, family_source, ENGINE_SOURCE, same_family
    source = f"{hw.key}'s efficiencies (calibration/data/{hw.key}_efficiencies.json)"
    return load_efficiencies(hw.key), source, source, False
