"""impl.policy.prefill_affinity: which P last prefilled a conversation, bounded. The router (impl/router/proxy.py)
and the simulator's router (sim/engine/router.py) both run it; checked here against the plainest reference: a list of
(conversation, P, tokens) in serving order, the last ``max_entries`` distinct conversations remembered."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from impl.policy.prefill_affinity import PrefillAffinity

served = st.tuples(st.integers(0, 7), st.sampled_from(["p0", "p1", "p2"]), st.integers(0, 10_000))


def _reference(events: list[tuple[int, str, int]], bound: int) -> dict[int, dict[str, int]]:
    last: dict[int, tuple[str, int]] = {}
    order: list[int] = []
    for key, name, tokens in events:
        last[key] = (name, tokens)
        if key in order:
            order.remove(key)
        order.append(key)
    return {key: {last[key][0]: last[key][1]} for key in order[-bound:]}


@settings(max_examples=300, deadline=None)
@given(events=st.lists(served, max_size=40), bound=st.integers(1, 9))
def test_remembers_the_last_p_of_the_most_recently_served_conversations(events, bound):
    affinity = PrefillAffinity(bound)
    for key, name, tokens in events:
        affinity.served(key, name, tokens)
    expected = _reference(events, bound)
    assert len(affinity) == len(expected) <= bound
    for key in range(8):
        assert affinity.cached_tokens(key) == expected.get(key, {})
        assert (key in affinity) == (key in expected)


def test_a_bound_below_one_is_refused():
    with pytest.raises(ValueError, match="max_entries"):
        PrefillAffinity(0)
