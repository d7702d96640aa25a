"""The summary of a run, checked on records written by hand (expected values counted by hand too)."""

from __future__ import annotations

import math

import pytest

from sim.engine.records import NodeTotals, TurnRecord, bucket_label, summarize


@pytest.mark.parametrize("tokens, label", [
    (-1, "0-1k"), (0, "0-1k"), (1023, "0-1k"), (1024, "1-2k"), (2047, "1-2k"), (2048, "2-4k"),
    (16383, "8-16k"), (16384, "16-32k"), (32767, "16-32k"), (32768, ">=32k"), (10**6, ">=32k"),
])
def test_a_prompt_falls_in_the_bucket_below_the_first_edge_above_it(tokens, label):
    assert bucket_label(tokens) == label


def _record(turn: int, prompt: int, ttft: float, reused: int = 0, miss: str = "", rejected: str = "") -> TurnRecord:
    rec = TurnRecord("c", turn, "t", prompt, 10, 0.0)
    rec.ttft_s, rec.reused_tokens, rec.recomputed_tokens = ttft, reused, prompt - reused
    rec.miss_reason, rec.rejected = miss, rejected
    rec.offered_tokens, rec.verified_tokens, rec.pulled_tokens = reused + 16, reused + 8, reused
    rec.prefill_compute_s, rec.d2p_transfer_s, rec.reuse_overhead_s = 0.5, 0.25, 0.125
    return rec


def test_summary_counts_completed_turns_and_later_turns_apart():
    records = [
        _record(0, 500, 0.1),                        # a first turn: in every total, not in the hit rate
        _record(1, 1500, 0.2, reused=1024),          # a later turn that reused
        _record(2, 3000, 0.3, miss="expired"),       # a later turn that missed, with its reason
        _record(3, 3000, 0.4),                       # a later miss without a reason
        _record(4, 40000, 9.0, rejected="no room"),  # rejected: counted in turns only
    ]
    totals = {"d0": NodeTotals(retained_block_seconds=2.0, peak_retained_blocks=3, preemptions=1,
                               dropped_under_pressure=2)}
    s = summarize(records, bytes_per_block=1e9, decode_totals=totals, sim_time_s=7.0)
    assert (s["turns"], s["completed"], s["rejected"], s["sim_time_s"]) == (5, 4, 1, 7.0)
    assert s["reuse_hit_rate"] == pytest.approx(1 / 3)
    assert s["miss_reasons"] == {"expired": 1, "unknown": 1}
    assert s["tokens_reused"] == 1024 and s["tokens_pulled"] == 1024
    assert s["tokens_recomputed"] == 500 + 476 + 3000 + 3000
    assert s["tokens_offered"] == 16 + 1040 + 16 + 16 and s["tokens_verified"] == 8 + 1032 + 8 + 8
    assert s["prompt_tokens"] == 8000
    assert s["ttft"]["n"] == 4 and s["ttft"]["mean_ms"] == pytest.approx(250.0)
    assert s["ttft"]["p50_ms"] == pytest.approx(250.0)  # halfway between 0.2 and 0.3 s
    assert list(s["ttft_by_prompt_bucket"]) == ["0-1k", "1-2k", "2-4k"]
    assert s["ttft_by_prompt_bucket"]["2-4k"]["n"] == 2
    assert s["prefill"]["mean_ms"] == pytest.approx(875.0)
    assert (s["retained_hbm_gb_s"], s["peak_retained_hbm_gb"]) == (2.0, 3.0)
    assert (s["preemptions"], s["dropped_under_pressure"]) == (1, 2)


def test_no_later_turn_leaves_the_hit_rate_undefined():
    s = summarize([_record(0, 100, 0.1)], bytes_per_block=1.0, decode_totals={}, sim_time_s=1.0)
    assert math.isnan(s["reuse_hit_rate"]) and s["miss_reasons"] == {}
