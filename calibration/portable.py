"""What a profile for a model nobody measured is made of: physics, carried-over fits, assumptions.

Every numeric :class:`~calibration.profile.LatencyProfile` field belongs to one of four kinds, by what
sets it and so where it can come from for a model nobody measured:

* ``physics``    exact arithmetic on the model's config.json and the hardware facts (KV bytes per token,
                 block size, attention window, the HBM budget): right whatever the engine does;
* ``family``     prefill: exact FLOP counts at a fitted fraction of peak (GEMM / attention MFU) and a fitted
                 fixed cost per layer per forward pass. Both are properties of the kernels that run the
                 model, so they carry only to a model of the same kernel family (weight dtype, attention
                 kind, dense or MoE): a BF16 dense GQA model takes Qwen3-32B's, an FP8 MoE MLA model
                 GLM-5-FP8's (:func:`nearest_measured`), a model of neither family the compromise of one
                 fit to both;
* ``engine``     seconds (and the NIC's efficiency) that do not follow from the model: per D->P transfer,
                 per descriptor, per reused token, per request on the TTFT path; exact descriptor and byte
                 counts times one set of values fitted on both measured models at once;
* ``decode``     the decode step: exact bytes, FLOPs and all-reduce counts (calibration.decode_step) times engine
                 overheads (HBM efficiency; per layer, all-reduce and sequence) fitted once across published
                 vLLM decode measurements across models and GPUs (calibration.decode_fit,
                 ``data/decode_overheads.json``): no published p5en figure of the measured models constrains decode.

The split is the data's (calibration.shared_fit): one shared set of engine terms costs the twenty
published figures ~1-2 points of max error against each model's own fit; sharing the prefill fixed
cost too raises it to 31-48 %, and the GEMM efficiencies differ 33 % vs 5 % of peak. The cross-family
leave-one-model-out error (calibration.loo) is what a model of no measured family can expect.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from calibration.architecture import Architecture
from calibration.closed_form import SHIPPED_ASSEMBLY
from calibration.decode_fit import DECODE_SOURCE
from calibration.efficiencies import HardwareEfficiencies
from calibration.fit import TERM_NAMES, efficiencies_from_vector, target
from calibration.profile import LatencyProfile
from calibration.published import MEASURED, MeasuredDeployment
from calibration.shared_fit import carried_fit, compromise_fit

PHYSICS, FAMILY, ENGINE, DECODE = "physics", "family", "engine", "decode"

# field -> (kind, what sets it)
FIELD_KINDS: dict[str, tuple[str, str]] = {
    "kv_bytes_per_token": (PHYSICS, "config.json: KV heads x head size x layers x dtype, summed over TP ranks"),
    "block_size": (PHYSICS, "the attention backend's page size (FlashAttention 16, FlashMLA 64)"),
    "attn_window_tokens": (PHYSICS, "config.json: DSA top-k (0 = dense attention)"),
    "decode_hbm_kv_bytes": (PHYSICS, "TP x HBM x gpu_memory_utilization - weight bytes"),
    "prefill_per_token_s": (FAMILY, "linear FLOPs/token / (TP x peak FLOP/s x GEMM MFU)"),
    "prefill_attn_s": (FAMILY, "attention FLOPs/pair / (TP x BF16 peak x attention MFU)"),
    "prefill_index_s": (FAMILY, "DSA indexer FLOPs/pair / (TP x FP8 peak x attention MFU)"),
    "prefill_fixed_s": (FAMILY, "layers x fitted fixed cost per layer per forward pass"),
    "transfer_bytes_per_s": (ENGINE, "EFA line rate x TP x fitted EFA efficiency"),
    "transfer_per_block_s": (ENGINE, "NIXL descriptors per block (config.json) x fitted cost per descriptor"),
    "transfer_setup_s": (ENGINE, "fitted per D->P transfer (handshake, notification)"),
    "reuse_overhead_per_token_s": (ENGINE, "fitted per reused token on the ON path (cause not identified)"),
    "ttft_overhead_fixed_s": (ENGINE, "fitted per request (proxy hops, D's first step)"),
    "ttft_overhead_per_prompt_token_s": (ENGINE, "fitted per prompt token (D re-tokenises the prompt)"),
    "ttft_overhead_per_reused_byte_s": (ENGINE, "fitted per reused KV byte (cause not identified)"),
    "decode_fixed_s": (DECODE, "weight bytes / (HBM x fitted hbm_efficiency) + fitted costs per layer and all-reduce"),
    "decode_per_seq_s": (DECODE, "extra MoE experts read + all-reduce bytes per sequence + a fitted cost per sequence"),
    "decode_per_ctx_token_s": (DECODE, "KV bytes per token per rank / (HBM x fitted hbm_efficiency)"),
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
    family = kernel_family(arch)
    for d in MEASURED:
        if kernel_family(target(d.model).arch) == family:
            return d
    return None


PREFILL_TERMS = ("prefill_fixed_per_layer_s", "gemm_cost_factor", "attention_cost_factor")


ENGINE_SOURCE = "both measured models at once (calibration.shared_fit)"


def carried_efficiencies(arch: Architecture) -> tuple[HardwareEfficiencies, str, bool]:
    """What a profile for ``arch`` carries from the measured models (calibration.shared_fit): the engine
    terms fitted on both at once, and the prefill terms of the same-kernel-family model, else of the
    two-model compromise. Returns the efficiencies, where the prefill terms come from, and whether a
    same-family model was found."""
    match = nearest_measured(arch)
    eff, text = efficiencies_for(match.model if match else None, kernel_family(arch).describe())
    return eff, text, match is not None


def efficiencies_for(prefill_model: str | None, family: str = "this family") -> tuple[HardwareEfficiencies, str]:
    """The joint fit's engine terms with ``prefill_model``'s prefill terms (None: the compromise's)."""
    carried = carried_fit()
    if prefill_model is not None:
        x = carried.x[prefill_model].copy()
        text = f"{prefill_model} ({family}, the same kernel family)"
    else:
        first = MEASURED[0].model
        x = carried.x[first].copy()
        for term in PREFILL_TERMS:
            x[TERM_NAMES.index(term)] = compromise_fit().x[first][TERM_NAMES.index(term)]
        text = f"the two-model compromise (no measured model is {family})"
    eff = efficiencies_from_vector(x, MEASURED[0].hardware, {
        "source": f"calibration.shared_fit: prefill terms of {text}, engine terms of {ENGINE_SOURCE}; "
                  f"decode overheads of {DECODE_SOURCE}",  # efficiencies_from_vector sets them
        "assembly": SHIPPED_ASSEMBLY.describe()})
    return eff, text


def field_sources(profile: LatencyProfile, family_source: str, engine_source: str, decode_source: str
                  ) -> list[dict[str, Any]]:
    """One row per numeric profile field: its kind, value, how it is computed and where it comes from."""
    sources = {PHYSICS: "config.json x hardware", FAMILY: family_source, ENGINE: engine_source, DECODE: decode_source}
    return [{"field": f.name, "kind": FIELD_KINDS[f.name][0], "value": getattr(profile, f.name),
             "how": FIELD_KINDS[f.name][1], "from": sources[FIELD_KINDS[f.name][0]]}
            for f in dataclasses.fields(LatencyProfile) if f.name in FIELD_KINDS]
