"""Prefill compute: one forward pass over chunks of ``n`` new tokens on top of ``c`` cached ones.

    t = prefill_fixed_s + sum_chunks [ prefill_per_token_s * n + prefill_attn_s * P_W(n, c)
                                       + prefill_index_s * P(n, c) ]

    P(n, c)   = n (c + n/2)                     causal (query, key) pairs, continuous form
    P_W(n, c) = integral_0^n min(c + x, W) dx   pairs when a query reads at most W keys (DSA top-k);
                W = 0 means dense: P_W = P

Coefficients from the architecture and the hardware (t = tensor-parallel ranks):

    prefill_per_token_s = linear FLOPs/token  / (t x peak[weight dtype] x gemm_mfu)
    prefill_attn_s      = attention FLOPs/pair / (t x peak[bf16]       x attention_mfu)
    prefill_index_s     = indexer FLOPs/pair   / (t x peak[fp8]        x attention_mfu)
    prefill_fixed_s     = layers x prefill_fixed_per_layer_s

Causes: linear layers and attention are FLOP-bound at prefill sizes; the fixed term is what a forward
pass costs regardless of its size (kernel launches and per-layer syncs). The measured value (~100 ms for
Qwen3-32B, ~280 ms for GLM-5) is far above launch costs, so it also holds per-request work the
published "prefill duration" includes; it is calibrated, scaled by layer count only to predict models
nobody measured. The floor (MFU = 1, no fixed term) is what the GPUs could not beat.
"""

from __future__ import annotations

from calibration.architecture import Architecture
from calibration.efficiencies import HardwareEfficiencies
from calibration.hardware import Hardware


def causal_pairs(new_tokens: int, cached_tokens: int) -> float:
    return new_tokens * (cached_tokens + new_tokens / 2)


def windowed_pairs(new_tokens: int, cached_tokens: int, window_tokens: int) -> float:
    """Pairs when each query attends at most ``window_tokens`` keys (0 = dense)."""
    n, c, w = new_tokens, cached_tokens, window_tokens
    if w <= 0 or c + n <= w:
        return causal_pairs(n, c)
    if c >= w:
        return float(n * w)
    k = w - c  # queries still below the window
    return k * (c + k / 2) + (n - k) * w


def per_token_floor_s(arch: Architecture, hw: Hardware, tp: int) -> float:
    return arch.linear_flops_per_token / hw.peak_flops_per_s(arch.weight_dtype, tp)


def attn_pair_floor_s(arch: Architecture, hw: Hardware, tp: int) -> float:
    return arch.attn_flops_per_pair / hw.peak_flops_per_s("bf16", tp)


def index_pair_floor_s(arch: Architecture, hw: Hardware, tp: int) -> float:
    return arch.index_flops_per_pair / hw.peak_flops_per_s("fp8", tp)


def prefill_floor_s(arch: Architecture, hw: Hardware, tp: int, new_tokens: int, cached_tokens: int = 0) -> float:
    """Prefill at peak FLOP/s: no fixed cost, every FLOP at the hardware's dense peak."""
    return (per_token_floor_s(arch, hw, tp) * new_tokens
            + attn_pair_floor_s(arch, hw, tp) * windowed_pairs(new_tokens, cached_tokens, arch.attn_window_tokens)
            + index_pair_floor_s(arch, hw, tp) * causal_pairs(new_tokens, cached_tokens))


def coefficients(arch: Architecture, hw: Hardware, tp: int, eff: HardwareEfficiencies) -> dict[str, float]:
    return {"prefill_fixed_s": arch.num_layers * eff.prefill_fixed_per_layer_s,
            "prefill_per_token_s": per_token_floor_s(arch, hw, tp) / eff.gemm_mfu,
            "prefill_attn_s": attn_pair_floor_s(arch, hw, tp) / eff.attention_mfu,
            "attn_window_tokens": arch.attn_window_tokens,
            "prefill_index_s": index_pair_floor_s(arch, hw, tp) / eff.attention_mfu}
