"""One decode step of vLLM: physics (bytes over HBM, FLOPs, the TP all-reduce over NVLink) plus engine overheads.

    t_step(B, c) = max(bytes / (HBM B/s x hbm_efficiency), FLOPs / peak FLOP/s)   physics, per rank
                 + all-reduce bytes / NVLink B/s per direction                        physics, TP > 1
                 + layers x per_layer_s + all-reduces x per_allreduce_s + B x per_seq_s   engine, fitted

    bytes   = W(B) / t + B x c x KV bytes/token on one rank
    W(B)    = non-expert matmul weights + E_B experts' weights (MoE) + the LM head (BF16)
    E_B     = E (1 - (1 - k/E)^B)   experts a batch of B sequences touches per MoE layer (k routed per token, E routed
              experts; the expectation under uniform routing)
    FLOPs   = 2 x active matmul parameters x B / t
    all-reduces = 2 per layer when t > 1 (after attention and after the MLP), each of B x hidden BF16 values;
              a ring moves 2 (t - 1) / t of it each way

B sequences in the batch, c tokens of context each (mean over the decode), t TP ranks. What vLLM spends beyond
the physics is the engine's: a cost per layer (kernel launches and the small kernels between the GEMMs), per
all-reduce (its latency, which no bandwidth term captures) and per sequence (sampling, detokenising, the
scheduler's bookkeeping). Those three and ``hbm_efficiency`` are fitted once across models and GPUs
(calibration.decode_fit), not per model: that is what lets the step carry to a model nobody measured. Terms the
collected data cannot tell apart from these are left out, chosen by leave-one-model-out error
(calibration/README.md, "Decode across models"): a fixed cost per step, a further cost per MoE layer, a cost per
expert touched.

TPOT of a request in an aggregated (not P/D) closed-loop benchmark also pays for the prefills of the requests
that replace finished ones, chunked into its decode steps: (B - 1) prefills of the input length over the
output length, at ``mixed_prefill_mfu`` of peak (calibration.decode_fit applies it; a P/D decode instance
runs no prefill).
"""

from __future__ import annotations

from dataclasses import dataclass

from calibration.architecture import DTYPE_BYTES, Architecture
from calibration.hardware import Hardware

# Bytes per stored matmul weight by the precision a checkpoint is published in. FP4 is MXFP4: 4 bits and one 8-bit
# scale per 32 values (4.25 bits); FP4 checkpoints quantize the experts only (gpt-oss keeps attention, router and
# LM head in BF16: its quantization_config's modules_to_not_convert), so the other weights stay BF16.
WEIGHT_BYTES = {"BF16": 2.0, "FP16": 2.0, "FP8": 1.0, "FP4": 0.53125}
NON_EXPERT_BYTES = {**WEIGHT_BYTES, "FP4": 2.0}
# The matmul dtype whose peak FLOP/s a precision runs at (FP4 counted at FP8's rate: no preset lists FP4 peaks).
PEAK_DTYPE = {"BF16": "bf16", "FP16": "bf16", "FP8": "fp8", "FP4": "fp8"}


@dataclass(frozen=True, slots=True)
class DecodeOverheads:
    """The fitted part of a decode step (calibration.decode_fit); units in the names."""

    hbm_efficiency: float  # fraction of HBM bandwidth a decode step reaches
    per_layer_s: float  # s per layer per step
    per_allreduce_s: float  # s per TP all-reduce (2 per layer when TP > 1)
    per_seq_s: float  # s per sequence per step
    mixed_prefill_mfu: float  # fraction of peak FLOP/s of the prefills chunked into an aggregated run's steps


@dataclass(frozen=True, slots=True)
class DecodePhysics:
    """What one step moves and computes on one rank, for one (model, GPU, TP, precision, batch, context)."""

    weight_bytes: float
    kv_bytes: float
    flops: float
    allreduces: int
    allreduce_s: float  # bandwidth part of the all-reduces (their latency is the engine's per_allreduce_s)
    layers: int

    def memory_s(self, hw: Hardware, hbm_efficiency: float) -> float:
        return (self.weight_bytes + self.kv_bytes) / (hw.hbm_bytes_per_s_per_gpu * hbm_efficiency)


def touched_experts(experts: int, per_token: int, batch: float) -> float:
    """E_B: expected experts touched per MoE layer by ``batch`` sequences routing ``per_token`` each."""
    if experts <= 0 or per_token <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - per_token / experts) ** max(batch, 1.0))


def step_physics(arch: Architecture, hw: Hardware, tp: int, precision: str, batch: float,
                 context_tokens: float) -> DecodePhysics:
    if precision not in WEIGHT_BYTES:
        raise ValueError(f"precision must be one of {sorted(WEIGHT_BYTES)}, got {precision!r}")
    experts_read = touched_experts(arch.moe_experts, arch.experts_per_token, batch)
    expert_active = arch.experts_per_token * arch.expert_params
    non_expert = arch.matmul_params_per_token - expert_active if arch.moe_experts else arch.matmul_params_per_token
    expert_bytes = (WEIGHT_BYTES if arch.moe_experts else NON_EXPERT_BYTES)[precision]
    weights = (non_expert * NON_EXPERT_BYTES[precision] + experts_read * arch.expert_params * expert_bytes
               + arch.lm_head_params * DTYPE_BYTES["bf16"])
    kv = batch * sequence_kv_bytes(arch, tp, context_tokens)
    flops = 2.0 * (arch.matmul_params_per_token + arch.lm_head_params) * batch / tp
    allreduces = 2 * arch.num_layers if tp > 1 else 0
    ring_bytes = 2.0 * (tp - 1) / tp * batch * arch.hidden_size * DTYPE_BYTES["bf16"]
    per_direction = hw.nvlink_bytes_per_s_per_gpu / 2  # the presets give NVLink both directions together
    return DecodePhysics(weight_bytes=weights / tp, kv_bytes=kv, flops=flops, allreduces=allreduces,
                         allreduce_s=allreduces * ring_bytes / per_direction, layers=arch.num_layers)


def step_s(phys: DecodePhysics, hw: Hardware, precision: str, batch: float, o: DecodeOverheads) -> float:
    compute = phys.flops / hw.peak_flops_per_s(PEAK_DTYPE[precision], 1)
    return (max(phys.memory_s(hw, o.hbm_efficiency), compute) + phys.allreduce_s
            + phys.layers * o.per_layer_s + phys.allreduces * o.per_allreduce_s + batch * o.per_seq_s)


def weight_bytes_stored(arch: Architecture, precision: str) -> float:
    """Every weight as a checkpoint of ``precision`` stores it (experts at the row's precision under FP4; embeddings
    and LM head in BF16)."""
    vocab = arch.vocab_params_stored
    experts = arch.moe_experts * arch.expert_params
    other = arch.total_params - vocab - experts
    expert_bytes = (WEIGHT_BYTES if arch.moe_experts else NON_EXPERT_BYTES)[precision]
    return other * NON_EXPERT_BYTES[precision] + experts * expert_bytes + vocab * DTYPE_BYTES["bf16"]


def sequence_kv_bytes(arch: Architecture, tp: int, tokens: float) -> float:
    """KV bytes of one sequence of ``tokens`` on one rank: sliding-window layers hold only their window."""
    per_layer = arch.kv_bytes_per_token_per_rank(tp) / arch.num_layers
    full = arch.num_layers - arch.sliding_layers
    return per_layer * (full * tokens + arch.sliding_layers * min(tokens, arch.sliding_window_tokens))


def kv_capacity_sequences(arch: Architecture, hw: Hardware, tp: int, precision: str, tokens: float,
                          gpu_memory_utilization: float = 0.9) -> float:
    """Sequences of ``tokens`` whose KV the instance holds in what vLLM's HBM share leaves after the weights
    (activations not counted). A batch needing more runs only what fits; the rest waits (its wait is TTFT, not
    TPOT)."""
    free_per_rank = hw.hbm_bytes_per_gpu * gpu_memory_utilization - weight_bytes_stored(arch, precision) / tp
    return max(free_per_rank, 0.0) / sequence_kv_bytes(arch, tp, tokens)


def prefill_compute_s(arch: Architecture, hw: Hardware, tp: int, precision: str, tokens: float, mfu: float) -> float:
    """Linear-layer FLOPs of a prompt at ``mfu`` of peak: the prefill a decode step shares its GPU with."""
    return 2.0 * arch.matmul_params_per_token * tokens / (hw.peak_flops_per_s(PEAK_DTYPE[precision], tp) * mfu)
