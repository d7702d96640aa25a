"""Synthetic multi-turn chat: published defaults, the prompt formula, streams, determinism."""

from __future__ import annotations

import dataclasses
import random
import statistics

import pytest
from hypothesis import given, settings, strategies as st

from sim.workload.distributions import Constant, Exponential, LogNormal, Uniform, UniformInt
from sim.workload.synthetic import SyntheticMultiTurnConfig, generate

seeds = st.integers(0, 2**32)


def run(config=SyntheticMultiTurnConfig(), workload_seed=1, gaps_seed=2):
    return generate(config, random.Random(workload_seed), random.Random(gaps_seed))


def tokens(conversations):
    return [[(turn.prompt_tokens, turn.output_tokens) for turn in conversation.turns] for conversation in conversations]


def test_defaults_are_the_published_benchmark_settings():
    config = SyntheticMultiTurnConfig()
    assert config.num_conversations == 24
    assert config.messages_per_conversation == UniformInt(12, 18)
    assert config.common_prefix_tokens == Constant(500)
    assert config.user_tokens == UniformInt(120, 160)
    assert config.output_tokens == UniformInt(800, 1200)
    assert config.conversation_prefix_tokens.max_value == 10000
    assert config.arrival_rate_per_s is None
    assert config.history_rewrite_prob == 0.0


def test_default_conversation_prefix_averages_about_4000():
    rng = random.Random(5)
    draws = [SyntheticMultiTurnConfig().conversation_prefix_tokens.sample(rng) for _ in range(40_000)]
    # mean 4000 before clipping at 10000; clipping the lognormal's tail costs ~2 %
    assert 3800 < statistics.fmean(draws) < 4000
    assert max(draws) == 10000


def test_default_gap_matches_mooncake_median_and_p90():
    rng = random.Random(6)
    gaps = sorted(SyntheticMultiTurnConfig().inter_turn_gap_s.sample(rng) for _ in range(40_000))
    assert gaps[20_000] == pytest.approx(126, rel=0.05)
    assert gaps[36_000] == pytest.approx(480, rel=0.05)


def test_default_run_shape():
    conversations = run()
    assert len(conversations) == 24
    for conversation in conversations:
        assert 6 <= len(conversation.turns) <= 9  # 12-18 messages, user + assistant
        assert conversation.shared_prefix_tokens == 500
        assert conversation.start_s == 0.0
        assert conversation.turns[0].gap_before_s == 0.0
        assert all(turn.arrival_s is None for turn in conversation.turns)
        assert all(800 <= turn.output_tokens <= 1200 for turn in conversation.turns)
        # first prompt: 500 common + prefix in [0, 10000] + user in [120, 160]
        assert 620 <= conversation.turns[0].prompt_tokens <= 10_660
    assert len({conversation.conversation_id for conversation in conversations}) == 24


def test_prompt_formula_with_constants():
    config = SyntheticMultiTurnConfig(num_conversations=2, messages_per_conversation=Constant(8),
                                      common_prefix_tokens=Constant(500), conversation_prefix_tokens=Constant(4000),
                                      user_tokens=Constant(100), output_tokens=Constant(1000))
    for conversation in run(config):
        assert [turn.prompt_tokens for turn in conversation.turns] == [4600, 5700, 6800, 7900]
        assert [turn.output_tokens for turn in conversation.turns] == [1000] * 4


@pytest.mark.parametrize("messages, turns", [(1, 1), (2, 1), (12, 6), (13, 7), (18, 9)])
def test_messages_become_user_turns_like_vllm(messages, turns):
    config = SyntheticMultiTurnConfig(num_conversations=1, messages_per_conversation=Constant(messages))
    assert len(run(config)[0].turns) == turns


@settings(max_examples=40, deadline=None)
@given(common=st.integers(0, 2000), prefix_low=st.integers(0, 5000), prefix_width=st.integers(0, 5000),
       user_low=st.integers(1, 300), user_width=st.integers(0, 300), out_low=st.integers(1, 2000),
       out_width=st.integers(0, 500), messages=st.integers(1, 30), seed=seeds)
def test_prompts_follow_the_formula(common, prefix_low, prefix_width, user_low, user_width, out_low, out_width,
                                    messages, seed):
    config = SyntheticMultiTurnConfig(
        num_conversations=3, messages_per_conversation=UniformInt(1, messages), common_prefix_tokens=Constant(common),
        conversation_prefix_tokens=UniformInt(prefix_low, prefix_low + prefix_width),
        user_tokens=UniformInt(user_low, user_low + user_width), output_tokens=UniformInt(out_low, out_low + out_width))
    for conversation in run(config, seed, seed + 1):
        turns = conversation.turns
        assert conversation.shared_prefix_tokens == common
        prefix_and_user = turns[0].prompt_tokens - common
        assert prefix_low + user_low <= prefix_and_user <= prefix_low + prefix_width + user_low + user_width
        for previous, turn in zip(turns, turns[1:]):
            assert turn.prompt_tokens >= previous.prompt_tokens  # never shrinks
            user = turn.prompt_tokens - previous.prompt_tokens - previous.output_tokens
            assert user_low <= user <= user_low + user_width
        assert all(out_low <= turn.output_tokens <= out_low + out_width for turn in turns)


@given(workload_seed=seeds, gaps_seed=seeds)
@settings(max_examples=20, deadline=None)
def test_same_seeds_same_conversations(workload_seed, gaps_seed):
    assert run(workload_seed=workload_seed, gaps_seed=gaps_seed) == run(workload_seed=workload_seed,
                                                                        gaps_seed=gaps_seed)


def test_different_seeds_differ():
    assert tokens(run(workload_seed=1)) != tokens(run(workload_seed=2))


def gaps(conversations):
    return [[turn.gap_before_s for turn in conversation.turns] for conversation in conversations]


@pytest.mark.parametrize("timing", [
    {"inter_turn_gap_s": Constant(5.0)},
    {"inter_turn_gap_s": Exponential(30.0)},
    {"arrival_rate_per_s": 0.5},
    {"inter_turn_gap_s": Uniform(1, 2), "arrival_rate_per_s": 3.0},
])
def test_timing_changes_leave_token_counts_alone(timing):
    baseline = run()
    changed = run(dataclasses.replace(SyntheticMultiTurnConfig(), **timing))
    assert tokens(changed) == tokens(baseline)
    assert gaps(changed) != gaps(baseline) or [c.start_s for c in changed] != [c.start_s for c in baseline]


def test_gap_seed_changes_only_timing():
    first, second = run(gaps_seed=1), run(gaps_seed=99)
    assert tokens(first) == tokens(second)
    assert gaps(first) != gaps(second)


def test_rewrite_probability_leaves_token_counts_alone():
    baseline = run()
    rewritten = run(dataclasses.replace(SyntheticMultiTurnConfig(), history_rewrite_prob=0.3))
    assert tokens(rewritten) == tokens(baseline)
    assert gaps(rewritten) == gaps(baseline)


def test_rewrite_revisions():
    never = run()
    always = run(dataclasses.replace(SyntheticMultiTurnConfig(), history_rewrite_prob=1.0))
    assert all(turn.history_revision == 0 for conversation in never for turn in conversation.turns)
    for conversation in always:
        assert [turn.history_revision for turn in conversation.turns] == list(range(len(conversation.turns)))


def test_changing_token_config_keeps_other_conversations_gaps():
    # each conversation owns its sub-streams: more turns in one does not shift another's gaps
    short = run(dataclasses.replace(SyntheticMultiTurnConfig(), messages_per_conversation=Constant(4)))
    long = run(dataclasses.replace(SyntheticMultiTurnConfig(), messages_per_conversation=Constant(10)))
    for a, b in zip(gaps(short), gaps(long)):
        assert b[:len(a)] == a


def test_poisson_arrivals():
    config = SyntheticMultiTurnConfig(num_conversations=4000, messages_per_conversation=Constant(2),
                                      arrival_rate_per_s=2.0)
    starts = [conversation.start_s for conversation in run(config)]
    assert starts == sorted(starts) and starts[0] > 0
    inter_arrivals = [b - a for a, b in zip([0.0] + starts, starts)]
    assert statistics.fmean(inter_arrivals) == pytest.approx(0.5, rel=0.05)


def test_gaps_come_from_the_gap_distribution():
    config = SyntheticMultiTurnConfig(inter_turn_gap_s=Uniform(10, 20))
    for conversation in run(config):
        assert conversation.turns[0].gap_before_s == 0.0
        assert all(10 <= turn.gap_before_s <= 20 for turn in conversation.turns[1:])


@pytest.mark.parametrize("field, value, reason", [
    ("num_conversations", 0, "num_conversations must be >= 1"),
    ("arrival_rate_per_s", 0.0, "arrival_rate_per_s"),
    ("arrival_rate_per_s", float("inf"), "arrival_rate_per_s"),
    ("history_rewrite_prob", 1.5, "history_rewrite_prob"),
    ("history_rewrite_prob", -0.1, "history_rewrite_prob"),
])
def test_config_validation(field, value, reason):
    with pytest.raises(ValueError, match=reason):
        SyntheticMultiTurnConfig(**{field: value})


def test_conversation_prefix_can_be_lognormal_without_cap():
    config = SyntheticMultiTurnConfig(num_conversations=3, conversation_prefix_tokens=LogNormal(5.0, 0.1))
    assert all(conversation.turns[0].prompt_tokens > 500 for conversation in run(config))
