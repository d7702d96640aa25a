"""The fit: reproduces consistent data exactly, ships what it states, and says what it cannot reach."""

from __future__ import annotations

import dataclasses
import math
import json

import numpy as np
import pytest

from calibration.build import profile_from_architecture
from calibration.closed_form import OVERLAPPED_ASSEMBLY, SERIAL_ASSEMBLY, turn_metrics
from calibration.efficiencies import HardwareEfficiencies, load_efficiencies
from calibration.fit import TERM_NAMES, efficiencies_from_vector, fit, leave_one_out, metric_s, run, target
from calibration.profile import LatencyProfile
from calibration.published import MEASURED, BenchmarkShape, PublishedFigure, load_published
from tests.calibration.conftest import QWEN3_32B

TRUE_X = dict(prefill_fixed_per_layer_s=1.5e-3, gemm_cost_factor=3.0, attention_cost_factor=1.5,
              transfer_setup_s=0.02, transfer_per_descriptor_s=4e-7, efa_cost_factor=2.0,
              reuse_overhead_per_token_s=8e-6, ttft_overhead_fixed_s=2e-3, ttft_overhead_per_prompt_token_s=1e-6,
              ttft_overhead_per_reused_byte_s=5e-12)


def _synthetic_figures() -> list[PublishedFigure]:
    """The published grid, with times a known efficiency vector produces through the closed form."""
    eff = efficiencies_from_vector([TRUE_X[n] for n in TERM_NAMES], "p5en")
    shape = BenchmarkShape()
    out = []
    for f in load_published():
        profile = target(f.model).profile(eff)
        ms = metric_s(profile, f, shape, OVERLAPPED_ASSEMBLY) * 1e3  # the assembly fit() uses by default
        out.append(dataclasses.replace(f, measured_ms=ms))
    return out


@pytest.mark.parametrize("models", [["Qwen3-32B"], ["GLM-5-FP8"], ["Qwen3-32B", "GLM-5-FP8"]])
def test_fit_reproduces_consistent_figures(models):
    figures = _synthetic_figures()
    result = fit(models, figures=figures, fixed={"efa_cost_factor": TRUE_X["efa_cost_factor"]})
    assert result.max_abs_rel_error < 1e-6
    assert result.minimax_bound < 1e-6


def test_joint_fit_recovers_the_efficiencies_of_consistent_figures():
    result = fit(["Qwen3-32B", "GLM-5-FP8"], figures=_synthetic_figures())
    assert result.max_abs_rel_error < 1e-6
    np.testing.assert_allclose(result.x, [TRUE_X[n] for n in TERM_NAMES], rtol=1e-4)


def _same_fit(a, b, path="") -> list[str]:
    """Where two fit outputs differ beyond float rounding (scipy/BLAS builds differ in the last digits)."""
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
        a, b = dataclasses.asdict(a), dataclasses.asdict(b)
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(a.keys() ^ b.keys())}"]
        return [d for k in a for d in _same_fit(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same_fit(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return [] if math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-18) else [f"{path}: {a!r} vs {b!r}"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def test_shipped_profiles_are_the_current_fit():
    fresh = run(write=False)["profiles"]
    for d in MEASURED:
        shipped = LatencyProfile.load(d.profile_name)
        assert _same_fit(shipped, fresh[d.model]) == []
    assert _same_fit(load_efficiencies("p5en"), run(write=False)["efficiencies"]) == []


@pytest.mark.parametrize("name", [d.profile_name for d in MEASURED])
def test_shipped_profile_states_its_errors_honestly(name):
    """Every figure's closed-form error is the one the profile states, and the figures it lists as
    outside 3 % are exactly those outside 3 %."""
    profile = LatencyProfile.load(name)
    stated = profile.provenance["residuals"]
    assert len(stated) == 10
    shape = BenchmarkShape()
    outside = []
    for row in stated:
        m = turn_metrics(profile, row["prompt_tokens"], row["mode"] == "on", shape.user_tokens)
        ms = m[f"{row['metric']}_s"] * 1e3
        assert ms == pytest.approx(row["fitted_ms"], rel=1e-9)
        assert ms / row["measured_ms"] - 1 == pytest.approx(row["rel_error"], abs=1e-9)
        if abs(row["rel_error"]) > 0.03:
            outside.append(row)
    assert outside == profile.provenance["not_within_3_percent"]
    assert profile.provenance["max_abs_rel_error"] >= profile.provenance["minimax_bound"] - 1e-9


def test_glm_within_3_percent_only_under_the_overlapped_assembly():
    efa = load_efficiencies("p5en").efa_efficiency
    sim = fit(["GLM-5-FP8"], fixed={"efa_cost_factor": 1 / efa}, assembly=SERIAL_ASSEMBLY)
    proposed = fit(["GLM-5-FP8"], fixed={"efa_cost_factor": 1 / efa}, assembly=OVERLAPPED_ASSEMBLY)
    assert sim.minimax_bound > 0.03  # no parameter set within the bounds reaches 3 % on every figure
    assert proposed.max_abs_rel_error < 0.03


def test_qwen_infeasible_under_either_assembly():
    """Published Qwen3-32B 2k ON: TTFT 122 ms < prefill 128 ms, and TTFT >= prefill in any serial
    assembly: one of the two is off by at least 6 / 250 = 2.4 %; with the rest it is more."""
    for assembly, at_least in ((SERIAL_ASSEMBLY, 0.09), (OVERLAPPED_ASSEMBLY, 0.03)):
        result = fit(["Qwen3-32B"], fixed={"efa_cost_factor": 2.0}, assembly=assembly)
        assert result.minimax_bound > at_least


def test_leave_one_out_rows():
    rows = leave_one_out()
    assert len(rows) == 20
    assert all(r["trained_on"] != r["model"] and np.isfinite(r["rel_error"]) for r in rows)


def test_profile_from_architecture(write_config):
    path = write_config(QWEN3_32B, "qwen3.json")
    p = profile_from_architecture(path, "p5en", 8, name="Qwen3-32B")
    assert p.kv_bytes_per_token == 262_144 and p.block_size == 16 and p.name == "Qwen3-32B@p5en-tp8"
    assert {f["what"] for f in p.provenance["floors"]} == {"prefill_off", "transfer_on"}
    assert all(f["profile_over_floor"] >= 1 for f in p.provenance["floors"])
    assert LatencyProfile.from_dict(json.loads(p.to_json())) == p
    p4 = profile_from_architecture(path, "p5en", 4)
    assert p4.prefill_per_token_s == pytest.approx(2 * p.prefill_per_token_s)
    assert p4.transfer_bytes_per_s == pytest.approx(p.transfer_bytes_per_s / 2)


def test_profile_from_architecture_errors(write_config, tmp_path):
    path = write_config(QWEN3_32B)
    with pytest.raises(ValueError, match="hardware"):
        profile_from_architecture(path, "no-such-hardware", 8)
    with pytest.raises(ValueError, match="tp"):
        profile_from_architecture(path, "p5en", 16)
    data = json.loads(load_efficiencies("p5en").to_json())
    bad = tmp_path / "eff.json"
    bad.write_text(json.dumps({**data, "gemm_mfu": 1.5}))
    with pytest.raises(ValueError, match="gemm_mfu"):
        profile_from_architecture(path, "p5en", 8, str(bad))
    del data["transfer_setup_s"]
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="transfer_setup_s"):
        profile_from_architecture(path, "p5en", 8, str(bad))


def test_efficiencies_round_trip():
    eff = load_efficiencies("p5en")
    assert HardwareEfficiencies.from_dict(json.loads(eff.to_json())) == eff
