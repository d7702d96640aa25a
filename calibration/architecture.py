"""A model's shape as the latency models need it, derived from a Hugging Face style ``config.json``.

Two attention families:

* dense GQA (Llama/Qwen style): ``num_key_value_heads`` K and V heads of ``head_dim``;
* MLA (DeepSeek/GLM style): one latent of ``kv_lora_rank + qk_rope_head_dim`` per token and layer,
  optionally with a DSA indexer (``index_topk``, ``index_n_heads``, ``index_head_dim``) whose
  sparse attention reads at most ``index_topk`` keys per query.

Derived quantities (L layers, h hidden, n_h query heads, d head dim, b_kv bytes per KV element):

* linear FLOPs/token        = 2 x matmul weights a token passes through (attention projections, the
                              dense MLP or the top-k + shared experts, the router). Embedding lookup is
                              no matmul; vLLM computes the LM head for the last prompt token only, so
                              prefill per-token FLOPs exclude it (decode includes it).
* attention FLOPs/pair      = per (new token, attended context token) pair, all layers:
                              GQA 4 n_h d L (QK^T and PV);
                              MLA with DSA (absorbed form, what FlashMLA-sparse runs)
                              2 n_h (kv_lora + rope) L + 2 n_h kv_lora L, over at most index_topk keys;
                              MLA without DSA (vLLM's MHA-form prefill) 2 n_h (nope + rope) L + 2 n_h v L.
* indexer FLOPs/pair        = 2 index_n_heads index_head_dim L over every pair (FP8), DSA only.
* KV bytes/token, one rank  = GQA 2 (n_kv / tp) d b_kv L (heads split over TP ranks, replicated when
                              tp > n_kv); MLA (kv_lora + rope) b_kv L, replicated on every rank (+ the
                              DSA indexer key cache, index_head_dim FP8 + one FP32 scale per 128, per layer);
                              vLLM's ``fp8_ds_mla`` format stores 656 B/layer (512 FP8 + 4 FP32 scales +
                              64 BF16 rope).
* KV bytes/token, whole     = one rank x tp (what crosses the NICs: every rank moves its own share).
* NIXL regions per layer    = 2 for GQA (FlashAttention's cache splits K and V, vLLM registers each),
                              1 for the MLA latent, +1 for the DSA indexer cache: the descriptors per
                              KV block a transfer posts, per rank.

Qwen3-32B (BF16): KV = 2 x 8 x 128 x 2 B x 64 = 262,144 B/token, 32 KiB per rank at TP8.
GLM-5-FP8 (BF16 latent): (576 x 2 + 132) x 78 = 100,152 B/token on each rank.

Errors name the missing or invalid field.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any, Mapping

from calibration import jsondata

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
_TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
_GATED_ACTS = {"silu", "swish", "swiglu", "gelu_pytorch_tanh", "geglu"}

FLASHATTN_BLOCK_TOKENS = 16  # vLLM's default KV block for FlashAttention
FLASHMLA_BLOCK_TOKENS = 64  # FlashMLA (dense and sparse) requires 64-token pages
DSA_INDEX_QUANT_BLOCK = 128  # one FP32 scale per 128 FP8 indexer-key elements


class ConfigError(ValueError):
    """A config.json that cannot describe a model; the message names the field."""


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str
    attention: str  # "gqa" or "mla"
    num_layers: int
    hidden_size: int
    weight_dtype: str  # dtype of the matmul weights: "bf16" or "fp8" (key of the hardware's peak FLOPs)
    kv_cache_dtype: str  # "bf16" or "fp8"
    matmul_params_per_token: float  # active linear weights per token, no embedding, no LM head
    total_params: float  # every weight, for memory (embeddings and LM head included)
    lm_head_params: float  # the LM head matmul (runs once per decoded token; tied or not)
    vocab_params_stored: float  # embedding + untied LM head weights (kept in BF16)
    attn_flops_per_pair: float  # per (query, key) pair, all layers
    attn_window_tokens: int  # 0 = dense; DSA: keys attended per query at most (index_topk)
    index_flops_per_pair: float  # DSA indexer, every pair, FP8; 0 without an indexer
    num_kv_heads: int  # GQA; 1 for MLA (one latent, replicated on every rank)
    kv_bytes_per_token_per_layer_unsplit: float  # before any TP split (GQA) / on one rank (MLA)
    kv_regions_per_layer: int  # NIXL regions (descriptors per block) per layer, per rank
    expert_params: float = 0.0  # one routed expert's weights summed over MoE layers (decode)
    experts_per_token: int = 0  # routed experts a token activates per MoE layer
    moe_experts: int = 0  # routed experts per MoE layer
    sliding_layers: int = 0  # layers that attend only the last sliding_window_tokens (gpt-oss: every other one)
    sliding_window_tokens: int = 0

    @property
    def linear_flops_per_token(self) -> float:
        return 2.0 * self.matmul_params_per_token

    @property
    def default_block_size(self) -> int:
        return FLASHMLA_BLOCK_TOKENS if self.attention == "mla" else FLASHATTN_BLOCK_TOKENS

    def kv_bytes_per_token_per_rank(self, tp: int) -> float:
        _check_tp(tp)
        if self.attention == "mla":
            return self.kv_bytes_per_token_per_layer_unsplit * self.num_layers
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise ConfigError(f"{self.name}: num_key_value_heads={self.num_kv_heads} does not split over tp={tp}")
        share = max(1.0, self.num_kv_heads / tp) / self.num_kv_heads
        return self.kv_bytes_per_token_per_layer_unsplit * share * self.num_layers

    def kv_bytes_per_token(self, tp: int) -> float:
        """Whole model, summed over the TP ranks (each rank moves its own share over its own NIC)."""
        return self.kv_bytes_per_token_per_rank(tp) * tp

    def descriptors_per_block(self) -> int:
        """NIXL descriptors one KV block costs on each rank (one per registered region)."""
        return self.kv_regions_per_layer * self.num_layers

    def weight_bytes(self) -> float:
        """All weights: matmuls in ``weight_dtype``, embeddings and LM head in BF16."""
        vocab = self.vocab_params_stored
        return (self.total_params - vocab) * DTYPE_BYTES[self.weight_dtype] + vocab * DTYPE_BYTES["bf16"]

    def summary(self, tp: int) -> dict[str, Any]:
        return {
            "name": self.name, "attention": self.attention, "num_layers": self.num_layers,
            "weight_dtype": self.weight_dtype, "kv_cache_dtype": self.kv_cache_dtype,
            "matmul_params_per_token": self.matmul_params_per_token, "total_params": self.total_params,
            "weight_bytes": self.weight_bytes(), "linear_flops_per_token": self.linear_flops_per_token,
            "attn_flops_per_pair": self.attn_flops_per_pair, "attn_window_tokens": self.attn_window_tokens,
            "index_flops_per_pair": self.index_flops_per_pair, "tp": tp,
            "kv_bytes_per_token_per_rank": self.kv_bytes_per_token_per_rank(tp),
            "kv_bytes_per_token": self.kv_bytes_per_token(tp),
            "descriptors_per_block": self.descriptors_per_block(), "default_block_size": self.default_block_size,
        }


def _check_tp(tp: int) -> None:
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tp must be an integer >= 1, got {tp!r}")


class _Fields:
    """Reads config fields; every error names the field and the file."""

    def __init__(self, data: Mapping[str, Any], source: str) -> None:
        self.data, self.source = data, source

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def int(self, name: str, why: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.data.get(name)
        if value is None:
            if default is not None:
                return default
            raise ConfigError(f"{self.source}: field {name!r} is missing ({why})")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{self.source}: field {name!r} must be an integer >= {minimum}, got {value!r}")
        return value

    def str(self, name: str, default: str) -> str:
        value = self.data.get(name, default)
        if value is None:
            return default
        if not isinstance(value, str):
            raise ConfigError(f"{self.source}: field {name!r} must be a string, got {value!r}")
        return value


def load_config(path: str | pathlib.Path) -> dict[str, Any]:
    path = pathlib.Path(path)
    try:
        data = jsondata.read_json(path, ConfigError)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config must be a JSON object")
    return data


def architecture_from_config_file(path: str | pathlib.Path, kv_cache_dtype: str = "auto",
                                  name: str | None = None) -> Architecture:
    data = load_config(path)
    return architecture_from_config(data, kv_cache_dtype, name or pathlib.Path(path).stem, source=str(path))


def architecture_from_config(config: Mapping[str, Any], kv_cache_dtype: str = "auto", name: str = "model",
                             source: str = "config.json") -> Architecture:
    """Derive an :class:`Architecture`; ``kv_cache_dtype`` is vLLM's (``auto`` = the model dtype)."""
    if not isinstance(config, Mapping):
        raise ConfigError(f"{source}: a config must be a JSON object")
    if isinstance(config.get("text_config"), Mapping):  # multimodal wrappers keep the LM in text_config
        config = {**config["text_config"], "quantization_config": config.get("quantization_config")}
    f = _Fields(config, source)
    layers = f.int("num_hidden_layers", "layer count")
    hidden = f.int("hidden_size", "hidden dimension")
    heads = f.int("num_attention_heads", "query heads")
    vocab = f.int("vocab_size", "embedding and LM head size")

    act_dtype = _activation_dtype(f)
    weight_dtype = _weight_dtype(f, act_dtype)
    kv_dtype = _kv_dtype(kv_cache_dtype, act_dtype, source)

    mla = f.has("kv_lora_rank")
    if mla:
        attn = _mla_attention(f, hidden, heads, kv_dtype)
    else:
        attn = _gqa_attention(f, hidden, heads, kv_dtype)
    mlp = _mlp(f, hidden, layers)

    tied = bool(config.get("tie_word_embeddings", False))
    vocab_stored = float(vocab * hidden * (1 if tied else 2))
    matmul_active = layers * attn["params"] + mlp["active"]
    total = layers * attn["params"] + mlp["total"] + vocab_stored
    return Architecture(
        name=name,
        attention="mla" if mla else "gqa",
        num_layers=layers,
        hidden_size=hidden,
        weight_dtype=weight_dtype,
        kv_cache_dtype=kv_dtype,
        matmul_params_per_token=float(matmul_active),
        total_params=float(total),
        lm_head_params=float(vocab * hidden),
        vocab_params_stored=vocab_stored,
        attn_flops_per_pair=float(attn["flops_per_pair"] * layers),
        attn_window_tokens=attn["window"],
        index_flops_per_pair=float(attn["index_flops_per_pair"] * layers),
        num_kv_heads=attn["kv_heads"],
        kv_bytes_per_token_per_layer_unsplit=float(attn["kv_bytes_per_layer"]),
        kv_regions_per_layer=attn["regions"],
        expert_params=float(mlp["expert_params"]),
        experts_per_token=mlp["experts_per_token"],
        moe_experts=mlp["experts"],
        **_sliding(f, layers),
    )


def _sliding(f: _Fields, layers: int) -> dict[str, int]:
    """Layers whose attention reads at most ``sliding_window`` keys (``layer_types`` names them), for decode's
    KV read; the KV bytes per token stay every layer's (what a transfer moves and the pool holds)."""
    kinds = f.data.get("layer_types")
    if not kinds:
        return {}
    if not isinstance(kinds, list) or len(kinds) != layers:
        raise ConfigError(f"{f.source}: field 'layer_types' must list one kind per layer ({layers})")
    sliding = sum(1 for k in kinds if k == "sliding_attention")
    if not sliding:
        return {}
    return {"sliding_layers": sliding, "sliding_window_tokens": f.int("sliding_window", "tokens a sliding layer reads")}


def _activation_dtype(f: _Fields) -> str:
    raw = f.str("torch_dtype", f.str("dtype", "bfloat16"))
    if raw not in _TORCH_DTYPES:
        raise ConfigError(f"{f.source}: field 'torch_dtype' must be one of {sorted(_TORCH_DTYPES)}, got {raw!r}")
    return _TORCH_DTYPES[raw]


def _weight_dtype(f: _Fields, act_dtype: str) -> str:
    quant = f.data.get("quantization_config")
    if quant is None:
        return "bf16" if act_dtype in ("bf16", "fp16") else act_dtype
    if not isinstance(quant, Mapping):
        raise ConfigError(f"{f.source}: field 'quantization_config' must be an object")
    method = str(quant.get("quant_method", "")).lower()
    if method == "fp8" or "fp8" in str(quant.get("fmt", "")).lower():
        return "fp8"
    raise ConfigError(f"{f.source}: field 'quantization_config.quant_method' {method!r} is not supported (fp8 only)")


def _kv_dtype(kv_cache_dtype: str, act_dtype: str, source: str) -> str:
    if kv_cache_dtype == "auto":
        return "bf16" if act_dtype in ("bf16", "fp16") else act_dtype
    if kv_cache_dtype in ("bf16", "bfloat16"):
        return "bf16"
    if kv_cache_dtype in ("fp8", "fp8_e4m3", "fp8_ds_mla"):
        return "fp8"
    raise ConfigError(f"{source}: kv_cache_dtype must be auto, bf16 or fp8, got {kv_cache_dtype!r}")


def _gqa_attention(f: _Fields, hidden: int, heads: int, kv_dtype: str) -> dict[str, Any]:
    kv_heads = f.int("num_key_value_heads", "GQA KV heads set the KV bytes per token")
    if heads % kv_heads:
        raise ConfigError(f"{f.source}: field 'num_key_value_heads' ({kv_heads}) must divide "
                          f"num_attention_heads ({heads})")
    if f.has("head_dim"):
        head_dim = f.int("head_dim", "head dimension")
    elif hidden % heads == 0:
        head_dim = hidden // heads
    else:
        raise ConfigError(f"{f.source}: field 'head_dim' is missing and hidden_size/num_attention_heads is not whole")
    q, kv = heads * head_dim, kv_heads * head_dim
    return {
        "params": hidden * q + 2 * hidden * kv + q * hidden,
        "flops_per_pair": 4 * heads * head_dim,
        "window": 0,
        "index_flops_per_pair": 0,
        "kv_heads": kv_heads,
        "kv_bytes_per_layer": 2 * kv * DTYPE_BYTES[kv_dtype],
        "regions": 2,
    }


def _mla_attention(f: _Fields, hidden: int, heads: int, kv_dtype: str) -> dict[str, Any]:
    kv_lora = f.int("kv_lora_rank", "MLA latent width")
    rope = f.int("qk_rope_head_dim", "MLA decoupled RoPE key width")
    nope = f.int("qk_nope_head_dim", "MLA per-head non-RoPE query/key width")
    v = f.int("v_head_dim", "MLA value head width")
    q_lora = f.int("q_lora_rank", "", default=0, minimum=0) if f.has("q_lora_rank") else 0
    qk = nope + rope
    q_params = hidden * q_lora + q_lora * heads * qk if q_lora else hidden * heads * qk
    params = q_params + hidden * (kv_lora + rope) + kv_lora * heads * (nope + v) + heads * v * hidden
    if kv_dtype == "fp8":
        kv_bytes = kv_lora + 4 * -(-kv_lora // 128) + 2 * rope  # fp8_ds_mla: 656 B for 512 + 64
    else:
        kv_bytes = (kv_lora + rope) * DTYPE_BYTES[kv_dtype]
    regions = 1
    if f.has("index_topk"):
        topk = f.int("index_topk", "DSA keys per query")
        idx_heads = f.int("index_n_heads", "DSA indexer heads")
        idx_dim = f.int("index_head_dim", "DSA indexer head width")
        if not q_lora:
            raise ConfigError(f"{f.source}: field 'q_lora_rank' is missing (the DSA indexer projects from it)")
        params += q_lora * idx_heads * idx_dim + hidden * idx_dim + hidden * idx_heads
        flops_per_pair = 2 * heads * (kv_lora + rope) + 2 * heads * kv_lora  # absorbed (latent) form
        index_flops = 2 * idx_heads * idx_dim
        kv_bytes += idx_dim + 4 * -(-idx_dim // DSA_INDEX_QUANT_BLOCK)
        regions += 1
        window = topk
    else:
        flops_per_pair = 2 * heads * qk + 2 * heads * v  # vLLM's MHA-form MLA prefill
        index_flops, window = 0, 0
    return {"params": params, "flops_per_pair": flops_per_pair, "window": window,
            "index_flops_per_pair": index_flops, "kv_heads": 1, "kv_bytes_per_layer": kv_bytes,
            "regions": regions}


def _mlp(f: _Fields, hidden: int, layers: int) -> dict[str, Any]:
    mats = 3 if f.str("hidden_act", "silu") in _GATED_ACTS else 2
    # DeepSeek/GLM name routed experts n_routed_experts, Qwen num_experts, Mixtral/gpt-oss num_local_experts
    # (whose experts are intermediate_size wide: no separate moe_intermediate_size)
    names = [n for n in ("n_routed_experts", "num_experts", "num_local_experts") if f.data.get(n) is not None]
    if not names:
        inter = f.int("intermediate_size", "dense MLP width")
        dense = mats * hidden * inter
        return {"active": layers * dense, "total": layers * dense, "expert_params": 0, "experts_per_token": 0,
                "experts": 0}
    experts = f.int(names[0], "routed experts")
    top_k = f.int("num_experts_per_tok", "routed experts per token")
    moe_inter = (f.int("intermediate_size", "expert MLP width") if names[0] == "num_local_experts"
                 and not f.has("moe_intermediate_size") else f.int("moe_intermediate_size", "expert MLP width"))
    shared = f.int("n_shared_experts", "", default=0, minimum=0) if f.has("n_shared_experts") else 0
    shared_inter = (f.int("shared_expert_intermediate_size", "", minimum=0)
                    if f.has("shared_expert_intermediate_size") else shared * moe_inter)
    first_dense = f.int("first_k_dense_replace", "", default=0, minimum=0) if f.has("first_k_dense_replace") else 0
    dense_only = f.data.get("mlp_only_layers") or []
    if not isinstance(dense_only, list):
        raise ConfigError(f"{f.source}: field 'mlp_only_layers' must be a list of layer indices")
    n_dense = max(first_dense, len(dense_only))
    if n_dense > layers:
        raise ConfigError(f"{f.source}: field 'first_k_dense_replace' ({n_dense}) exceeds num_hidden_layers")
    n_moe = layers - n_dense
    dense = mats * hidden * f.int("intermediate_size", "dense MLP width of the first layers") if n_dense else 0
    expert = mats * hidden * moe_inter
    router = hidden * experts
    shared_params = mats * hidden * shared_inter
    return {
        "active": n_dense * dense + n_moe * (top_k * expert + shared_params + router),
        "total": n_dense * dense + n_moe * (experts * expert + shared_params + router),
        "expert_params": n_moe * expert,
        "experts_per_token": top_k,
        "experts": experts,
    }
