"""TTFT overhead: what the client sees beyond P's queue wait, the prefill and the P->D transfer.

    t = ttft_overhead_fixed_s + ttft_overhead_per_prompt_token_s x N
        + ttft_overhead_per_reused_byte_s x b x r

    N = prompt tokens, r = tokens reused from D (0 when bidirectional transfer is off),
    b = KV bytes per token (whole model).

Causes: the fixed term is the proxy hops, D's scheduling and its first decode step; the per-prompt-token
term is host work on D that scales with the prompt (the proxy forwards the request text and D renders
and tokenises the whole prompt again, and hashes its blocks); the per-reused-byte term is calibrated,
not physical: on the ON path TTFT - prefill grows with the reused context on both models, by about the
same time per KV byte (~110-120 GB/s effective) though not per token; its cause is not identified.
"""

from __future__ import annotations

from calibration.efficiencies import HardwareEfficiencies


def coefficients(eff: HardwareEfficiencies) -> dict[str, float]:
    return {"ttft_overhead_fixed_s": eff.ttft_overhead_fixed_s,
            "ttft_overhead_per_prompt_token_s": eff.ttft_overhead_per_prompt_token_s,
            "ttft_overhead_per_reused_byte_s": eff.ttft_overhead_per_reused_byte_s}
