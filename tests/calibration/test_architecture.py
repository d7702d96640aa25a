"""KV bytes, FLOPs and descriptor counts derived from config.json files the tests write."""

from __future__ import annotations

import pytest

from calibration.architecture import ConfigError, architecture_from_config, architecture_from_config_file
from tests.calibration.conftest import GLM5_FP8, QWEN3_32B


def test_qwen3_32b_kv_bytes_match_brief(write_config):
    arch = architecture_from_config_file(write_config(QWEN3_32B))
    # 2 (K, V) x 8 KV heads x 128 head_dim x 2 B (BF16) x 64 layers
    assert arch.kv_bytes_per_token(tp=1) == 262_144
    assert arch.kv_bytes_per_token(tp=8) == 262_144  # heads split over ranks: same total
    assert arch.kv_bytes_per_token_per_rank(tp=8) == 32_768  # 32 KiB per rank at TP8
    assert arch.descriptors_per_block() == 2 * 64  # K and V regions per layer
    assert arch.default_block_size == 16


def test_qwen3_32b_flops_by_hand(write_config):
    arch = architecture_from_config_file(write_config(QWEN3_32B))
    attn = 5120 * 8192 + 2 * 5120 * 1024 + 8192 * 5120  # q, k, v, o projections
    mlp = 3 * 5120 * 25600  # gate, up, down
    assert arch.matmul_params_per_token == 64 * (attn + mlp) == 31_205_621_760
    assert arch.linear_flops_per_token == 2 * arch.matmul_params_per_token
    assert arch.attn_flops_per_pair == 4 * 64 * 128 * 64  # QK^T + PV per pair, all layers
    assert arch.attn_window_tokens == 0 and arch.index_flops_per_pair == 0
    assert arch.weight_dtype == "bf16"


def test_gqa_kv_replicated_when_tp_exceeds_kv_heads(write_config):
    arch = architecture_from_config_file(write_config({**QWEN3_32B, "num_key_value_heads": 4, "num_attention_heads": 64}))
    # 4 KV heads on 8 ranks: each rank holds one head (replicated twice)
    assert arch.kv_bytes_per_token_per_rank(8) == 2 * 1 * 128 * 2 * 64
    assert arch.kv_bytes_per_token(8) == 8 * arch.kv_bytes_per_token_per_rank(8)


def test_glm5_mla_dsa_kv_bytes_and_active_params(write_config):
    arch = architecture_from_config_file(write_config(GLM5_FP8))
    # BF16 latent (512 + 64) x 2 B + DSA indexer key (128 FP8 + one FP32 scale), per layer, 78 layers
    assert arch.kv_bytes_per_token_per_rank(8) == (576 * 2 + 132) * 78 == 100_152
    assert arch.kv_bytes_per_token(8) == 8 * 100_152  # the latent is replicated on every rank
    assert arch.attention == "mla" and arch.weight_dtype == "fp8"
    assert arch.attn_window_tokens == 2048
    assert arch.descriptors_per_block() == 2 * 78  # latent + indexer region per layer
    assert arch.default_block_size == 64
    assert 39e9 < arch.matmul_params_per_token < 41e9  # "40 B active"
    assert 740e9 < arch.total_params < 750e9  # "744 B total"


def test_mla_fp8_cache_is_vllm_ds_mla_format(write_config):
    arch = architecture_from_config_file(write_config(GLM5_FP8), kv_cache_dtype="fp8")
    assert arch.kv_bytes_per_token_per_rank(8) == (656 + 132) * 78  # ~61 KB


def test_mla_without_indexer(write_config):
    config = {k: v for k, v in GLM5_FP8.items() if not k.startswith("index_")}
    arch = architecture_from_config_file(write_config(config))
    assert arch.kv_bytes_per_token_per_rank(1) == 576 * 2 * 78
    assert arch.descriptors_per_block() == 78 and arch.attn_window_tokens == 0


@pytest.mark.parametrize("field", ["num_key_value_heads", "num_hidden_layers", "hidden_size", "vocab_size",
                                   "num_attention_heads", "intermediate_size"])
def test_missing_gqa_field_is_named(write_config, field):
    config = {k: v for k, v in QWEN3_32B.items() if k != field}
    with pytest.raises(ConfigError, match=field):
        architecture_from_config_file(write_config(config))


@pytest.mark.parametrize("field", ["qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "index_n_heads",
                                   "num_experts_per_tok", "moe_intermediate_size"])
def test_missing_mla_field_is_named(write_config, field):
    config = {k: v for k, v in GLM5_FP8.items() if k != field}
    with pytest.raises(ConfigError, match=field):
        architecture_from_config_file(write_config(config))


@pytest.mark.parametrize("field,value", [("num_key_value_heads", 0), ("num_hidden_layers", "64"),
                                         ("head_dim", -1), ("num_key_value_heads", 7), ("torch_dtype", "int4")])
def test_invalid_field_is_named(write_config, field, value):
    with pytest.raises(ConfigError, match=field):
        architecture_from_config_file(write_config({**QWEN3_32B, field: value}))


def test_tp_that_does_not_split_kv_heads(write_config):
    arch = architecture_from_config_file(write_config(QWEN3_32B))
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        arch.kv_bytes_per_token(3)


def test_bad_json_and_missing_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        architecture_from_config_file(bad)
    with pytest.raises(ConfigError, match="no such"):
        architecture_from_config_file(tmp_path / "absent.json")
    with pytest.raises(ConfigError, match="JSON object"):
        architecture_from_config([1, 2])  # type: ignore[arg-type]
