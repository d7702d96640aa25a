"""Token-exact reuse in the simulator: a turn's reuse ends at its first divergence from what D holds.

Expectations come from the workload (previous prompt and output), from closed forms, or from the real
hash-based check of impl.policy.prefix_check run on token sequences built to the workload's shape;
never from the simulator's own counts.
"""

from __future__ import annotations

import dataclasses
import math
import random

from hypothesis import HealthCheck, given, settings, strategies as st

from calibration.profile import LatencyProfile
from impl.policy.prefix_check import chain_block_hashes, publish, scheme_tag, verify_prefix
from sim.engine.cluster import Cluster
from sim.engine.config import SimConfig
from sim.workload import load_workload
from sim.workload.model import Conversation, Turn

PROFILE = LatencyProfile.load("qwen3-32b@p5en-tp8")
BS = PROFILE.block_size


def config(**policy) -> SimConfig:
    cfg = SimConfig(seed=1)
    cfg.policy.decoder_kv_blocks_ttl = math.inf  # nothing expires: every later turn is offered D's blocks
    for key, value in policy.items():
        setattr(cfg.policy, key, value)
    return cfg.validate()


def run(cfg, convs):
    return Cluster(cfg, PROFILE).run(convs)


def plain(records):
    """Records as comparable tuples (NaN is not equal to itself)."""
    return [tuple("nan" if isinstance(v, float) and math.isnan(v) else v for v in dataclasses.astuple(r))
            for r in records]


def chat(agreements=None, revisions=None) -> Conversation:
    prompts, outputs = [3000, 4500, 6100, 7000], [900, 1200, 500, 300]
    turns = []
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        turns.append(Turn(p, o, gap_before_s=30.0 if i else 0.0,
                          history_revision=revisions[i] if revisions else 0,
                          reuse_agreement_tokens=agreements[i] if agreements else None))
    return Conversation("c0", 0.0, tuple(turns), 500)


def test_a_faithful_continuation_pulls_everything_d_holds_as_before():
    result = run(config(), [chat()])
    later = [r for r in result.records if r.turn]
    # D holds the previous prompt and all but the last output token: 3000 + 899, 4500 + 1199, 6100 + 499
    assert [r.pulled_tokens for r in later] == [3899, 5699, 6599]
    assert [r.offered_tokens for r in later] == [r.verified_tokens for r in later] == [3899, 5699, 6599]
    assert [r.reused_tokens for r in later] == [3899, 5699, 6599]
    # stating the full agreement is the same workload as stating none
    stated = run(config(), [chat(agreements=[None, 3899, 5699, 6599])])
    assert plain(stated.records) == plain(result.records)
    s = result.summary
    assert s["tokens_offered"] == s["tokens_verified"] == s["tokens_pulled"] == s["tokens_reused"] == 3899 + 5699 + 6599


def test_a_divergence_caps_the_pull_at_the_verified_prefix_and_the_threshold_applies_to_it():
    # turn 1 diverges 10 tokens into the previous answer; turn 2 keeps only 40 tokens; turn 3 continues
    result = run(config(kv_recompute_threshold=64), [chat(agreements=[None, 3010, 40, None])])
    r1, r2, r3 = result.records[1:]
    # checkpoints: the anchor (previous prompt end, block 3000 // 16 = 187) and geometric steps around it;
    # 3010 tokens agree = 188 whole blocks, and 188 = 187 + 1 is a checkpoint: 188 * 16 = 3008
    assert (r1.offered_tokens, r1.verified_tokens, r1.pulled_tokens) == (3899, 3008, 3008)
    # 40 tokens = 2 whole blocks agree, but D holds 5699 tokens (356 blocks, anchor 4500 // 16 = 281): the
    # checkpoints nearest the start are 349 - 256 = 93 and 281 - 256 = 25, none at or below 2, so nothing
    # is verified (the sparse scheme's loss, bounded by lost_blocks_bound), nothing pulled, and the turn says why
    assert (r2.offered_tokens, r2.verified_tokens, r2.pulled_tokens) == (5699, 0, 0)
    assert r2.miss_reason == "diverged"
    assert (r3.offered_tokens, r3.verified_tokens, r3.pulled_tokens) == (6599, 6599, 6599)


def test_a_rewritten_history_without_an_agreement_is_offered_but_nothing_is_verified():
    result = run(config(), [chat(revisions=[0, 1, 1, 1])])
    r1 = result.records[1]
    assert r1.store_hit and r1.offered_tokens == 3899 and r1.verified_tokens == 0 and r1.pulled_tokens == 0
    assert [r.pulled_tokens for r in result.records[2:]] == [5699, 6599]


def reasoning_conversations(seed=5, n=5):
    return load_workload({"kind": "reasoning_chat", "num_conversations": n, "arrival_rate_per_s": 0.05}, seed)


def test_reasoning_chat_verifies_the_previous_prompt_block_aligned_and_never_pulls_more():
    convs = reasoning_conversations()
    result = run(config(), convs)
    prompts = {(c.conversation_id, i): t.prompt_tokens for c in convs for i, t in enumerate(c.turns)}
    later = [r for r in result.records if r.turn]
    assert later and all(r.store_hit for r in later)
    for r in later:
        previous_prompt = prompts[(r.conversation, r.turn - 1)]
        # the anchor is the previous prompt's end, always a checkpoint: its whole blocks are verified
        assert r.verified_tokens == previous_prompt // BS * BS, r
        assert r.pulled_tokens <= r.verified_tokens < r.offered_tokens
        assert r.pulled_tokens == r.verified_tokens  # all above the 64-token threshold
    s = result.summary
    assert s["tokens_pulled"] == sum(r.pulled_tokens for r in later) < s["tokens_offered"]


def test_reasoning_chat_verification_matches_the_real_hash_check():
    """The simulator's verified counts equal what verify_prefix finds on token ids of the same shape."""
    convs = reasoning_conversations(seed=6, n=2)
    plain_answers = load_workload({"kind": "synthetic", "num_conversations": 2, "arrival_rate_per_s": 0.05}, 6)
    result = run(config(), convs)
    verified = {(r.conversation, r.turn): r.verified_tokens for r in result.records}
    scheme = scheme_tag("test", BS)
    rng = random.Random(0)
    for conv, base in zip(convs, plain_answers):
        for i in range(1, len(conv.turns)):
            prev, turn = conv.turns[i - 1], conv.turns[i]
            answer = base.turns[i - 1].output_tokens  # the visible answer; the rest of the output is thinking
            thinking = prev.output_tokens - answer
            history = [rng.randrange(0, 50_000) for _ in range(prev.prompt_tokens)]
            thought = [rng.randrange(50_000, 60_000) for _ in range(thinking)]
            said = [rng.randrange(60_000, 70_000) for _ in range(answer)]
            held = (history + thought + said)[:prev.prompt_tokens + prev.output_tokens - 1]
            prompt = history + said + [rng.randrange(70_000, 80_000)
                                       for _ in range(turn.prompt_tokens - len(history) - answer)]
            check = publish(chain_block_hashes(held, BS), held, len(held), scheme=scheme, block_size=BS,
                            anchor_tokens=[prev.prompt_tokens])
            real = verify_prefix(check, chain_block_hashes(prompt, BS), prompt, scheme=scheme, block_size=BS)
            assert verified[(conv.conversation_id, i)] == real.tokens, (conv.conversation_id, i)


def test_same_seed_same_records_with_divergent_histories():
    for kind in ("reasoning_chat", "answer_drift", "edited_history", "reasoning_agent"):
        convs = load_workload({"kind": kind, "num_conversations": 4, "arrival_rate_per_s": 0.1}, 3)
        assert plain(run(config(), convs).records) == plain(run(config(), convs).records)


# -- invariants with stated agreements (hypothesis) ---------------------------------------------------

@st.composite
def divergent_conversations(draw):
    convs = []
    for c in range(draw(st.integers(1, 4))):
        ctx = draw(st.integers(64, 3000))
        turns, revision, previous = [], 0, None
        for t in range(draw(st.integers(1, 5))):
            ctx += draw(st.integers(1, 300))
            out = draw(st.integers(1, 400))
            agreement = None
            if t:
                if draw(st.integers(0, 5)) == 0:
                    revision += 1  # sometimes with a stated agreement (an edit), sometimes without
                choice = draw(st.integers(0, 3))
                if choice:
                    held = previous.prompt_tokens + previous.output_tokens - 1
                    agreement = draw(st.integers(0, held + 50))
            gap = draw(st.sampled_from([0.0, 1.0, 30.0, 700.0]))
            previous = Turn(ctx, out, gap_before_s=gap if t else 0.0, history_revision=revision,
                            reuse_agreement_tokens=agreement)
            turns.append(previous)
            ctx += out
        convs.append(Conversation(f"c{c}", 0.0, tuple(turns), 64, tenant=draw(st.sampled_from(["a", "b"]))))
    return convs


@st.composite
def small_configs(draw):
    cfg = SimConfig(seed=draw(st.integers(0, 3)))
    cfg.topology.num_prefill = draw(st.integers(1, 2))
    cfg.topology.num_decode = draw(st.integers(1, 2))
    cfg.topology.decode_kv_blocks = draw(st.sampled_from([300, 5000]))
    p = cfg.policy
    p.prefix_caching = draw(st.booleans())
    p.decode_prefix_caching = draw(st.booleans())
    p.kv_recompute_threshold = draw(st.sampled_from([0, 64, 1000]))
    p.retention = draw(st.sampled_from(["ttl", "oracle"]))
    p.decoder_kv_blocks_ttl = draw(st.sampled_from([0.0, 60.0, math.inf]))
    p.placement = draw(st.sampled_from(["round_robin", "kv_aware"]))
    return cfg.validate()


def agreement_with_previous(previous: Turn, turn: Turn) -> int:
    """The workload's own statement, read independently of sim.workload.model."""
    held = previous.prompt_tokens + previous.output_tokens - 1
    if turn.reuse_agreement_tokens is not None:
        stated = turn.reuse_agreement_tokens
    elif turn.history_revision == previous.history_revision:
        stated = held
    else:
        stated = 0
    return max(0, min(stated, held, turn.prompt_tokens))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=small_configs(), convs=divergent_conversations())
def test_reuse_never_passes_the_first_divergence(cfg, convs):
    cluster = Cluster(cfg, PROFILE)
    recs = cluster.run(convs).records
    keys = [(r.tenant, r.conversation, r.turn) for r in recs]
    assert len(keys) == len(set(keys)) == sum(len(c.turns) for c in convs)
    turns = {(c.tenant, c.conversation_id): c for c in convs}
    for r in recs:
        assert r.pulled_tokens <= r.verified_tokens <= r.offered_tokens
        assert r.reused_tokens <= r.pulled_tokens
        assert r.reused_tokens + r.recomputed_tokens + r.p_local_hit_tokens == r.prompt_tokens or r.rejected
        conv = turns[(r.tenant, r.conversation)]
        if r.turn == 0:
            assert r.pulled_tokens == r.d_local_hit_tokens == 0
            assert r.p_local_hit_tokens <= conv.shared_prefix_tokens
            continue
        prev = conv.turns[r.turn - 1]
        agree = agreement_with_previous(prev, conv.turns[r.turn])
        # what D holds of an earlier turn agrees with this prompt at most as far as the last turn's does
        if r.pulled_tokens:
            assert r.p_local_hit_tokens + r.pulled_tokens <= agree, (r, agree)
        assert r.d_local_hit_tokens <= agree, (r, agree)
        assert r.p_local_hit_tokens <= max(min(agree, prev.prompt_tokens), conv.shared_prefix_tokens), (r, agree)
    for d in cluster.decode:
        assert d.running_blocks == d.arriving_blocks == d.reading_blocks == 0
        assert d.used_blocks == d.retained.blocks + d.cached_blocks
        assert d.totals.peak_used_blocks <= d.capacity
