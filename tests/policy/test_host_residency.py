"""impl.policy.host_residency: the router's estimate that D's host tier still holds a turn, and the rule
for asking P to pull it. Properties under hypothesis; the exact case checked against a reference LRU
of conversation spans (the granularity the simulator's host tier and the estimate share)."""

from __future__ import annotations

import collections

import pytest
from hypothesis import example, given, settings, strategies as st

from impl.policy.host_residency import (DEFAULT_COUNT_ERROR, MIN_LIKELIHOOD_WITHOUT_COSTS, HostSpan,
                                        host_hit_likelihood, worth_asking)

tokens = st.integers(min_value=0, max_value=1 << 22)
errors = st.floats(min_value=0.0, max_value=0.9)


@settings(max_examples=300, deadline=None)
@given(span=tokens, since=tokens, more=tokens, capacity=tokens, extra=tokens, error=errors)
def test_likelihood_is_a_probability_falling_with_traffic_and_rising_with_capacity(span, since, more, capacity, extra,
                                                                                   error):
    p = host_hit_likelihood(HostSpan(span, since, capacity), error)
    assert 0.0 <= p <= 1.0
    assert host_hit_likelihood(HostSpan(span, since + more, capacity), error) <= p  # more taken in since
    assert host_hit_likelihood(HostSpan(span, since, capacity + extra), error) >= p  # a larger tier


@settings(max_examples=200, deadline=None)
@given(span=tokens, since=tokens, capacity=tokens, error=errors)
def test_what_is_known_gone_has_likelihood_zero(span, since, capacity, error):
    assert host_hit_likelihood(HostSpan(span, since, capacity, same_incarnation=False), error) == 0.0
    if span > capacity:  # never stored: prepare_store finds no room
        assert host_hit_likelihood(HostSpan(span, since, capacity), error) == 0.0
    if span == 0:
        assert host_hit_likelihood(HostSpan(0, since, capacity), error) == 0.0


@given(span=st.integers(1, 1 << 20), capacity=tokens, error=errors)
def test_nothing_taken_in_since_is_certain_if_it_fit(span, capacity, error):
    assert host_hit_likelihood(HostSpan(span, 0, capacity), error) == (1.0 if span <= capacity else 0.0)


@given(span=st.integers(1, 1000), since=st.integers(1, 10_000), capacity=st.integers(1, 20_000))
def test_the_uncertain_band_is_the_count_error_around_the_count(span, since, capacity):
    room = capacity - span
    p = host_hit_likelihood(HostSpan(span, since, capacity), 0.25)
    if room >= 1.25 * since:
        assert p == 1.0
    elif room < 0.75 * since:
        assert p == 0.0
    else:  # uniform: the share of counts in [0.75, 1.25] x since that still fit
        assert p == pytest.approx((room - 0.75 * since) / (0.5 * since))


def _lru_resident(spans: list[int], capacity: int) -> list[bool]:
    """Reference: distinct conversations' spans stored in order into an LRU of ``capacity`` tokens."""
    cache: collections.OrderedDict[int, int] = collections.OrderedDict()
    used = 0
    for i, s in enumerate(spans):
        if s > capacity:
            continue
        while used + s > capacity:
            _, old = cache.popitem(last=False)
            used -= old
        cache[i] = s
        used += s
    return [i in cache for i in range(len(spans))]


@settings(max_examples=300, deadline=None)
@given(spans=st.lists(st.integers(1, 500), min_size=1, max_size=40), capacity=st.integers(1, 3000))
@example(spans=[100, 100, 100], capacity=300)  # exactly full: all three stay
def test_with_an_exact_count_the_estimate_is_the_lru_itself(spans, capacity):
    resident = _lru_resident(spans, capacity)
    for i, s in enumerate(spans):
        since = sum(t for t in spans[i + 1:] if t <= capacity)  # what the router counts after the span
        p = host_hit_likelihood(HostSpan(s, since, capacity), count_error=0.0)
        assert p == (1.0 if resident[i] else 0.0), (i, spans, capacity)


@settings(max_examples=300, deadline=None)
@given(p=st.floats(0.0, 1.0), q=st.floats(0.0, 1.0), pull=st.floats(0.0, 10.0), recompute=st.floats(0.0, 10.0),
       probe=st.floats(0.0, 1.0), session=st.floats(0.0, 10.0))
def test_asking_is_monotone_in_the_likelihood_and_never_for_a_known_miss(p, q, pull, recompute, probe, session):
    lo, hi = sorted((p, q))
    costs = dict(pull_s=pull, recompute_s=recompute, probe_s=probe, session_s=session)
    if worth_asking(lo, **costs):
        assert worth_asking(hi, **costs)
    assert not worth_asking(0.0, **costs) and not worth_asking(0.0)
    # a certain hit is asked for exactly when the pull and the session beat the recompute
    assert worth_asking(1.0, **costs) == (pull + session < recompute)
    # a miss costs the probe: a pull that only breaks even with recompute is never worth an uncertain ask
    if lo < 1.0:
        assert not worth_asking(lo, pull_s=recompute, recompute_s=recompute, probe_s=max(probe, 1e-3))


def test_without_costs_a_hit_must_be_at_least_as_likely_as_a_miss():
    assert worth_asking(MIN_LIKELIHOOD_WITHOUT_COSTS) and not worth_asking(MIN_LIKELIHOOD_WITHOUT_COSTS - 1e-9)
    assert 0 < DEFAULT_COUNT_ERROR < 1


@pytest.mark.parametrize("bad", [dict(span_tokens=-1, taken_in_since=0, capacity_tokens=1),
                                 dict(span_tokens=1, taken_in_since=1.5, capacity_tokens=1),
                                 dict(span_tokens=1, taken_in_since=0, capacity_tokens=True)])
def test_bad_counts_are_named(bad):
    with pytest.raises(ValueError, match="must be an integer >= 0"):
        HostSpan(**bad)


@pytest.mark.parametrize("call, match", [(lambda: host_hit_likelihood(HostSpan(1, 1, 1), 1.0), "count_error"),
                                         (lambda: worth_asking(1.5), "likelihood"),
                                         (lambda: worth_asking(0.5, pull_s=float("nan"), recompute_s=1.0), "pull_s")])
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()
