"""TextPrompt: the continuation guard's view of a plain-string prompt (used by the router)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from impl.policy import ItemsPrompt, canonical_messages, continues, sequence_digest
from impl.policy.text_prompt import TextPrompt



@settings(max_examples=200, deadline=None)
@given(held=st.text(max_size=40), new=st.text(max_size=60))
def test_text_prompt_continues_iff_prefix(held, new):
    held_len, digest = TextPrompt(held).full_digest()
    assert continues(TextPrompt(new), held_len, digest) == new.startswith(held)


def test_text_digest_never_equals_a_chat_digest():
    msg = canonical_messages([{"role": "user", "content": "hi"}])
    text = msg[0]  # a text prompt that is literally a canonical message
    held_len, digest = TextPrompt(text).full_digest()
    assert digest != sequence_digest(msg)
    assert not continues(ItemsPrompt(msg), 1, digest)


def test_text_prompt_rejects_out_of_range_prefix():
    with pytest.raises(ValueError):
        TextPrompt("abc").prefix_digest(4)




@given(st.lists(st.fixed_dictionaries({"role": st.text(max_size=12), "content": st.text(max_size=80)}), max_size=6),
       st.lists(st.dictionaries(st.sampled_from(["role", "content", "name", "tool_call_id"]),
                                st.one_of(st.text(max_size=10), st.integers(), st.lists(st.text(max_size=5), max_size=3)),
                                min_size=1), max_size=4))
def test_canonical_messages_is_sorted_compact_json(plain, mixed):
    """Whatever path a message takes, its canonical form is its sorted, compact, non-ASCII-kept JSON."""
    import json

    messages = plain + [m for m in mixed if "role" in m]
    expected = [json.dumps(m, sort_keys=True, ensure_ascii=False, separators=(",", ":")) for m in messages]
    assert canonical_messages(messages) == expected
