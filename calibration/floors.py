"""Physical floors beside a profile: what no implementation on this hardware could beat.

    prefill floor  = FLOPs / dense peak (calibration.prefill.prefill_floor_s; no fixed cost)
    transfer floor = KV bytes / EFA line rate (calibration.transfer.transfer_floor_s; no setup, no
                     per-descriptor cost)

``floor_rows`` lists them at given prompt lengths with the profile's time (or the measured one) and the
ratio time / floor: how far from the hardware limit the measured system (or the profile) runs.
"""

from __future__ import annotations

from typing import Any, Mapping

from calibration.architecture import Architecture
from calibration.hardware import Hardware
from calibration.prefill import prefill_floor_s
from calibration.profile import LatencyProfile
from calibration.transfer import transfer_floor_s


def floor_rows(profile: LatencyProfile, arch: Architecture, hw: Hardware, prompt_tokens: list[int],
               user_tokens: int, measured_ms: Mapping[tuple[int, str], float] | None = None) -> list[dict[str, Any]]:
    """``measured_ms`` maps (prompt_tokens, "prefill_off" | "transfer_on") to a published time."""
    rows = []
    for n in prompt_tokens:
        reused = max(n - user_tokens, 0)
        cases = (("prefill_off", f"OFF prefill of {n} tokens", prefill_floor_s(arch, hw, profile.tp, n),
                  profile.compute_s(n, 0)),
                 ("transfer_on", f"ON D->P transfer of {reused} tokens", transfer_floor_s(arch, hw, profile.tp, reused),
                  profile.transfer_s(reused)))
        for key, what, floor_s, profile_s in cases:
            row = {"prompt_tokens": n, "what": key, "description": what, "floor_ms": floor_s * 1e3,
                   "profile_ms": profile_s * 1e3, "profile_over_floor": profile_s / floor_s}
            if measured_ms and (n, key) in measured_ms:
                row["measured_ms"] = measured_ms[(n, key)]
                row["measured_over_floor"] = measured_ms[(n, key)] / (floor_s * 1e3)
            rows.append(row)
    return rows
