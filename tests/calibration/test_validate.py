"""`bidikv validate`: the simulator replays a bench run's turns and its decisions are compared per turn.

The hand-made runs state what the real deployment did (what the router offered, what P pulled) from
vLLM's rules worked out by hand; the recorded runs in data/validate/ are what the CPU deployment
really did (tests/e2e/record_validate.py).
"""

from __future__ import annotations

import dataclasses

import pytest

from calibration.bench_settings import DeploymentSettings
from calibration.profile import LatencyProfile
from sim.replay.validate import TurnComparison, bench_clients, conversations_from_bench, summarize, validate_run
from calibration.bench_records import BenchRecord

BASE = LatencyProfile.load("qwen3-32b@p5en-tp8")
# A profile whose turns take what the hand-made records say: 0.5 s to the first token for any prompt
# (fixed cost only; a pull costs its 0 s setup), then 96 tokens at 25 ms.
RIG = dataclasses.replace(BASE, name="hand", block_size=32, kv_bytes_per_token=32_768.0, prefill_fixed_s=0.5,
                          prefill_per_token_s=0.0, prefill_attn_s=0.0, prefill_index_s=0.0, transfer_setup_s=0.0,
                          transfer_per_block_s=0.0, transfer_bytes_per_s=1e12, reuse_overhead_per_token_s=0.0,
                          ttft_overhead_fixed_s=0.0, ttft_overhead_per_prompt_token_s=0.0,
                          ttft_overhead_per_reused_byte_s=0.0, decode_fixed_s=0.025, decode_per_seq_s=0.0,
                          decode_per_ctx_token_s=0.0, handoff_pays_transfer_setup=False)
SETTINGS = DeploymentSettings(kv_recompute_threshold=64, decoder_kv_blocks_ttl=10.0, block_size=32,
                              kv_bytes_per_token=32_768.0, decode_kv_blocks=512, max_num_seqs=8)
TURN_S = 0.5 + 96 * 0.025  # 2.9 s from start to the last token


def _conversation(cid: str, starts: list[float], offered: list[int], pulled: list[int], mode: str = "on") -> list[BenchRecord]:
    """Turns of 600 + 146 k tokens (each appends the 96 generated and 50 new ones); D holds prompt + 95."""
    return [BenchRecord(cid, k, mode, 600 + 146 * k, 96, start, 0.5, TURN_S, offered[k], pulled[k])
            for k, start in enumerate(starts)]


def test_pulled_and_expired_turns_agree_with_the_deployments_rules():
    # TTL 10 s, 5 s margin: a turn arriving 1 s after the previous one finished is offered D's
    # 600 + 95 = 695 tokens and pulls them (>= 64); one arriving 8 s after is past expiry - margin
    # (the router offers nothing); the next, 1 s after turn 2 (which recomputed everything), pulls what
    # turn 2 left on D: 892 + 95 = 987 tokens.
    t1 = TURN_S + 1.0
    t2 = t1 + TURN_S + 8.0
    t3 = t2 + TURN_S + 1.0
    run = _conversation("a", [0.0, t1, t2, t3], [0, 695, 0, 987], [0, 695, 0, 987])
    summary, turns = validate_run(run, RIG, SETTINGS)
    assert [(c.real_decision, c.sim_decision) for c in turns] == [
        ("none", "none"), ("pulled", "pulled"), ("expired", "expired"), ("pulled", "pulled")]
    assert [c.sim_pulled for c in turns] == [0, 695, 0, 987]
    assert summary["decisions_agree"] == summary["pulled_tokens_agree"] == 4
    assert summary["overall"]["ttft"]["median_abs_pct"] < 1.0  # the profile was built to take these times


def test_below_the_threshold_is_recomputed():
    run = _conversation("b", [0.0, TURN_S + 1.0], [0, 695], [0, 0])
    summary, turns = validate_run(run, RIG, dataclasses.replace(SETTINGS, kv_recompute_threshold=1000))
    assert [(c.real_decision, c.sim_decision) for c in turns] == [("none", "none"), ("recomputed", "recomputed")]


def test_off_never_pulls():
    run = _conversation("c", [0.0, TURN_S + 1.0], [0, 0], [0, 0], mode="off")
    summary, turns = validate_run(run, RIG, SETTINGS)
    assert [(c.real_decision, c.sim_decision) for c in turns] == [("none", "none"), ("none", "none")]


def test_turns_served_on_d_are_replayed_on_d():
    """The router sent the later turns whole to D (the record's path); the simulator, running the same policy
    on the same counts (D holds 695 of a 746-token prompt: a suffix of 51, below 200 and 0.7), does too. With
    the suffix bound at 40, both send the turn to P, which pulls."""
    on_d = dataclasses.replace(SETTINGS, prefill_on_d="isl_bounding", prefill_on_d_suffix_tokens=200)
    run = [dataclasses.replace(r, path="prefill_on_d" if r.turn else "recompute_on_p", reuse_offered_tokens=r.turn and 695,
                               prefill_cached_tokens=None if r.turn else 0)
           for r in _conversation("e", [0.0, TURN_S + 1.0], [0, 0], [0, 0])]
    summary, turns = validate_run(run, RIG, on_d)
    assert [(c.real_decision, c.sim_decision) for c in turns] == [("none", "none"), ("on_d", "on_d")]
    assert summary["decision_matrix"]["on_d"] == {"on_d": 1}
    run = _conversation("f", [0.0, TURN_S + 1.0], [0, 695], [0, 695])
    _, turns = validate_run(run, RIG, dataclasses.replace(on_d, prefill_on_d_suffix_tokens=40))
    assert [(c.real_decision, c.sim_decision) for c in turns] == [("none", "none"), ("pulled", "pulled")]


def test_a_bench_record_names_only_a_known_path(tmp_path):
    from calibration.bench_records import read_jsonl, write_jsonl

    path = tmp_path / "run.jsonl"
    write_jsonl([dataclasses.replace(_conversation("g", [0.0], [0], [0])[0], path="prefill_on_d")], str(path))
    assert read_jsonl(str(path))[0].path == "prefill_on_d"
    path.write_text(path.read_text().replace("prefill_on_d", "on_p"))
    with pytest.raises(ValueError, match="field path must be one of"):
        read_jsonl(str(path))


def test_a_disagreement_is_reported_not_hidden():
    # the real deployment pulled, but the turn came 8 s later: the simulator expires it
    run = _conversation("d", [0.0, TURN_S + 8.0], [0, 695], [0, 695])
    summary, _ = validate_run(run, RIG, SETTINGS)
    assert summary["decisions_agree"] == 1 and summary["decision_matrix"]["pulled"] == {"expired": 1}


def test_replayed_conversations_keep_the_recorded_starts_and_stop_at_a_failure():
    run = _conversation("e", [0.0, 4.0, 9.0], [0, 695, 0], [0, 695, 0])
    run[2] = dataclasses.replace(run[2], error="HTTP 500", ttft_s=float("nan"))
    (conv,) = conversations_from_bench(run, "absolute")
    assert [t.arrival_s for t in conv.turns] == [0.0, 4.0]
    assert [t.prompt_tokens for t in conv.turns] == [600, 746]
    (conv,) = conversations_from_bench(run)  # think time: the client slept 4.0 - 2.9 s after turn 0
    assert [t.gap_before_s for t in conv.turns] == [0.0, pytest.approx(4.0 - TURN_S)]


def test_bench_clients_counts_conversations_in_progress_at_once():
    back_to_back = _conversation("a", [0.0], [0], [0]) + _conversation("b", [TURN_S], [0], [0])
    assert bench_clients(back_to_back) == 1
    overlapping = back_to_back + _conversation("c", [1.0], [0], [0])
    assert bench_clients(overlapping) == 2


def test_summary_percentiles_by_hand():
    def c(turn, prompt, real, sim):
        return TurnComparison("x", turn, prompt, "none", "none", 0, 0, real, sim, 0.02, 0.02)

    s = summarize([c(0, 100, 1.0, 1.1), c(0, 600, 1.0, 0.8), c(1, 700, 2.0, 2.0)], bucket_tokens=512)
    assert s["overall"]["ttft"]["median_abs_pct"] == pytest.approx(10.0)
    assert s["by_prompt_bucket"]["512-1024"]["ttft"]["median_abs_pct"] == pytest.approx(10.0)  # 20 % and 0 %
    assert s["by_turn"]["1"]["ttft"]["n"] == 1


def test_host_contention_slows_a_prefill_that_starts_while_decode_was_busy():
    # factor 1 over a 1 s window: turn 1 arriving 0.5 s after turn 0 finished prefills in 2 x 0.5 s;
    # turn 2, whose recorded think time is 2.5 s (its start - turn 1's start - turn 1's recorded 2.9 s), in 0.5 s
    profile = dataclasses.replace(RIG, provenance={"host_contention": {"window_s": 1.0, "factor": 1.0}})
    t1 = TURN_S + 0.5
    t2 = t1 + 1.0 + 96 * 0.025 + 2.0  # turn 1 takes 1.0 s to its first token, then 2.4 s of decode
    run = _conversation("f", [0.0, t1, t2], [0, 695, 841], [0, 695, 841])
    _, turns = validate_run(run, profile, SETTINGS)
    assert [round(c.sim_ttft_s, 3) for c in turns] == [0.5, 1.0, 0.5]


def test_cli_json_is_strict_json(tmp_path, capsys):
    import json

    from calibration.bench_records import write_jsonl
    from impl.cli import main

    path = tmp_path / "run.jsonl"
    run = _conversation("g", [0.0, TURN_S + 1.0], [0, 695], [0, 695])
    run[1] = dataclasses.replace(run[1], output_tokens=1)  # one token: no TPOT (NaN in memory)
    write_jsonl(run, str(path))
    (tmp_path / "run.deployment.json").write_text(json.dumps({"decoder_kv_blocks_ttl": 10.0, "block_size": 32,
                                                              "kv_bytes_per_token": 32768}))
    profile = tmp_path / "hand.json"
    profile.write_text(RIG.to_json())
    assert main(["validate", "--bench", str(path), "--profile", str(profile), "--json"]) == 0
    out = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    (turns,) = [r["turns"] for r in out["runs"].values()]
    assert turns[1]["real_tpot_s"] is None and turns[1]["sim_decision"] == "pulled"


def test_a_real_turns_tpot_leaves_out_the_tokens_of_its_first_read():
    # 33 of the 96 tokens reached the client with the first: the 2.4 s after TTFT decoded 63, not 95
    run = [dataclasses.replace(r, first_read_tokens=33) for r in _conversation("a", [0.0], [0], [0])]
    _, (turn,) = validate_run(run, RIG, SETTINGS)
    assert turn.real_tpot_s == pytest.approx((TURN_S - 0.5) / 63)
    assert turn.sim_tpot_s == pytest.approx(0.025)  # the simulator's tokens come one per step


def test_the_decode_fit_reads_the_same_tpot():
    from calibration.busy import decode_loads

    (record,) = [dataclasses.replace(r, first_read_tokens=3) for r in _conversation("a", [0.0], [0], [0])]
    (load,) = decode_loads([record])
    assert load.tpot_s == pytest.approx((TURN_S - 0.5) / 93) == record.tpot_s
