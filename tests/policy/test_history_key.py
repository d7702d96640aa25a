"""History keys (impl.policy.history_key): a resent history finds the turn stored before it, and only that."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from impl.policy.continuation import canonical_messages, sequence_digest
from impl.policy.history_key import (HISTORY_PREFIX, HistoryKeys, add_anchor_length, anchor_lengths, key_item, text_anchors,
                                     token_anchors)

texts = st.text(min_size=0, max_size=20)
roles = st.sampled_from(["system", "user", "assistant", "tool"])
messages = st.lists(st.fixed_dictionaries({"role": roles, "content": texts}), min_size=1, max_size=8)


@given(messages, texts, st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "tool"]), "content": texts}),
                                 min_size=1, max_size=3))
def test_the_next_turn_finds_the_turn_before_first(history, answer, new):
    stored = HistoryKeys(history).after_answer(answer)
    later = HistoryKeys(history + [{"role": "assistant", "content": answer}] + new)
    assert later.candidates[0] == stored


@given(messages, texts)
def test_a_plain_history_key_is_the_guards_digest(history, answer):
    """One pass serves both: the key of a plain history is the digest the continuation guard holds."""
    held = canonical_messages(history + [{"role": "assistant", "content": answer}])
    assert HistoryKeys(history, items=canonical_messages(history)).after_answer(answer) == HISTORY_PREFIX + sequence_digest(held)


@given(messages, texts, texts)
def test_another_answer_is_another_key(history, answer, other):
    keys = HistoryKeys(history)
    assert (keys.after_answer(answer) == keys.after_answer(other)) == (answer == other)


def test_candidates_are_the_assistant_boundaries_most_recent_first_and_bounded():
    history = []
    expected = []
    for i in range(12):
        history += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
        expected.append(HistoryKeys(history[:-1]).after_answer(f"a{i}"))
    keys = HistoryKeys(history + [{"role": "user", "content": "now"}], max_candidates=5)
    assert keys.candidates == expected[::-1][:5]
    assert HistoryKeys(history, max_candidates=0).candidates == []
    assert HistoryKeys([{"role": "user", "content": "first"}]).candidates == []


def test_the_normal_form_forgets_what_sdks_change_and_keeps_what_was_said():
    plain = {"role": "assistant", "content": "hi"}
    resent = {"role": "assistant", "content": "hi", "refusal": None, "tool_calls": [], "audio": None,
              "reasoning_content": "hmm", "annotations": []}
    assert key_item(resent) == key_item(plain) == canonical_messages([plain])[0]
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "index": 0, "function": {"name": "f", "arguments": '{"b": 1, "a": [1, 2]}'}}]}
    respelt = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":[1,2],"b":1}'}}]}
    assert key_item(call) == key_item(respelt)
    other_args = {**respelt, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":[2,1],"b":1}'}}]}
    assert key_item(other_args) != key_item(call)
    assert key_item({"role": "user", "content": "hi"}) != key_item(plain)
    assert key_item({"role": "tool", "content": "42", "tool_call_id": "c1"}) != key_item({"role": "tool", "content": "42", "tool_call_id": "c2"})


@given(st.text(min_size=0, max_size=600), st.text(min_size=0, max_size=600), st.integers(1, 64), st.integers(1, 8))
def test_a_text_that_extends_a_held_text_finds_its_anchor(held, appended, chunk, k):
    anchors = text_anchors(chunk, k)
    found = anchors.directory(held) in anchors.candidates(held + appended)
    if len(appended) <= (k - 1) * chunk:
        assert found  # the documented reach
    if found:  # an anchor names a prefix by its length and content: the held text's own
        n = len(held) - len(held) % chunk
        assert (held + appended)[:n] == held[:n]
    # the exact key is found from the length its directory lists, and only by a text that continues it
    assert anchors.exact(held + appended, [len(held)]) == [anchors.stored(held)]


@given(st.lists(st.integers(0, 2**31 - 1), max_size=300), st.lists(st.integers(0, 2**31 - 1), max_size=300))
def test_token_anchors_reach_and_differ(held, appended):
    anchors = token_anchors(16, 4)
    if len(appended) <= 3 * 16:
        assert anchors.directory(held) in anchors.candidates(held + appended)
        assert anchors.exact(held + appended, [len(held)]) == [anchors.stored(held)]
    if len(held) >= 16:
        changed = [held[0] ^ 1] + held[1:]
        assert anchors.stored(changed) != anchors.stored(held)


@given(messages, texts)
def test_the_known_guard_digests_are_the_guards_own(history, answer):
    items = canonical_messages(history)
    keys = HistoryKeys(history, items=items)
    for n, digest in keys.guard_digests.items():
        assert digest == sequence_digest(items[:n])
    digest, is_guard = keys.after_answer_digest(answer)
    assert is_guard and digest == sequence_digest(items + canonical_messages([{"role": "assistant", "content": answer}]))


def test_a_message_with_more_keys_ends_the_known_digests():
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
               {"role": "user", "content": "q2", "name": "bob"}, {"role": "assistant", "content": "a2"}]
    keys = HistoryKeys(history, items=canonical_messages(history))
    assert list(keys.guard_digests) == [2]
    assert keys.after_answer_digest("x")[1] is False


@given(st.text(min_size=1, max_size=200), st.lists(st.text(min_size=1, max_size=60), min_size=2, max_size=6, unique=True),
       st.text(max_size=100))
def test_held_texts_sharing_a_long_prefix_each_find_only_their_own_key(shared, tails, appended):
    """A shared few-shot or system prefix puts every conversation's anchor inside it: the directory lists
    each held length, and each next prompt finds the exact key of the text it continues, no other."""
    anchors = text_anchors(16, 8)
    helds = [shared * 4 + tail for tail in tails]
    params = None
    for held in helds:
        params = add_anchor_length(params, len(held))
    for held in helds:
        prompt = held + appended
        lengths = anchor_lengths(params, len(prompt))
        keys = set(anchors.exact(prompt, lengths))
        assert anchors.stored(held) in keys
        for other in helds:  # another held text's key is found only by a prompt that continues it
            if anchors.stored(other) in keys:
                assert prompt.startswith(other)


def test_a_directory_keeps_the_most_recent_lengths_and_reads_nothing_from_garbage():
    params = None
    for n in range(1, 12):
        params = add_anchor_length(params, n)
    assert anchor_lengths(params, 100) == [11, 10, 9, 8, 7, 6, 5, 4]
    assert anchor_lengths(add_anchor_length(params, 9), 100)[:2] == [9, 11]
    assert anchor_lengths(params, 8) == [8, 7, 6, 5, 4]
    for garbage in (None, {}, {"bidikv_anchor_lengths": "3"}, {"bidikv_anchor_lengths": [True, -1, 2.0, "4"]}, []):
        assert anchor_lengths(garbage, 100) == []
