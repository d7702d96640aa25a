"""Decode step, from first principles (not calibrated: nothing about decode is published).

    t = decode_fixed_s + decode_per_seq_s x B + decode_per_ctx_token_s x sum(context)

    decode_fixed_s         = W_1 / t / (HBM B/s x hbm_efficiency) + layers x decode_per_layer_overhead_s
    decode_per_seq_s       = dE x expert bytes / t / (HBM B/s x hbm_efficiency) + decode_per_seq_overhead_s
    decode_per_ctx_token_s = KV bytes/token on one rank / (HBM B/s x hbm_efficiency)
    decode_hbm_kv_bytes    = t x HBM bytes x gpu_memory_utilization - weight bytes

W_1 = weight bytes one token reads (active matmul weights + LM head); t = TP ranks, each reading its
shard. Causes: decode is HBM-bound (weights once per step, then each sequence's KV); each layer costs a
launch and TP all-reduces; an MoE step reads the experts its tokens route to: the first sequence's are
in W_1, each further sequence adds dE = (E_B - k) / (B_ref - 1) distinct experts per MoE layer on average up
to the reference batch B_ref, where E_B = E (1 - (1 - k/E)^B_ref) experts are touched (E routed
experts, k per token). Dense models: dE = 0. Per-sequence host work (sampling, detokenising) is a
constant. These are assumptions with stated values, not fitted.
"""

from __future__ import annotations

from calibration.architecture import DTYPE_BYTES, Architecture
from calibration.efficiencies import HardwareEfficiencies
from calibration.hardware import Hardware


def coefficients(arch: Architecture, hw: Hardware, tp: int, eff: HardwareEfficiencies) -> dict[str, float]:
    hbm = hw.hbm_bytes_per_s_per_gpu * eff.hbm_efficiency
    weight_bytes = DTYPE_BYTES[arch.weight_dtype]
    w1 = arch.matmul_params_per_token * weight_bytes + arch.lm_head_params * DTYPE_BYTES["bf16"]
    extra_experts = 0.0
    if arch.experts_per_token and arch.moe_experts > arch.experts_per_token and eff.decode_reference_batch > 1:
        e, k, b = arch.moe_experts, arch.experts_per_token, eff.decode_reference_batch
        touched = e * (1 - (1 - k / e) ** b)
        extra_experts = (touched - k) / (b - 1)
    per_expert_bytes = arch.expert_params * weight_bytes  # one expert, summed over the MoE layers
    kv_budget = tp * hw.hbm_bytes_per_gpu * eff.gpu_memory_utilization - arch.weight_bytes()
    if kv_budget <= 0:
        raise ValueError(f"{arch.name}: weights ({arch.weight_bytes() / 1e9:.0f} GB) do not fit in "
                         f"{tp} x {hw.hbm_bytes_per_gpu / 1e9:.0f} GB x {eff.gpu_memory_utilization}")
    return {
        "decode_fixed_s": w1 / tp / hbm + arch.num_layers * eff.decode_per_layer_overhead_s,
        "decode_per_seq_s": extra_experts * per_expert_bytes / tp / hbm + eff.decode_per_seq_overhead_s,
        "decode_per_ctx_token_s": arch.kv_bytes_per_token_per_rank(tp) / hbm,
        "decode_hbm_kv_bytes": kv_budget,
    }
