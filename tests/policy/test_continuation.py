"""The continuation guard's digest: no two different sequences share one (re-split items, ints vs
strings), and ``continues`` is exactly "the prompt starts with the held items"."""

from __future__ import annotations

from hypothesis import assume, given, strategies as st

from impl.policy import ItemsPrompt, continues, sequence_digest

items = st.one_of(st.integers(0, 200_000), st.text(max_size=4))


@st.composite
def two_splits(draw):
    """Two different ways of cutting one string into items (the digest must tell them apart)."""
    # "s" and "i" are the digest's own type tags: a digest without length prefixes confuses ["as", "b"] with ["a", "sb"]
    text = draw(st.text(alphabet="si1", min_size=2, max_size=8))
    cuts = [sorted(draw(st.sets(st.integers(1, len(text) - 1), max_size=len(text) - 1))) for _ in range(2)]
    assume(cuts[0] != cuts[1])
    return [[text[i:j] for i, j in zip([0, *c], [*c, len(text)])] for c in cuts]


@given(two_splits())
def test_re_split_strings_have_different_digests(splits):
    a, b = splits
    assert "".join(a) == "".join(b) and a != b
    assert sequence_digest(a) != sequence_digest(b)


@given(two_splits())
def test_re_split_token_ids_have_different_digests(splits):
    a, b = ([int(x.replace("s", "2").replace("i", "3")) for x in s] for s in splits)
    assume(a != b)
    assert sequence_digest(a) != sequence_digest(b)  # e.g. [12, 3] and [1, 23]


@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=5))
def test_token_ids_and_their_decimal_strings_differ(ids):
    assert sequence_digest(ids) != sequence_digest([str(i) for i in ids])


@given(prompt=st.lists(items, max_size=8), data=st.data())
def test_continues_iff_the_prompt_starts_with_the_held_items(prompt, data):
    shape = data.draw(st.sampled_from(["prefix", "edited", "longer", "any"]))
    if shape == "prefix":
        held = prompt[: data.draw(st.integers(0, len(prompt)))]
    elif shape == "edited" and prompt:
        i = data.draw(st.integers(0, len(prompt) - 1))
        held = prompt[:i] + [data.draw(items.filter(lambda x: x != prompt[i]))]
    elif shape == "longer":
        held = prompt + data.draw(st.lists(items, min_size=1, max_size=2))
    else:
        held = data.draw(st.lists(items, max_size=8))
    expected = prompt[: len(held)] == held
    assert continues(ItemsPrompt(prompt), len(held), sequence_digest(held)) is expected
