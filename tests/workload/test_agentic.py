"""Agentic tool loops: context grows by tool results, short gaps after tool calls, streams separate."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings, strategies as st

from sim.workload.agentic import AgenticConfig, generate
from sim.workload.distributions import Constant, UniformInt

seeds = st.integers(0, 2**32)

# distinguishable constants so every turn says what it was
TAGGED = AgenticConfig(
    num_conversations=5, steps_per_session=Constant(12), system_prompt_tokens=Constant(3000), task_tokens=Constant(200),
    tool_call_tokens=Constant(50), tool_result_tokens=Constant(1000), answer_tokens=Constant(700),
    follow_up_tokens=Constant(30), tool_latency_s=Constant(2.0), user_think_s=Constant(100.0), answer_prob=0.25)


def run(config=AgenticConfig(), workload_seed=1, gaps_seed=2):
    return generate(config, random.Random(workload_seed), random.Random(gaps_seed))


def tokens(sessions):
    return [[(turn.prompt_tokens, turn.output_tokens) for turn in session.turns] for session in sessions]


def test_context_grows_by_output_plus_tool_result_or_follow_up():
    for session in run(TAGGED):
        turns = session.turns
        assert session.shared_prefix_tokens == 3000
        assert turns[0].prompt_tokens == 3200 and turns[0].gap_before_s == 0.0
        assert turns[-1].output_tokens == 700  # a session ends with an answer
        for previous, turn in zip(turns, turns[1:]):
            if previous.output_tokens == 50:  # a tool call: the tool ran, its result came back
                assert turn.prompt_tokens == previous.prompt_tokens + 50 + 1000
                assert turn.gap_before_s == 2.0
            else:  # an answer: the user read it and wrote again
                assert previous.output_tokens == 700
                assert turn.prompt_tokens == previous.prompt_tokens + 700 + 30
                assert turn.gap_before_s == 100.0


def test_mostly_tool_calls_with_occasional_answers():
    outputs = [turn.output_tokens for session in run(dataclasses.replace(TAGGED, num_conversations=200))
               for turn in session.turns[:-1]]
    assert set(outputs) == {50, 700}
    assert 0.2 < outputs.count(700) / len(outputs) < 0.3  # answer_prob 0.25


def test_answer_prob_zero_answers_only_at_the_end():
    for session in run(dataclasses.replace(TAGGED, answer_prob=0.0)):
        assert [turn.output_tokens for turn in session.turns] == [50] * 11 + [700]


def test_default_gaps_are_short_tool_latencies():
    sessions = run(dataclasses.replace(AgenticConfig(), answer_prob=0.0, num_conversations=50))
    gaps = sorted(turn.gap_before_s for session in sessions for turn in session.turns[1:])
    assert 1.0 < gaps[len(gaps) // 2] < 4.0  # median tool latency 2 s


@settings(max_examples=30, deadline=None)
@given(seed=seeds, steps=st.integers(1, 30))
def test_prompts_never_shrink(seed, steps):
    config = dataclasses.replace(AgenticConfig(), num_conversations=3, steps_per_session=UniformInt(1, steps))
    for session in run(config, seed, seed + 1):
        assert 1 <= len(session.turns) <= steps
        assert all(b.prompt_tokens > a.prompt_tokens for a, b in zip(session.turns, session.turns[1:]))


@settings(max_examples=10, deadline=None)
@given(workload_seed=seeds, gaps_seed=seeds)
def test_same_seeds_same_sessions(workload_seed, gaps_seed):
    assert run(workload_seed=workload_seed, gaps_seed=gaps_seed) == run(workload_seed=workload_seed,
                                                                        gaps_seed=gaps_seed)


@pytest.mark.parametrize("timing", [
    {"tool_latency_s": Constant(0.5)},
    {"user_think_s": Constant(1.0)},
    {"arrival_rate_per_s": 0.1},
])
def test_timing_changes_leave_token_counts_alone(timing):
    assert tokens(run(dataclasses.replace(AgenticConfig(), **timing))) == tokens(run())


def test_gap_seed_changes_only_timing():
    first, second = run(gaps_seed=1), run(gaps_seed=7)
    assert tokens(first) == tokens(second)
    assert [t.gap_before_s for s in first for t in s.turns] != [t.gap_before_s for s in second for t in s.turns]


def test_rewrites():
    always = run(dataclasses.replace(TAGGED, history_rewrite_prob=1.0))
    assert tokens(always) == tokens(run(TAGGED))
    for session in always:
        assert [turn.history_revision for turn in session.turns] == list(range(12))


@pytest.mark.parametrize("field, value", [("num_conversations", 0), ("answer_prob", 1.1),
                                          ("history_rewrite_prob", -1.0), ("arrival_rate_per_s", -2.0)])
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        AgenticConfig(**{field: value})
