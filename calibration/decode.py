"""Decode step as the simulator runs it: the profile's three linear terms, from calibration.decode_step's physics
and the efficiencies' decode overheads.

    t = decode_fixed_s + decode_per_seq_s x B + decode_per_ctx_token_s x sum(context)

    decode_fixed_s         = W_1 / t / (HBM B/s x hbm_efficiency) + layers x decode_per_layer_overhead_s
                             + all-reduces x decode_per_allreduce_s
    decode_per_seq_s       = dE x expert bytes / t / (HBM B/s x hbm_efficiency) + one sequence's all-reduce bytes
                             over NVLink + decode_per_seq_overhead_s
    decode_per_ctx_token_s = KV bytes/token on one rank / (HBM B/s x hbm_efficiency)
    decode_hbm_kv_bytes    = t x HBM bytes x gpu_memory_utilization - weight bytes

W_1 = weight bytes one token reads (active matmul weights + LM head); t = TP ranks, each reading its shard; two
all-reduces per layer when t > 1. An MoE step reads the experts its tokens route to: the first sequence's are in
W_1, each further sequence adds dE = (E_B - k) / (B_ref - 1) distinct experts per MoE layer on average up to the
reference batch B_ref (calibration.decode_step.touched_experts; the simulator's step is linear in B, the
expectation is not). The step is memory-bound at the batches a P/D decode instance runs for these models; the
FLOP roofline calibration.decode_step applies in the fit is not in the linear form.

The overheads are the efficiencies' (calibration.efficiencies): fitted across published measurements by
calibration.decode_fit, and carried by every efficiency calibration.fit builds (the shipped profiles and
``bidikv profile`` alike).
"""

from __future__ import annotations

from calibration.architecture import Architecture
from calibration.decode_step import WEIGHT_BYTES, step_physics, touched_experts
from calibration.efficiencies import HardwareEfficiencies
from calibration.hardware import Hardware

PRECISION = {"bf16": "BF16", "fp16": "FP16", "fp8": "FP8"}  # Architecture.weight_dtype -> decode_step precision


def coefficients(arch: Architecture, hw: Hardware, tp: int, eff: HardwareEfficiencies) -> dict[str, float]:
    hbm = hw.hbm_bytes_per_s_per_gpu * eff.hbm_efficiency
    one = step_physics(arch, hw, tp, PRECISION[arch.weight_dtype], 1, 0)
    extra_experts = 0.0
    b = eff.decode_reference_batch
    if arch.experts_per_token and arch.moe_experts > arch.experts_per_token and b > 1:
        extra_experts = (touched_experts(arch.moe_experts, arch.experts_per_token, b) - arch.experts_per_token) / (b - 1)
    expert_bytes = arch.expert_params * WEIGHT_BYTES[PRECISION[arch.weight_dtype]]  # one expert, all MoE layers
    kv_budget = tp * hw.hbm_bytes_per_gpu * eff.gpu_memory_utilization - arch.weight_bytes()
    if kv_budget <= 0:
        raise ValueError(f"{arch.name}: weights ({arch.weight_bytes() / 1e9:.0f} GB) do not fit in "
                         f"{tp} x {hw.hbm_bytes_per_gpu / 1e9:.0f} GB x {eff.gpu_memory_utilization}")
    return {
        "decode_fixed_s": (one.weight_bytes / hbm + arch.num_layers * eff.decode_per_layer_overhead_s
                           + one.allreduces * eff.decode_per_allreduce_s),
        "decode_per_seq_s": extra_experts * expert_bytes / tp / hbm + one.allreduce_s + eff.decode_per_seq_overhead_s,
        "decode_per_ctx_token_s": arch.kv_bytes_per_token_per_rank(tp) / hbm,
        "decode_hbm_kv_bytes": kv_budget,
    }
