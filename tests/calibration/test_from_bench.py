"""`bidikv calibrate --from-bench`: a profile from per-turn measurements."""

from __future__ import annotations

import json
import random

import pytest

from calibration.from_bench import fit_from_bench
from calibration.profile import LatencyProfile
from impl.bench.records import BenchRecord, write_jsonl
from impl.cli import main

BASE = LatencyProfile.load("qwen3-32b@p5en-tp8")


def _records(n=60, seed=0):
    """Turns whose TTFT follows known terms: 40 ms + 20 us/computed token, and for pulls 15 ms + 5 us/token."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = rng.randrange(200, 20_000)
        pulled = 0 if i % 3 == 0 else rng.randrange(100, prompt)
        ttft = 0.040 + 20e-6 * (prompt - pulled) + (0.015 + 5e-6 * pulled if pulled else 0.0)
        out.append(BenchRecord(f"c{i}", 1, "on", prompt, 8, float(i), ttft, ttft + 0.1, pulled, pulled))
    return out


def test_fit_recovers_the_terms_and_writes_a_usable_profile():
    profile, report = fit_from_bench(_records(), BASE)
    terms = report["terms"]
    assert terms["prefill_fixed_s"] == pytest.approx(0.040, rel=1e-6)
    assert terms["prefill_per_token_s"] == pytest.approx(20e-6, rel=1e-6)
    assert terms["transfer_setup_s"] == pytest.approx(0.015, rel=1e-6)
    assert terms["per_pulled_token_s"] == pytest.approx(5e-6, rel=1e-6)
    assert report["rel_error_max"] < 1e-6
    # the profile's own equations give back a measured turn: compute of the suffix, pull of the rest
    assert profile.compute_s(1000, 0) == pytest.approx(0.040 + 0.020)
    assert profile.transfer_s(1000) == pytest.approx(0.015 + 0.005)
    assert LatencyProfile.from_dict(json.loads(profile.to_json())) == profile


def test_an_off_run_keeps_the_transfer_terms_and_says_so():
    off = [r for r in _records() if not r.prefill_cached_tokens]
    profile, report = fit_from_bench(off, BASE)
    assert report["terms"]["transfer_setup_s"] is None and "note" in report
    assert profile.transfer_setup_s == BASE.transfer_setup_s


def test_too_few_turns_is_a_clear_error():
    with pytest.raises(ValueError, match="at least"):
        fit_from_bench(_records(3), BASE)


def test_cli_from_bench(tmp_path, capsys):
    path, out = tmp_path / "bench.jsonl", tmp_path / "mine.json"
    write_jsonl(_records(), str(path))
    assert main(["calibrate", "--from-bench", str(path), "--output", str(out)]) == 0
    assert "prefill_fixed_s" in capsys.readouterr().out
    assert LatencyProfile.load(str(out)).prefill_fixed_s == pytest.approx(0.040, rel=1e-6)
