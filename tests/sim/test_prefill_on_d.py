"""Prefill on D in the simulator: a later turn sent to the D that holds it, computed between D's decode
steps; what it saves (no P leg, no KV moved) and what D's other sequences pay for it."""

from __future__ import annotations

import math

import pytest

from calibration.profile import LatencyProfile
from sim.engine.cluster import Cluster
from sim.engine.config import SimConfig, load_config
from sim.workload.model import Conversation, Turn

PROFILE = LatencyProfile.load("qwen3-32b@p5en-tp8")


def config(prefill_on_d: str = "off", **policy) -> SimConfig:
    cfg = SimConfig()
    cfg.policy.prefill_on_d = prefill_on_d
    for name, value in policy.items():
        setattr(cfg.policy, name, value)
    return cfg.validate()


def run(cfg: SimConfig, convs):
    cluster = Cluster(cfg, PROFILE)
    result = cluster.run(convs)
    return cluster, {(r.conversation, r.turn): r for r in result.records}


# A decodes a long answer on the one D while B's second turn arrives: B's suffix is short (200 tokens on a
# 6,000-token history) and B answers with one token, so B never decodes beside A: whatever A's answer
# takes longer is the cost of B's prefill on D alone.
HISTORY, SUFFIX = 6000, 200
LONG = Conversation("A", 0.0, (Turn(3000, 4000),), 0)


def two_turns(gap_s: float, output: int = 50, second_output: int = 1, revision: int = 0) -> Conversation:
    return Conversation("B", 0.0, (Turn(HISTORY - output, output),
                                   Turn(HISTORY + SUFFIX, second_output, gap_before_s=gap_s, history_revision=revision)), 0)


def chunk_cost_s(new: int, context: int) -> float:
    """One chunk's work, from the profile's stated equation (dense attention: n (c + n/2) causal pairs)."""
    assert PROFILE.attn_window_tokens == 0 and PROFILE.prefill_index_s == 0
    return PROFILE.prefill_per_token_s * new + PROFILE.prefill_attn_s * new * (context + new / 2)


def test_off_by_default_and_then_every_turn_goes_through_p():
    assert SimConfig().policy.prefill_on_d == "off"
    cluster, recs = run(config(), [LONG, two_turns(5.0)])
    assert cluster.router.on_d is None
    assert all(r.prefill_instance == "p0" and r.decision != "prefill_on_d" for r in recs.values())


def test_a_short_suffix_is_served_on_the_d_that_holds_it_and_d_s_other_sequences_pay_its_compute():
    _, via_p = run(config(), [LONG, two_turns(5.0)])
    cluster, on_d = run(config("isl_bounding"), [LONG, two_turns(5.0)])
    r = on_d[("B", 1)]
    assert r.decision == "prefill_on_d" and r.decision_reason == "short_suffix" and r.store_hit
    assert r.prefill_instance == "" and r.decode_instance == "d0"
    # D reused what it held (whole blocks, all but the last prompt token) and computed the rest
    held = HISTORY - 1  # B's first turn: its prompt and all but its last answer token
    assert r.d_local_hit_tokens == r.reused_tokens == held // PROFILE.block_size * PROFILE.block_size
    assert r.recomputed_tokens == HISTORY + SUFFIX - r.reused_tokens
    # no P leg and no KV moved for it: the two transfers are the first turns' P->D hand-offs
    assert cluster.interconnect.transfers == 2 and via_p[("B", 1)].decision == "pull"
    assert r.ttft_s < via_p[("B", 1)].ttft_s / 3
    # D's retained entry of B's first turn was taken by its successor, not left pinned to its TTL
    d = cluster.decode[0]
    assert d._retained_meta[("default", "B")][3] == 1
    # A's answer took one chunk's compute longer, and nothing else changed for it
    extra = on_d[("A", 0)].completion_s - via_p[("A", 0)].completion_s
    assert extra == pytest.approx(chunk_cost_s(r.recomputed_tokens, r.reused_tokens), rel=1e-6)
    assert on_d[("A", 0)].tpot_s > via_p[("A", 0)].tpot_s


def test_a_suffix_over_the_step_budget_is_computed_in_chunks_across_steps():
    budget = 64
    small = []
    for mode in ("off", "isl_bounding"):
        cfg = config(mode)
        cfg.topology.max_num_batched_tokens = budget  # P's steps too: the same for both runs
        small.append(run(cfg.validate(), [LONG, two_turns(5.0)])[1])
    via_p, on_d = small
    r = on_d[("B", 1)]
    assert r.decision == "prefill_on_d"
    # A's decode token takes one of each step's tokens: the suffix goes 63 tokens a step
    chunks, left, context = [], r.recomputed_tokens, r.reused_tokens
    while left:
        take = min(left, budget - 1)
        chunks.append(chunk_cost_s(take, context))
        left, context = left - take, context + take
    extra = on_d[("A", 0)].completion_s - via_p[("A", 0)].completion_s
    assert len(chunks) > 1 and extra == pytest.approx(sum(chunks), rel=1e-6)


def test_a_lapsed_hold_goes_to_d_only_within_lapsed_s_and_is_served_from_d_s_prefix_cache():
    convs = [two_turns(100.0)]
    _, recs = run(config("isl_bounding", decoder_kv_blocks_ttl=10.0), convs)
    assert recs[("B", 1)].decision != "prefill_on_d" and recs[("B", 1)].miss_reason == "expired"
    _, recs = run(config("isl_bounding", decoder_kv_blocks_ttl=10.0, prefill_on_d_lapsed_s=1000.0), convs)
    r = recs[("B", 1)]
    assert r.decision == "prefill_on_d" and not r.store_hit and r.miss_reason == "expired"
    assert r.reused_tokens > 0  # from D's prefix cache: expired, unpinned, not yet reused
    # without prefix caching on D nothing is left: D computes the whole prompt (correct, and costly)
    _, recs = run(config("isl_bounding", decoder_kv_blocks_ttl=10.0, prefill_on_d_lapsed_s=1000.0,
                         decode_prefix_caching=False), convs)
    r = recs[("B", 1)]
    assert r.decision == "prefill_on_d" and r.reused_tokens == 0 and r.recomputed_tokens == r.prompt_tokens


def test_a_rewritten_history_sent_to_d_reuses_nothing_of_the_old_one():
    _, recs = run(config("isl_bounding"), [two_turns(5.0, revision=1)])
    r = recs[("B", 1)]
    assert r.decision == "prefill_on_d"  # the router cannot tell (P, or D's cache, checks the tokens)
    assert r.reused_tokens == r.d_local_hit_tokens == 0 and r.recomputed_tokens == r.prompt_tokens


def test_the_p_load_arm_sends_turns_to_d_only_while_p_is_busy():
    convs = [two_turns(5.0)]
    _, recs = run(config("prefill_load", prefill_on_d_p_busy_tokens=1), convs)
    assert recs[("B", 1)].decision != "prefill_on_d"  # P was idle when the turn came
    _, recs = run(config("prefill_load", prefill_on_d_p_busy_tokens=0), convs)
    assert recs[("B", 1)].decision == "prefill_on_d" and recs[("B", 1)].decision_reason == "p_busy"


@pytest.mark.parametrize("flag, value, message", [
    ("prefill_on_d", "always", "policy.prefill_on_d must be one of"),
    ("prefill_on_d_suffix_ratio", 0.0, "policy.prefill_on_d_suffix_ratio must be in"),
    ("prefill_on_d_suffix_tokens", 0, "policy.prefill_on_d_suffix_tokens must be >= 1"),
    ("prefill_on_d_lapsed_s", math.inf, "policy.prefill_on_d_lapsed_s must be finite"),
    ("prefill_on_d_d_busy_fraction", 2.0, "policy.prefill_on_d_d_busy_fraction must be in"),
])
def test_bad_settings_name_the_field(flag, value, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, {"policy": {flag: value}})


def test_a_rewritten_history_served_on_d_unpins_the_turn_d_retained_for_it():
    # a's first turn fills most of a 300-block pool, retained for 1000 s; its second turn rewrites the history
    # and runs on D, which will never read the old turn again: unpinned when its successor arrives, not held
    # to its expiry (the successor would wait ~1000 s for it)
    cfg = config("isl_bounding", decoder_kv_blocks_ttl=1000.0, decode_prefix_caching=False)
    cfg.topology.decode_kv_blocks = 300
    convs = [Conversation("a", 0.0, (Turn(4001, 1), Turn(4003, 1, gap_before_s=5.0, history_revision=1)), 64)]
    _, recs = run(cfg.validate(), convs)
    r = recs[("a", 1)]
    assert r.decision == "prefill_on_d" and r.reused_tokens == 0 and not r.rejected
    assert r.d_queue_s == 0 and r.completion_s - r.arrival_s < 2.0
