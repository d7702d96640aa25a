"""sim.workload.history: where a resent history departs from what D holds, and the presets on it.

Expected values are worked out by hand from the turns (the previous prompt, output and reasoning),
never read back from the module under test.
"""

from __future__ import annotations

import random

import pytest

from sim.workload import load_workload
from sim.workload.distributions import Constant
from sim.workload.history import PRESETS, HistoryConfig, apply
from sim.workload.model import Conversation, Lineage, Turn

SMALL = {"num_conversations": 6}


def shape(conversations):
    return [[(t.prompt_tokens, t.output_tokens, t.gap_before_s, t.history_revision, t.tool_call)
             for t in c.turns] for c in conversations]


def test_without_divergence_the_generators_output_is_unchanged():
    for kind in ("synthetic", "agentic"):
        plain = load_workload({"kind": kind, **SMALL}, 4)
        assert all(t.reuse_agreement_tokens is None for c in plain for t in c.turns)
        # a preset switched back to faithful is its generator, draw for draw
        faithful = {"reasoning_tokens": 0, "drift_prob": 0.0, "tool_call_rerender_prob": 0.0, "edit_prob": 0.0}
        preset = "reasoning_chat" if kind == "synthetic" else "reasoning_agent"
        assert load_workload({"kind": preset, **SMALL, **faithful}, 4) == plain


def test_reasoning_chat_drops_thinking_so_reuse_ends_at_the_previous_prompt():
    base = load_workload({"kind": "synthetic", **SMALL}, 9)
    chat = load_workload({"kind": "reasoning_chat", **SMALL}, 9)
    thinking = 0
    for b, c in zip(base, chat):
        for i, (bt, ct) in enumerate(zip(b.turns, c.turns)):
            # thinking is never resent: every prompt is the generator's; outputs grow by the thinking
            assert ct.prompt_tokens == bt.prompt_tokens and ct.gap_before_s == bt.gap_before_s
            assert ct.output_tokens >= bt.output_tokens
            thinking += ct.output_tokens - bt.output_tokens
            if i:
                previous = c.turns[i - 1]
                if previous.output_tokens > b.turns[i - 1].output_tokens:
                    assert ct.reuse_agreement_tokens == previous.prompt_tokens
                else:  # that answer had no thinking to drop
                    assert ct.reuse_agreement_tokens is None
    assert thinking > 0


def conv(turns, shared=100):
    return Conversation("c", 0.0, tuple(turns), shared)


def test_within_tool_loop_keeps_thinking_until_the_next_user_message():
    # three tool calls, an answer, then the user's follow-up: generator prompts grow by output + tool result
    base = conv([Turn(1000, 50, tool_call=True), Turn(1300, 40, tool_call=True), Turn(1600, 30, tool_call=True),
                 Turn(1900, 200, tool_call=False), Turn(2200, 60, tool_call=True)])
    config = HistoryConfig(reasoning_tokens=Constant(10), reasoning_resent="within_tool_loop")
    (out,) = apply([base], config, random.Random(1))
    assert [t.output_tokens for t in out.turns] == [60, 50, 40, 210, 70]
    # inside the loop each step's 10 thinking tokens stay in the history: +10, +20, +30
    assert [t.prompt_tokens for t in out.turns] == [1000, 1310, 1620, 1930, 2200]
    # faithful inside the loop; at the follow-up every thinking block goes, from the first one (turn 0's, at 1000)
    assert [t.reuse_agreement_tokens for t in out.turns] == [None, None, None, None, 1000]
    never = apply([base], HistoryConfig(reasoning_tokens=Constant(10), reasoning_resent="never"), random.Random(1))[0]
    assert [t.prompt_tokens for t in never.turns] == [1000, 1300, 1600, 1900, 2200]
    assert [t.reuse_agreement_tokens for t in never.turns] == [None, 1000, 1300, 1600, 1900]
    always = apply([base], HistoryConfig(reasoning_tokens=Constant(10), reasoning_resent="always"), random.Random(1))[0]
    assert [t.prompt_tokens for t in always.turns] == [1000, 1310, 1620, 1930, 2240]
    assert all(t.reuse_agreement_tokens is None for t in always.turns)


def test_answer_drift_and_tool_call_rerendering_diverge_inside_the_previous_output():
    base = conv([Turn(1000, 50), Turn(1300, 40, tool_call=True), Turn(1600, 30)])
    (drift,) = apply([base], HistoryConfig(drift_prob=1.0, drift_tail_tokens=Constant(5)), random.Random(2))
    # the last 5 of the previous output's tokens read back differently: 1000 + 50 - 5, 1300 + 40 - 5
    assert [t.reuse_agreement_tokens for t in drift.turns] == [None, 1045, 1335]
    (one,) = apply([base], HistoryConfig(drift_prob=1.0, drift_tail_tokens=Constant(1)), random.Random(2))
    # only the last token differs: D never holds its KV, so nothing D holds is lost
    assert all(t.reuse_agreement_tokens is None for t in one.turns)
    (tool,) = apply([base], HistoryConfig(tool_call_rerender_prob=1.0), random.Random(2))
    assert tool.turns[1].reuse_agreement_tokens is None  # turn 0 answered: no tool call to re-serialise
    assert 1300 <= tool.turns[2].reuse_agreement_tokens < 1340


def test_edited_history_bumps_the_revision_and_agrees_up_to_the_edit():
    base = conv([Turn(1000, 50), Turn(1300, 40), Turn(1600, 30)], shared=100)
    config = HistoryConfig(edit_prob=1.0, edit_point=Constant(0.5))
    (out,) = apply([base], config, random.Random(3))
    assert [t.history_revision for t in out.turns] == [0, 1, 2]
    # half of the history after the 100-token system prompt is kept: 100 + (1000 - 100) / 2, 100 + 1200 / 2
    assert [t.reuse_agreement_tokens for t in out.turns] == [None, 550, 700]
    lineage = Lineage(out.turns)
    assert lineage.held_agreement(2, 1) == 700 and lineage.held_agreement(2, 0) == 550


def test_a_generator_rewrite_without_a_stated_agreement_shares_nothing():
    base = conv([Turn(1000, 50), Turn(1300, 40, history_revision=1), Turn(1600, 30, history_revision=1)])
    (out,) = apply([base], HistoryConfig(drift_prob=1.0, drift_tail_tokens=Constant(5)), random.Random(4))
    assert out.turns[1].reuse_agreement_tokens is None and out.turns[1].history_revision == 1
    assert Lineage(out.turns).agreement == (0, 0, 1335)


@pytest.mark.parametrize("kind", sorted(PRESETS))
def test_presets_are_deterministic_per_seed_and_keep_the_generators_draws(kind):
    a = load_workload({"kind": kind, **SMALL}, 11)
    assert a == load_workload({"kind": kind, **SMALL}, 11)
    assert a != load_workload({"kind": kind, **SMALL}, 12)
    plain = load_workload({"kind": PRESETS[kind].generator, **SMALL}, 11)
    # the history's own stream never shifts the generator's: gaps and tool calls are the generator's
    assert [[(t.gap_before_s, t.tool_call) for t in c.turns] for c in a] == \
        [[(t.gap_before_s, t.tool_call) for t in c.turns] for c in plain]
    assert any(t.reuse_agreement_tokens is not None for c in a for t in c.turns)


def test_history_keys_are_validated_and_named():
    with pytest.raises(ValueError, match="drift_prob must be in"):
        load_workload({"kind": "synthetic", "drift_prob": 2.0}, 1)
    with pytest.raises(ValueError, match="reasoning_resent must be one of"):
        load_workload({"kind": "agentic", "reasoning_resent": "sometimes"}, 1)
    with pytest.raises(ValueError, match=r"unknown key 'drift'.*drift_prob"):
        load_workload({"kind": "reasoning_chat", "drift": 0.1}, 1)
    # a preset's value is overridden like any other key
    more = load_workload({"kind": "answer_drift", **SMALL, "drift_prob": 1.0}, 1)
    some = load_workload({"kind": "answer_drift", **SMALL}, 1)
    assert sum(t.reuse_agreement_tokens is not None for c in more for t in c.turns) > \
        sum(t.reuse_agreement_tokens is not None for c in some for t in c.turns)
