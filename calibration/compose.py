"""One profile from one architecture: config.json + hardware + TP + hardware efficiencies -> LatencyProfile.

Each latency model contributes its own profile fields (calibration.prefill, .transfer, .reuse, .ttft,
.decode); this module only composes them. Apart from calibration.build because the fit builds a
profile for every candidate efficiency vector, and calibration.build's default efficiencies come from
that fit.
"""

from __future__ import annotations

from typing import Any

from calibration import decode, prefill, reuse, transfer, ttft
from calibration.architecture import Architecture
from calibration.efficiencies import HardwareEfficiencies
from calibration.hardware import Hardware
from calibration.profile import LatencyProfile


def build_profile(arch: Architecture, hw: Hardware, tp: int, eff: HardwareEfficiencies, *, name: str,
                  model: str, block_size: int | None = None,
                  provenance: dict[str, Any] | None = None) -> LatencyProfile:
    hw.check_tp(tp)
    fields: dict[str, Any] = {}
    fields.update(prefill.coefficients(arch, hw, tp, eff))
    fields.update(transfer.coefficients(arch, hw, tp, eff))
    fields.update(reuse.coefficients(eff))
    fields.update(ttft.coefficients(eff))
    fields.update(decode.coefficients(arch, hw, tp, eff))
    return LatencyProfile(name=name, model=model, hardware=hw.name, tp=tp, kv_bytes_per_token=arch.kv_bytes_per_token(tp),
                          block_size=block_size or arch.default_block_size, provenance=provenance or {}, **fields)
