"""The profile the simulator consumes: equations, JSON round trip, errors naming the field."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from calibration.prefill import causal_pairs, windowed_pairs
from calibration.profile import LatencyProfile
from calibration.published import MEASURED
from impl.policy import BreakEvenThreshold, KVCostModel


def _shipped() -> list[LatencyProfile]:
    return [LatencyProfile.load(d.profile_name) for d in MEASURED]


def test_shipped_profiles_load_and_are_cost_models():
    for p in _shipped():
        assert isinstance(p, KVCostModel)
        assert p.decode_blocks() > 0
        assert BreakEvenThreshold(p).break_even_tokens(p.block_size) is not None


def test_json_round_trip(tmp_path):
    for p in _shipped():
        again = LatencyProfile.from_dict(json.loads(p.to_json()))
        assert again == p and again.provenance == p.provenance
        path = tmp_path / f"{p.name}.json"
        path.write_text(p.to_json())
        assert LatencyProfile.load(str(path)) == p


def _data() -> dict:
    return json.loads(_shipped()[0].to_json())


@pytest.mark.parametrize("field", ["kv_bytes_per_token", "ttft_overhead_per_reused_byte_s", "block_size"])
def test_missing_field_named(field):
    data = _data()
    del data[field]
    with pytest.raises(ValueError, match=field):
        LatencyProfile.from_dict(data)


@pytest.mark.parametrize("field,value", [("prefill_fixed_s", -1.0), ("transfer_bytes_per_s", 0.0),
                                         ("block_size", 0), ("tp", 0), ("attn_window_tokens", 1.5),
                                         ("reuse_overhead_per_token_s", "8e-6"), ("decode_fixed_s", float("nan")),
                                         ("name", 3)])
def test_invalid_field_named(field, value):
    with pytest.raises(ValueError, match=field):
        LatencyProfile.from_dict({**_data(), field: value})


def test_unknown_field_and_old_scalar_ttft_field_rejected():
    with pytest.raises(ValueError, match="ttft_overhead_s"):
        LatencyProfile.from_dict({**_data(), "ttft_overhead_s": 0.005})


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        LatencyProfile.load("no-such-profile")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="invalid JSON"):
        LatencyProfile.load(str(bad))


def test_ttft_overhead_terms():
    p = dataclasses.replace(_shipped()[0], ttft_overhead_fixed_s=0.002, ttft_overhead_per_prompt_token_s=1e-6,
                            ttft_overhead_per_reused_byte_s=1e-11)
    assert p.ttft_overhead_s(0, 0) == pytest.approx(0.002)
    assert p.ttft_overhead_s(1000, 0) == pytest.approx(0.003)
    assert p.ttft_overhead_s(1000, 500) == pytest.approx(0.003 + 1e-11 * 500 * p.kv_bytes_per_token)
    assert min(q.ttft_overhead_s(n, r) for q in _shipped() for n in (1, 2048, 30000) for r in (0, n - 1)) >= 0


def test_transfer_equation():
    p = _shipped()[0]
    t = 1000
    expected = p.transfer_setup_s + p.transfer_per_block_s * -(-t // p.block_size) + t * p.kv_bytes_per_token / p.transfer_bytes_per_s
    assert p.transfer_s(t) == pytest.approx(expected)
    assert p.pull_time_s(t, p.blocks_for(t)) == pytest.approx(expected + p.reuse_overhead_s(t))


@given(n=st.integers(0, 40_000), c=st.integers(0, 40_000), w=st.integers(1, 8192))
def test_windowed_pairs(n, c, w):
    pairs = windowed_pairs(n, c, w)
    assert windowed_pairs(n, c, 0) == causal_pairs(n, c)
    assert 0 <= pairs <= causal_pairs(n, c) + 1e-6
    assert pairs <= n * w + 1e-6
    if c + n <= w:
        assert pairs == pytest.approx(causal_pairs(n, c))
    if c >= w:
        assert pairs == n * w
