"""ON-path reuse overhead, a calibrated term, not a physical one:

    t = reuse_overhead_per_token_s x r          (r = tokens pulled from D instead of recomputed)

The published ON prefill grows ~12.5 us per reused token while the transfer grows ~4.4 us and the
suffix's attention over the longer context adds well under 1 us (calibration/README.md): ~8 us/token is
unexplained by the transfer and compute models. It is kept explicit rather than folded into them. The
measured values agree across the two models per token (~8.3 us Qwen3-32B, ~7.8 us GLM-5) though their KV
bytes per token differ 3x, so it is expressed per token; its cause is not identified (candidates: P-side
per-token work of the async receive path — block-table and prefix bookkeeping of the pulled blocks).
"""

from __future__ import annotations

from calibration.efficiencies import HardwareEfficiencies


def coefficients(eff: HardwareEfficiencies) -> dict[str, float]:
    return {"reuse_overhead_per_token_s": eff.reuse_overhead_per_token_s}
