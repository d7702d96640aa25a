"""Config files the calibration tests write (never the shipped ones)."""

from __future__ import annotations

import json
import pathlib

import pytest

QWEN3_32B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 5120,
    "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False, "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}

GLM5_FP8 = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": 6144,
    "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_hidden_layers": 78, "first_k_dense_replace": 3,
    "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512,
    "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
    "vocab_size": 154880, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
}


@pytest.fixture
def write_config(tmp_path: pathlib.Path):
    def write(config: dict, name: str = "config.json") -> pathlib.Path:
        path = tmp_path / name
        path.write_text(json.dumps(config))
        return path

    return write
