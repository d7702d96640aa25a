"""What a profile for a model nobody measured is made of: physics, carried-over fits, assumptions.

Every :class:`~calibration.profile.LatencyProfile` field belongs to one of four kinds:

* ``physics``    exact arithmetic on the model's config.json and the hardware facts (KV bytes per token,
                 block size, attention window, the HBM budget): right whatever the engine does;
* ``efficiency`` a physical count (FLOPs, bytes, descriptors) divided by a hardware peak times a fitted
                 fraction of that peak (GEMM / attention MFU, EFA efficiency). The count is exact, the
                 fraction is a property of the kernels that run it, so it carries over only to a model whose
                 kernels are the same: same weight dtype, same attention kind, dense or MoE alike;
* ``overhead``   engine costs in seconds that do not follow from the model's size (per forward pass, per
                 transfer, per reused token, per request on the TTFT path), fitted on the measured
                 models' figures and carried over as they are;
* ``assumption`` decode: first principles with stated constants (HBM efficiency, per-layer and per-sequence
                 step costs) that no published p5en figure of the measured models constrains.

Each carried term comes from the fit that measures it (calibration.shared_fit, :func:`carried_efficiencies`):
the engine overheads from both measured models at once (one shared set costs the twenty published
figures ~1-2 points of max error against each model's own fit), the prefill fixed cost and GEMM/attention
efficiency from the measured model of the same kernel family (:func:`nearest_measured`: a dense BF16
GQA model takes Qwen3-32B's, an FP8 MoE MLA model GLM-5-FP8's). Those two are the model's, not the
engine's: the measured models run their linear layers at 34 % and 5 % of peak, and sharing the fixed
cost per forward too raises the max error to 31-48 %. A model of neither family gets the prefill terms
of a fit to both (the compromise), and the cross-family leave-one-model-out error (calibration.loo) is
what to expect of it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from calibration.architecture import Architecture
from calibration.closed_form import SHIPPED_ASSEMBLY
from calibration.efficiencies import HardwareEfficiencies
from calibration.profile import LatencyProfile
from calibration.published import MEASURED, MeasuredDeployment

PHYSICS, EFFICIENCY, OVERHEAD, ASSUMPTION = "physics", "efficiency", "overhead", "assumption"

# field -> (kind, what sets it)
FIELD_KINDS: dict[str, tuple[str, str]] = {
    "kv_bytes_per_token": (PHYSICS, "config.json: KV heads x head size x layers x dtype, summed over TP ranks"),
    "block_size": (PHYSICS, "the attention backend's page size (FlashAttention 16, FlashMLA 64)"),
    "attn_window_tokens": (PHYSICS, "config.json: DSA top-k (0 = dense attention)"),
    "decode_hbm_kv_bytes": (PHYSICS, "TP x HBM x gpu_memory_utilization - weight bytes"),
    "prefill_per_token_s": (EFFICIENCY, "linear FLOPs/token / (TP x peak FLOP/s x GEMM MFU)"),
    "prefill_attn_s": (EFFICIENCY, "attention FLOPs/pair / (TP x BF16 peak x attention MFU)"),
    "prefill_index_s": (EFFICIENCY, "DSA indexer FLOPs/pair / (TP x FP8 peak x attention MFU)"),
    "transfer_bytes_per_s": (EFFICIENCY, "EFA line rate x TP x EFA efficiency"),
    "transfer_per_block_s": (OVERHEAD, "NIXL descriptors per block (config.json) x fitted cost per descriptor"),
    "prefill_fixed_s": (EFFICIENCY, "layers x the kernel family's fitted fixed cost per layer per forward pass"),
    "transfer_setup_s": (OVERHEAD, "fitted per D->P transfer (handshake, notification)"),
    "reuse_overhead_per_token_s": (OVERHEAD, "fitted per reused token on the ON path (cause not identified)"),
    "ttft_overhead_fixed_s": (OVERHEAD, "fitted per request (proxy hops, D's first step)"),
    "ttft_overhead_per_prompt_token_s": (OVERHEAD, "fitted per prompt token (D re-tokenises the prompt)"),
    "ttft_overhead_per_reused_byte_s": (OVERHEAD, "fitted per reused KV byte (cause not identified)"),
    "decode_fixed_s": (ASSUMPTION, "weight bytes / (HBM x hbm_efficiency) + layers x an assumed step cost per layer"),
    "decode_per_seq_s": (ASSUMPTION, "extra MoE experts read per sequence + an assumed host cost per sequence"),
    "decode_per_ctx_token_s": (ASSUMPTION, "KV bytes per token per rank / (HBM x hbm_efficiency)"),
}


@dataclass(frozen=True, slots=True)
class KernelFamily:
    """What decides which kernels run a model's prefill: the fitted fractions of peak carry within a family."""

    weight_dtype: str
    attention: str  # "gqa" | "mla"
    moe: bool

    def describe(self) -> str:
        return f"{self.weight_dtype.upper()} {'MoE' if self.moe else 'dense'} {self.attention.upper()}"


def kernel_family(arch: Architecture) -> KernelFamily:
    return KernelFamily(arch.weight_dtype, arch.attention, arch.moe_experts > 0)


def nearest_measured(arch: Architecture) -> MeasuredDeployment | None:
    """The measured deployment whose kernel family is ``arch``'s, or None."""
    from calibration.fit import target  # the fit's view of a measured model (its architecture)

    family = kernel_family(arch)
    for d in MEASURED:
        if kernel_family(target(d.model).arch) == family:
            return d
    return None


PREFILL_TERMS = ("prefill_fixed_per_layer_s", "gemm_cost_factor", "attention_cost_factor")


def carried_efficiencies(arch: Architecture) -> tuple[HardwareEfficiencies, str, bool]:
    """What a profile for ``arch`` carries from the measured models (calibration.shared_fit): the engine
    overheads fitted on both at once, and the prefill fixed cost and GEMM/attention efficiency of the
    same-kernel-family model, else of the two-model compromise. Returns the efficiencies, where they come
    from, and whether a same-family model was found."""
    match = nearest_measured(arch)
    eff, text = efficiencies_for(match.model if match else None, kernel_family(arch).describe())
    return eff, text, match is not None


def efficiencies_for(prefill_model: str | None, family: str = "this family") -> tuple[HardwareEfficiencies, str]:
    """Engine overheads of the joint fit with ``prefill_model``'s prefill terms (None: the compromise's)."""
    from calibration.fit import TERM_NAMES, efficiencies_from_vector
    from calibration.shared_fit import carried_fit, compromise_fit

    carried = carried_fit()
    overheads = "engine overheads fitted on both measured models at once"
    if prefill_model is not None:
        x = carried.x[prefill_model].copy()
        text = f"{prefill_model} ({family}): its prefill fixed cost and GEMM/attention efficiency; {overheads}"
    else:
        first = MEASURED[0].model
        x = carried.x[first].copy()
        for term in PREFILL_TERMS:
            x[TERM_NAMES.index(term)] = compromise_fit().x[first][TERM_NAMES.index(term)]
        text = (f"the two-model compromise for prefill (no measured model is {family}: prefill fixed cost and "
                f"GEMM/attention efficiency of one fit to both); {overheads}")
    eff = efficiencies_from_vector(x, MEASURED[0].hardware, {
        "source": f"calibration.shared_fit: {text}", "assembly": SHIPPED_ASSEMBLY.describe()})
    return eff, text


def field_sources(profile: LatencyProfile, carried_from: str) -> list[dict[str, Any]]:
    """One row per numeric profile field: its kind, value and where it comes from."""
    rows = []
    for f in dataclasses.fields(LatencyProfile):
        if f.name not in FIELD_KINDS:
            continue
        kind, how = FIELD_KINDS[f.name]
        source = carried_from if kind in (EFFICIENCY, OVERHEAD) else ("config.json x hardware" if kind == PHYSICS
                                                                       else "calibration.decode defaults")
        rows.append({"field": f.name, "kind": kind, "value": getattr(profile, f.name), "how": how, "from": source})
    return rows
