from __future__ import annotations

import pytest

from sim.published import NUM_CONVERSATIONS, published_conversations


@pytest.mark.parametrize("target", [2000, 20000, 24000])
def test_each_conversation_lands_a_later_turn_on_the_target(target):
    convs, targets = published_conversations(target, seed=3)
    assert len(convs) == NUM_CONVERSATIONS
    for conv, t in zip(convs, targets):
        assert t >= 1
        assert conv.turns[t].prompt_tokens == target
        # the benchmark's shape: 500 common + per-conversation prefix in [0, 10000] + 120-160 user tokens
        first_user_and_prefix = conv.turns[0].prompt_tokens - 500
        assert 120 <= first_user_and_prefix <= 10_160
        for a, b in zip(conv.turns, conv.turns[1:]):
            assert 800 + 120 <= b.prompt_tokens - a.prompt_tokens <= 1200 + 160
            assert b.prompt_tokens - a.prompt_tokens - a.output_tokens in range(120, 161)


def test_too_short_a_target_is_refused():
    with pytest.raises(ValueError, match="prompt_tokens"):
        published_conversations(1000)
