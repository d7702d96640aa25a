"""`bidikv calibrate --from-bench`: a profile from per-turn measurements."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from calibration.bench_settings import DeploymentSettings
from calibration.busy import busy_flags
from calibration.from_bench import DEFAULT_MAX_TRANSFER_BYTES_PER_S, fit_from_bench
from calibration.profile import LatencyProfile
from calibration.bench_records import BenchRecord, write_jsonl
from impl.cli import main

BASE = LatencyProfile.load("qwen3-32b@p5en-tp8")


def _records(n=60, seed=0):
    """Turns whose TTFT follows known terms: 40 ms + 20 us/computed token + 1 ns per (query, key) pair of
    the computed tokens' causal attention, and for pulls 15 ms + 5 us/token."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = rng.randrange(200, 20_000)
        pulled = 0 if i % 3 == 0 else rng.randrange(100, prompt)
        computed = prompt - pulled
        pairs = computed * pulled + computed * computed / 2  # written out here, not calibration.prefill's
        ttft = 0.040 + 20e-6 * computed + 1e-9 * pairs + (0.015 + 5e-6 * pulled if pulled else 0.0)
        out.append(BenchRecord(f"c{i}", 1, "on", prompt, 8, float(i), ttft, ttft + 0.1, pulled, pulled))
    return out


def test_fit_recovers_the_terms_and_writes_a_usable_profile():
    profile, report = fit_from_bench(_records(), BASE)
    terms = report["terms"]
    assert terms["prefill_fixed_s"] == pytest.approx(0.040, rel=1e-6)
    assert terms["prefill_per_token_s"] == pytest.approx(20e-6, rel=1e-6)
    assert terms["prefill_attn_s"] == pytest.approx(1e-9, rel=1e-6)
    assert terms["transfer_setup_s"] == pytest.approx(0.015, rel=1e-6)
    assert terms["per_pulled_token_s"] == pytest.approx(5e-6, rel=1e-6)
    assert report["rel_error_max"] < 1e-6
    # the profile's own equations give back a measured turn: compute of the suffix, pull of the rest
    assert profile.compute_s(1000, 0) == pytest.approx(0.040 + 0.020 + 1e-9 * 500_000)
    assert profile.compute_s(100, 900) == pytest.approx(0.040 + 0.002 + 1e-9 * (90_000 + 5_000))
    # (+ 262,144 bytes/token x 1000 at the 1 TB/s bound: 0.26 ms of wire the fit cannot see)
    assert profile.pull_time_s(1000, profile.blocks_for(1000)) == pytest.approx(0.015 + 0.005 + 0.000262144, rel=1e-6)
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


# --- the deployment's geometry, a bounded wire rate, the printout (BASELINES' defects) -----------------

CPU_RIG = DeploymentSettings(block_size=32, kv_bytes_per_token=32_768.0)  # tests/e2e: h512/l8 float32, 32-token blocks


def test_the_deployments_block_size_and_kv_bytes_are_kept():
    profile, report = fit_from_bench(_records(), BASE, settings=CPU_RIG)
    assert (profile.block_size, profile.kv_bytes_per_token) == (32, 32_768)
    # the 5 us per pulled token is the pull's overhead; the wire runs at the bound (TTFT cannot separate them)
    assert profile.reuse_overhead_per_token_s == pytest.approx(5e-6, rel=1e-5)
    assert profile.transfer_bytes_per_s == DEFAULT_MAX_TRANSFER_BYTES_PER_S
    assert "block_size" not in report["kept_from_base"] and "kv_bytes_per_token" not in report["kept_from_base"]


def test_without_settings_the_base_geometry_is_kept_and_named():
    profile, report = fit_from_bench(_records(), BASE)
    assert (profile.block_size, profile.kv_bytes_per_token) == (BASE.block_size, BASE.kv_bytes_per_token)
    assert {"block_size", "kv_bytes_per_token"} <= set(report["kept_from_base"])


def _setup_only_pulls(n=60, seed=1):
    """Pulls that cost a 15 ms setup and nothing per token, with +-0.1 % noise: the per-token cost is unresolvable."""
    rng = random.Random(seed)
    out = []
    for r in _records(n, seed):
        pulled = r.prefill_cached_tokens
        ttft = (0.040 + 20e-6 * (r.prompt_tokens - pulled) + (0.015 if pulled else 0.0)) * (1 + rng.uniform(-1e-3, 1e-3))
        out.append(dataclasses.replace(r, ttft_s=ttft, total_s=ttft + 0.1))
    return out


def test_an_unresolvable_per_token_pull_cost_gives_a_bounded_rate_not_1e30():
    profile, report = fit_from_bench(_setup_only_pulls(), BASE, settings=CPU_RIG)
    assert report["terms"]["per_pulled_token_s"] < 1e-7  # the fit found ~nothing per token (the data has none)
    assert profile.transfer_bytes_per_s <= DEFAULT_MAX_TRANSFER_BYTES_PER_S
    assert report["transfer_bytes_per_s_bounded"] and "the bound" in report["note"]
    profile, _ = fit_from_bench(_setup_only_pulls(), BASE, settings=CPU_RIG, max_transfer_bytes_per_s=5e9)
    assert profile.transfer_bytes_per_s == 5e9


def test_cli_printout_is_whole_lines_with_the_deployment_file(tmp_path, capsys):
    path, out = tmp_path / "run.jsonl", tmp_path / "mine.json"
    write_jsonl(_setup_only_pulls(), str(path))
    (tmp_path / "run.deployment.json").write_text(json.dumps({"block_size": 32, "kv_bytes_per_token": 32768,
                                                              "uptime_before": "ignored"}))
    assert main(["calibrate", "--from-bench", str(path), "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.endswith("\n") and "(bounded)" in text
    assert all(line.startswith(("fitted from", "  ")) for line in text.splitlines())
    assert "e+2" not in text and "e+3" not in text  # no 1e23..1e35 bytes/s
    saved = LatencyProfile.load(str(out))
    assert (saved.block_size, saved.kv_bytes_per_token) == (32, 32_768)
    assert out.read_text().endswith("}\n")


# --- busy turns and decode terms -------------------------------------------------------------------

def _timed_conversation(busy_factor=1.0, window=1.0):
    """One client, one turn at a time: gaps alternate 0.3 s (busy: the previous turn ended < 1 s before) and
    3 s (quiet). TTFT = (1 + busy_factor * busy) * (0.2 s + 1 ms per computed token) + pull 50 ms + 20 us/token."""
    rng = random.Random(3)
    out, t, prompt, prev_end = [], 0.0, 600, None
    for i in range(40):
        pulled = 0 if i % 4 == 0 else prompt - rng.randrange(40, 80)
        busy = prev_end is not None and t - prev_end < window  # by construction: gap 0.3 busy, 3.0 quiet
        ttft = (1 + busy_factor * busy) * (0.2 + 1e-3 * (prompt - pulled)) + ((0.05 + 20e-6 * pulled) if pulled else 0)
        total = ttft + 95 * 0.03
        out.append(BenchRecord(f"c{i // 4}", i % 4, "on", prompt, 96, t, ttft, total, pulled, pulled))
        prev_end = t + total
        t = prev_end + (0.3 if i % 2 else 3.0)
        prompt = prompt + 96 + rng.randrange(40, 80) if i % 4 != 3 else 600 + rng.randrange(0, 200)
    return out


def test_busy_factor_is_recovered():
    records = _timed_conversation(busy_factor=1.0)
    assert 0 < sum(busy_flags(records)) < len(records)
    profile, report = fit_from_bench(records, BASE, settings=CPU_RIG)
    assert report["busy_factor"] == pytest.approx(1.0, abs=1e-3)
    assert report["terms"]["prefill_fixed_s"] == pytest.approx(0.2, rel=1e-3)
    assert report["terms"]["prefill_per_token_s"] == pytest.approx(1e-3, rel=1e-3)
    assert report["terms"]["transfer_setup_s"] == pytest.approx(0.05, rel=1e-2)
    assert profile.provenance["host_contention"] == {"window_s": 1.0, "factor": report["busy_factor"]}
    # without the busy term the same turns fit worse: the regressor is what explains them
    _, plain = fit_from_bench(records, BASE, settings=CPU_RIG, busy_window_s=0)
    assert plain["busy_factor"] == 0 and plain["rel_error_p50"] > 10 * report["rel_error_p50"] + 0.01


def test_quiet_turns_fit_no_busy_factor():
    records = _timed_conversation(busy_factor=0.0)
    _, report = fit_from_bench(records, BASE, settings=CPU_RIG)
    assert report["busy_factor"] == pytest.approx(0.0, abs=1e-3)


def _decode_records():
    """Turns decoding alone (B = 1) or in pairs started together with equal TTFT and length (B = 2), far apart
    in time. TPOT = 20 ms + 4 ms per sequence + 2 us per context token (mean context: prompt + output / 2)."""
    out, t = [], 0.0
    for i, prompt in enumerate(range(400, 2400, 100)):
        outputs = 64
        pair = i % 2 == 1
        other = prompt + 300
        ctx = (prompt + outputs / 2) + ((other + outputs / 2) if pair else 0)
        tpot = 0.020 + 0.004 * (2 if pair else 1) + 2e-6 * ctx
        total = 0.5 + tpot * (outputs - 1)
        out.append(BenchRecord(f"a{i}", 0, "off", prompt, outputs, t, 0.5, total, 0, None))
        if pair:
            out.append(BenchRecord(f"b{i}", 0, "off", other, outputs, t, 0.5, total, 0, None))
        t += 100.0
    return out


def test_decode_terms_are_fitted_from_tpot():
    profile, report = fit_from_bench(_decode_records(), BASE, settings=CPU_RIG)
    assert profile.decode_fixed_s == pytest.approx(0.020, rel=1e-3)
    assert profile.decode_per_seq_s == pytest.approx(0.004, rel=1e-3)
    assert profile.decode_per_ctx_token_s == pytest.approx(2e-6, rel=1e-3)
    assert report["decode"]["batch_range"] == [1.0, 2.0]
    # the profile's own step equation gives back a measured TPOT
    assert profile.decode_step_s(2, 400 + 32 + 700 + 32) == pytest.approx(0.020 + 0.008 + 2e-6 * 1164)


def test_decode_per_seq_is_unidentifiable_one_at_a_time_and_said_so():
    singles = [r for r in _decode_records() if not r.conversation.startswith("b") and int(r.conversation[1:]) % 2 == 0]
    profile, report = fit_from_bench(singles, BASE, settings=CPU_RIG)
    assert report["decode"]["terms"]["decode_per_seq_s"] is None and profile.decode_per_seq_s == 0
    assert "decode_per_seq_s not identifiable" in report["note"]
    # the fixed term absorbs one sequence's cost: 20 + 4 ms
    assert profile.decode_fixed_s == pytest.approx(0.024, rel=1e-3)
