"""The decode step (calibration.decode_step) and its cross-model fit (calibration.decode_fit) on the shipped data."""

from __future__ import annotations

import dataclasses
import json

import pytest

from calibration import decode_fit
from calibration.architecture import architecture_from_config_file
from calibration.decode_published import load_decode_published
from calibration.decode_step import DecodeOverheads, step_physics, step_s, touched_experts
from calibration.hardware import DATA_DIR, load_hardware

H100 = load_hardware("p5")
REPORT = decode_fit.report()
SHIPPED = decode_fit.load_record()


def _arch(name: str):
    return architecture_from_config_file(DATA_DIR / f"config_{name}.json")


def test_shipped_decode_fit_is_the_fit_of_the_shipped_rows():
    """CI refits from data/decode_published.csv: the shipped overheads and error summaries must be what that gives."""
    fresh = decode_fit.overheads_record(REPORT)
    for name in decode_fit.PARAMS:
        assert SHIPPED[name] == pytest.approx(fresh[name], rel=1e-6, abs=1e-12), name
    assert SHIPPED["rows"] == fresh["rows"] and SHIPPED["models"] == fresh["models"] and SHIPPED["gpus"] == fresh["gpus"]
    for key in ("leave_one_model_out_summary", "leave_one_gpu_out_summary"):
        assert [s["held_out"] for s in SHIPPED[key]] == [s["held_out"] for s in fresh[key]]
        for a, b in zip(SHIPPED[key], fresh[key]):
            assert a["median_abs_error"] == pytest.approx(b["median_abs_error"], abs=1e-6)


def test_the_fit_spans_models_gpus_dense_and_moe():
    rows = decode_fit.fitted_rows()
    assert len(rows) >= 20
    assert len({r.model_key for r in rows}) >= 4
    assert {r.arch.moe_experts > 0 for r in rows} == {True, False}
    assert not any(r.figure.heldout for r in rows)


def test_leave_one_model_out_predicts_no_row_it_was_fitted_on():
    lomo = REPORT["leave_one_model_out"]
    assert {e["held_out"] for e in lomo} == {r.model_key for r in decode_fit.fitted_rows()}
    for e in lomo:
        assert e["model"] not in e["trained_on"].split(" of ", 1)[1].split(", ")
    every = next(s for s in REPORT["leave_one_model_out_summary"] if s["held_out"] == "all")
    assert every["points"] == len(lomo)


def _every(key: str) -> dict:
    return next(s for s in REPORT[key] if s["held_out"] == "all")


def test_leave_one_out_error_bounds():
    """What the shipped data gives (calibration/README.md 'Decode across models'): a model no fit saw within 18 %
    (median of the models' medians; 23 % over every row), a GPU no fit saw within 19 % over every row. Guards the
    fit against regressions; the 15 % goal is the test below."""
    model, gpu = _every("leave_one_model_out_summary"), _every("leave_one_gpu_out_summary")
    assert model["median_of_group_medians"] <= 0.18 and model["median_abs_error"] <= 0.23, model
    assert gpu["median_abs_error"] <= 0.19, gpu


@pytest.mark.xfail(strict=True, reason="the goal, not met on the collected data: leave-one-model-out TPOT median "
                   "17.2 % over the models' medians, 22.2 % over every row; gpt-oss-120b (54 %) and DeepSeek-R1 (50 %) "
                   "are the models the others do not predict, and Dynamo's Llama-3.1-70B P/D decode workers are predicted "
                   "up to 62 % too fast (calibration/README.md 'Decode across models')")
def test_leave_one_model_out_tpot_median_within_15_percent():
    every = _every("leave_one_model_out_summary")
    assert every["median_of_group_medians"] <= 0.15 and every["median_abs_error"] <= 0.15, every


def test_heldout_row_is_never_fitted():
    heldout = [f for f in load_decode_published() if f.heldout]
    assert heldout and all(decode_fit.exclusion(f).startswith("held out") for f in heldout)


def test_touched_experts_by_hand():
    # 8 experts, 2 per token: one sequence touches 2; two touch 2 + 2 x 6/8 = 3.5 in expectation
    assert touched_experts(8, 2, 1) == pytest.approx(2.0)
    assert touched_experts(8, 2, 2) == pytest.approx(8 * (1 - (6 / 8) ** 2)) == pytest.approx(3.5)
    assert touched_experts(8, 2, 1000) == pytest.approx(8.0)
    assert touched_experts(0, 0, 64) == 0.0


def test_dense_step_physics_by_hand():
    """Llama-3.3-70B BF16 at TP4: every rank reads a quarter of (matmul weights x 2 B + the BF16 LM head)."""
    arch = _arch("llama-3.3-70b")
    p = step_physics(arch, H100, 4, "BF16", 2, 1000)
    assert p.weight_bytes == pytest.approx((arch.matmul_params_per_token + arch.lm_head_params) * 2 / 4)
    # KV: 2 sequences x 1000 tokens x (2 x 2 KV heads on this rank x 128 x 2 B) x 80 layers
    assert p.kv_bytes == pytest.approx(2 * 1000 * 2 * 2 * 128 * 2 * 80)
    assert p.allreduces == 160
    assert step_physics(arch, H100, 1, "BF16", 2, 1000).allreduces == 0
    assert step_physics(arch, H100, 4, "FP8", 2, 1000).weight_bytes < p.weight_bytes


def test_sliding_layers_read_at_most_their_window():
    arch = _arch("gpt-oss-120b")
    assert arch.sliding_layers == 18 and arch.sliding_window_tokens == 128
    short = step_physics(arch, H100, 8, "FP4", 1, 128).kv_bytes
    long = step_physics(arch, H100, 8, "FP4", 1, 1128).kv_bytes
    per_layer_token = arch.kv_bytes_per_token_per_rank(8) / arch.num_layers
    assert long - short == pytest.approx(1000 * 18 * per_layer_token)  # only the 18 full layers grow


def test_fp4_quantizes_experts_only():
    arch = _arch("gpt-oss-120b")
    fp4 = step_physics(arch, H100, 1, "FP4", 1, 0).weight_bytes
    bf16 = step_physics(arch, H100, 1, "BF16", 1, 0).weight_bytes
    experts = arch.experts_per_token * arch.expert_params
    assert bf16 - fp4 == pytest.approx(experts * (2 - 4.25 / 8))


def test_step_adds_each_overhead_once():
    arch = _arch("qwen3-8b")
    zero = DecodeOverheads(hbm_efficiency=1.0, per_layer_s=0.0, per_allreduce_s=0.0, per_seq_s=0.0, mixed_prefill_mfu=0.5)
    base = step_s(step_physics(arch, H100, 2, "BF16", 4, 100), H100, "BF16", 4, zero)
    more = dataclasses.replace(zero, per_layer_s=1e-6, per_allreduce_s=2e-6, per_seq_s=3e-6)
    got = step_s(step_physics(arch, H100, 2, "BF16", 4, 100), H100, "BF16", 4, more)
    assert got - base == pytest.approx(36 * 1e-6 + 72 * 2e-6 + 4 * 3e-6)


def test_every_model_counts_once_in_the_fit():
    """Duplicating one model's rows barely moves the fit: each model's rows are weighted 1 / their count (exactly
    invariant within the loss's quadratic part; soft L1 applies after the weight, so outliers shift it ~1 %);"""
    rows = decode_fit.fitted_rows()
    many = max({r.model_key for r in rows}, key=lambda m: sum(r.model_key == m for r in rows))
    doubled = rows + [r for r in rows if r.model_key == many]
    a, b = decode_fit.fit(rows), decode_fit.fit(doubled)
    for r in rows:
        assert decode_fit.predict_s(r, b) == pytest.approx(decode_fit.predict_s(r, a), rel=0.02), r.label()


def test_rows_out_of_the_fit_say_why():
    reasons = {r["reason"] for r in REPORT["excluded"]}
    assert any(r.startswith("engine SGLang") for r in reasons)
    assert any(r.startswith("speculative decoding") for r in reasons)
    assert any(r.startswith("held out") for r in reasons)


def test_mixtral_parses_num_local_experts():
    """Mixtral names its experts num_local_experts, as wide as intermediate_size: 46.7 B parameters in all, 12.9 B
    active (Mistral's model card), within the embeddings' rounding."""
    arch = _arch("mixtral-8x7b")
    assert arch.moe_experts == 8 and arch.experts_per_token == 2
    assert arch.total_params == pytest.approx(46.7e9, rel=0.01)
    assert arch.matmul_params_per_token + arch.lm_head_params == pytest.approx(12.9e9, rel=0.02)


def test_cli_prints_both_leave_one_out_tables(capsys):
    assert decode_fit.main(["--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| model held out |" in out and "| GPU held out |" in out and "**all**" in out


def test_shipped_record_is_valid_json_with_every_parameter():
    data = json.loads(decode_fit.OVERHEADS_JSON.read_text())
    assert set(decode_fit.PARAMS) <= set(data)
    o = decode_fit.load_overheads()
    for name, lo, hi in zip(decode_fit.PARAMS, decode_fit.LOWER, decode_fit.UPPER):
        assert lo <= getattr(o, name) <= hi


def test_published_ttft_rows_are_predicted_above_their_flop_floor():
    """calibration.prefill_published: the concurrency-1 TTFT rows (two BF16 dense GQA models on H100) each get a
    prediction, never below the prompt's linear-layer FLOPs at the GPU's BF16 peak."""
    from calibration.prefill_published import rows as ttft_rows

    points = ttft_rows()
    assert {p["model"] for p in points} >= {"Qwen3-8B", "Qwen2.5-72B-Instruct"}
    for p in points:
        arch = _arch("qwen3-8b" if p["model"] == "Qwen3-8B" else "qwen2.5-72b")
        floor_ms = 1e3 * 2 * arch.matmul_params_per_token * p["input_tokens"] / (p["tp"] * 989e12)
        assert p["predicted_ms"] > floor_ms, p
        assert p["prefill_from"].startswith("Qwen3-32B"), p
