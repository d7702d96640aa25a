"""Profiles for models nobody measured: which fit they carry, and how far they are off on data no fit saw.

Expected values come from data (the published CSV, vLLM PR #32553's figures, the shipped Qwen3-32B
profile), never from the code under test; the error bounds are the ones the report reaches today
(`python -m calibration.loo`), so a change that makes prediction worse fails here.
"""

from __future__ import annotations

import statistics

import pytest

from calibration.build import profile_from_architecture
from calibration.fit import leave_one_out
from calibration.heldout import CONFIG, load_heldout
from calibration.efficiencies import load_efficiencies
from calibration.loo import DEFAULT_SOURCE, NO_FAMILY, ONE_FIT, WRONG_FAMILY, report, summary
from calibration.portable import DECODE, ENGINE, FAMILY, FIELD_KINDS, PHYSICS
from calibration.profile import LatencyProfile
from calibration.published import load_published
from sim.replay.published import simulate_heldout_benchmark  # the simulator, passed into calibration.loo
from tests.calibration.conftest import GLM5_FP8, QWEN3_32B

BF16_MOE_GQA = {  # a kernel family neither measured model has (Qwen3-30B-A3B's shape)
    "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936,
    "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def loo_report():
    return report(simulate_heldout_benchmark)


def test_dense_bf16_model_carries_qwen3_32b_prefill_terms():
    """Llama-3.3-70B (BF16 dense GQA) takes Qwen3-32B's prefill terms; the carried values stay within a
    few % of Qwen3-32B's own shipped fit (the joint fit shares the engine overheads, which moves them a
    little: transfer setup 21.5 -> 21.1 ms, reuse 8.3 -> 7.7 us per token)."""
    qwen = LatencyProfile.load("qwen3-32b@p5en-tp8")
    llama = profile_from_architecture(CONFIG, "p5en", 8, name="Llama-3.3-70B")
    assert llama.provenance["carried_from"].startswith("Qwen3-32B") and llama.provenance["same_family_fit"]
    assert llama.transfer_setup_s == pytest.approx(qwen.transfer_setup_s, rel=0.03)
    assert llama.reuse_overhead_per_token_s == pytest.approx(qwen.reuse_overhead_per_token_s, rel=0.08)
    # the fixed cost per layer per forward (64 layers there, 80 here)
    assert llama.prefill_fixed_s == pytest.approx(qwen.prefill_fixed_s * 80 / 64, rel=0.01)
    # the same fraction of peak on the new FLOP count; matmul weights per layer read off the configs
    # (Q and O: hidden x heads*head_dim, K and V: hidden x kv_heads*head_dim, gated MLP: 3 matrices)
    qwen_params = 64 * (5120 * 8192 + 2 * 5120 * 1024 + 8192 * 5120 + 3 * 5120 * 25600)
    llama_params = 80 * (8192 * 8192 + 2 * 8192 * 1024 + 8192 * 8192 + 3 * 8192 * 28672)
    assert llama.prefill_per_token_s == pytest.approx(qwen.prefill_per_token_s * llama_params / qwen_params, rel=0.03)
    assert llama.kv_bytes_per_token == 2 * 8 * 128 * 2 * 80  # BF16 K and V, 8 KV heads, 80 layers


def test_family_rule(write_config):
    glm_like = profile_from_architecture(write_config(GLM5_FP8, "glm.json"), "p5en", 8)
    assert glm_like.provenance["carried_from"].startswith("GLM-5-FP8")
    glm = LatencyProfile.load("glm-5-fp8@p5en-tp8")
    assert glm_like.prefill_fixed_s == pytest.approx(glm.prefill_fixed_s, rel=0.03)
    assert glm_like.prefill_per_token_s == pytest.approx(glm.prefill_per_token_s, rel=0.01)
    other = profile_from_architecture(write_config(BF16_MOE_GQA, "moe.json"), "p5en", 2)
    assert other.provenance["carried_from"].startswith("the two-model compromise")
    assert "BF16 MoE GQA" in other.provenance["carried_from"] and not other.provenance["same_family_fit"]
    # the compromise's prefill terms (data/p5en_efficiencies.json: one fit to both), the shared overheads
    joint = load_efficiencies("p5en")
    assert other.prefill_fixed_s == pytest.approx(48 * joint.prefill_fixed_per_layer_s)
    assert other.transfer_setup_s == pytest.approx(glm_like.transfer_setup_s)


def test_every_numeric_field_has_a_kind_and_a_source(write_config):
    p = profile_from_architecture(write_config(QWEN3_32B), "p5en", 8)
    rows = {r["field"]: r for r in p.provenance["fields"]}
    assert set(rows) == set(FIELD_KINDS)
    assert {r["kind"] for r in rows.values()} == {PHYSICS, FAMILY, ENGINE, DECODE}
    assert rows["decode_fixed_s"]["from"].startswith("published vLLM decode measurements")
    assert all(rows[f]["value"] == getattr(p, f) for f in rows)
    assert rows["prefill_fixed_s"]["from"].startswith("Qwen3-32B") and rows["transfer_setup_s"]["from"].startswith("both")


def test_cross_family_leave_one_out_error_bounds():
    """Qwen3-32B and GLM-5-FP8 share no kernel family: fit on one alone, predict the other's published
    figures. Transfers carry within 76 %, prefill and TTFT only within a factor 5.4; Qwen3-32B's fit
    under-predicts GLM-5-FP8 (its GEMMs run at 5 % of FP8 peak, Qwen's at 34 % of BF16 peak), GLM-5-FP8's
    over-predicts Qwen3-32B."""
    measured = {f.key: f.measured_ms for f in load_published()}
    rows = leave_one_out()
    assert len(rows) == 20
    for r in rows:
        err = r["predicted_ms"] / measured[(r["model"], r["prompt_tokens"], r["mode"], r["metric"])] - 1
        bound = 0.76 if r["metric"] == "transfer" else 4.43
        assert abs(err) <= bound + 0.005, r
        if r["metric"] != "transfer":
            assert (err < 0) == (r["trained_on"] == "Qwen3-32B"), r


def test_same_family_heldout_model_error_bounds(loo_report):
    """Llama-3.3-70B (vLLM PR #32553, never fitted) from Qwen3-32B's fit, through the simulator. TTFT
    within 36 % at TP4 and 50 % at TP8 (the PR does not state TP; the ON median is the worst at TP4, +32 %), the OFF
    and ON means within 15 % at TP4; TPOT, from the decode step fitted across published rows (calibration.decode_fit;
    Llama-3.1-70B's among them, never this run), too fast at both: -18 % at TP4, -36 % at TP8."""
    measured = {(f.mode, f.metric, f.statistic): f.measured_ms for f in load_heldout()}
    rows = [r for r in loo_report["heldout"] if r["trained_on"] == DEFAULT_SOURCE]
    assert len(rows) == 2 * len(measured)
    for r in rows:
        err = r["predicted_ms"] / measured[(r["mode"], r["metric"], r["statistic"])] - 1
        if r["metric"] == "ttft":
            assert abs(err) <= {4: 0.36, 8: 0.50}[r["tp"]], r
            if r["tp"] == 4 and r["statistic"] == "mean":
                assert abs(err) <= 0.15, r
        else:
            assert {4: -0.30, 8: -0.50}[r["tp"]] <= err <= {4: -0.12, 8: -0.30}[r["tp"]], r


def test_family_rule_beats_the_other_sources_where_tp_is_likeliest(loo_report):
    """At TP4 the same-family prefill terms have the smallest median and max TTFT error of the four
    sources; at TP8 the smallest max, not the smallest median (the compromise's slower GEMMs happen to
    match OFF there, and miss the reused ON turns by +73 %: the known failure)."""
    groups = {(s["trained_on"], s["model"]): s for s in summary(loo_report["heldout"]) if s["group"] == "prefill/TTFT"}
    sources = {t for t, _ in groups}
    assert sources == {DEFAULT_SOURCE, WRONG_FAMILY, NO_FAMILY, ONE_FIT}
    measured_on_p50 = next(f.measured_ms for f in load_heldout() if (f.mode, f.metric, f.statistic) == ("on", "ttft", "p50"))
    one_fit_on_p50 = next(r["predicted_ms"] for r in loo_report["heldout"] if r["trained_on"] == ONE_FIT
                          and r["tp"] == 8 and (r["mode"], r["metric"], r["statistic"]) == ("on", "ttft", "p50"))
    assert one_fit_on_p50 / measured_on_p50 - 1 > 0.6
    tp4 = {t: groups[(t, "Llama-3.3-70B (TP4)")] for t in sources}
    tp8 = {t: groups[(t, "Llama-3.3-70B (TP8)")] for t in sources}
    assert min(tp4, key=lambda t: tp4[t]["median_abs_error"]) == DEFAULT_SOURCE
    assert min(tp4, key=lambda t: tp4[t]["max_abs_error"]) == DEFAULT_SOURCE
    assert min(tp8, key=lambda t: tp8[t]["max_abs_error"]) == DEFAULT_SOURCE


def test_summary_statistics():
    rows = [{"trained_on": "a", "model": "m", "metric": "ttft", "rel_error": e} for e in (0.1, -0.3, 0.2)]
    (s,) = summary(rows)
    assert s["points"] == 3 and s["median_abs_error"] == pytest.approx(statistics.median([0.1, 0.3, 0.2]))
    assert s["max_abs_error"] == pytest.approx(0.3) and s["min_error"] == pytest.approx(-0.3)


def test_heldout_csv_errors_name_the_field(tmp_path):
    path = tmp_path / "h.csv"
    path.write_text("model,mode,metric,statistic,measured_ms\nX,on,ttft,mean,1\n")
    with pytest.raises(ValueError, match="requests"):
        load_heldout(path)
    path.write_text("model,mode,metric,statistic,measured_ms,requests\nX,on,itl,mean,1,3\n")
    with pytest.raises(ValueError, match="metric"):
        load_heldout(path)


def test_trust_report_names_every_kind_and_the_band_that_applies(write_config):
    from calibration.trust import trust_report

    summary = [{"trained_on": DEFAULT_SOURCE, "model": f"Llama-3.3-70B (TP{tp})", "group": g, "points": 2,
                "median_abs_error": 0.1, "max_abs_error": 0.2, "min_error": -0.2, "max_error": 0.1}
               for tp in (4, 8) for g in ("prefill/TTFT", "TPOT")]
    summary += [{"trained_on": "Qwen3-32B", "model": "GLM-5-FP8", "group": g, "points": 2, "median_abs_error": 0.5,
                 "max_abs_error": m, "min_error": -m, "max_error": -0.1} for g, m in (("prefill/TTFT", 4.43), ("transfer", 0.76))]
    same = trust_report(profile_from_architecture(write_config(QWEN3_32B), "p5en", 8), None, summary)
    assert "its family was measured" in same and "TP4: median 10 %, max 20 %" in same
    assert "prefill/TTFT |error| up to 443 %, transfer up to 76 %" in same
    for kind in ("exact (config.json x p5en)", "prefill terms from Qwen3-32B",
                 "engine terms from both measured models", "decode step from published vLLM decode measurements",
                 "TPOT |error| with its model left out of the fit"):
        assert kind in same
    other = trust_report(profile_from_architecture(write_config(BF16_MOE_GQA), "p5en", 2), "p.json", summary)
    assert "no measured model shares its family" in other and "--base-profile p.json" in other


def test_trust_report_says_when_the_band_could_not_be_computed(write_config, monkeypatch):
    import calibration.loo
    from calibration.trust import trust_report

    def broken(**_):
        raise RuntimeError("simulator down")

    monkeypatch.setattr(calibration.loo, "report", broken)
    profile = profile_from_architecture(write_config(QWEN3_32B), "p5en", 8)
    text = trust_report(profile, simulate_benchmark=simulate_heldout_benchmark)
    assert "expected error: not computed" in text and "simulator down" in text and "bidikv bench" in text
    text = trust_report(profile)  # no simulator passed in (python -m calibration.cli profile)
    assert "expected error: not computed, it runs the simulator" in text and "bidikv bench" in text


def test_profile_is_byte_identical_when_built_again(write_config):
    from calibration.shared_fit import carried_fit, compromise_fit

    path = write_config(BF16_MOE_GQA)  # needs both the carried and the compromise fit
    first = profile_from_architecture(path, "p5en", 2).to_json()
    carried_fit.cache_clear()
    compromise_fit.cache_clear()
    assert profile_from_architecture(path, "p5en", 2).to_json() == first
