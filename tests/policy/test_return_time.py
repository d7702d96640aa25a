"""The learnt retention's estimator and decision: censoring handled exactly, bounded, deterministic, within budget."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings, strategies as st

from impl.policy.return_time import (
    DEFAULT_EDGES_S,
    LearntRetention,
    LearntRetentionSettings,
    ReturnEstimator,
    TurnShape,
)

EDGES = (10.0, 20.0, 40.0, 80.0)

# one turn's fate: finishes at `finish`, and after `gap` s either returns or (censored) is dropped from tracking
turn = st.tuples(st.floats(0, 100, allow_nan=False), st.floats(0, 120, allow_nan=False), st.booleans())


def _reference_counts(turns, end, edges):
    """Kaplan-Meier counts written out directly from each turn's fate, not incrementally: a turn is at risk
    in every bin whose end it was watched past (its end edge reached by its return, its drop or the end of
    the run), and at risk and back in the bin its return falls in (a return exactly at an edge is in the
    next bin); a turn that passes the last edge is done, and a turn censored inside a bin counts nowhere in it."""
    at_risk, returned = [0] * len(edges), [0] * len(edges)
    for finish, gap, returns in turns:
        event = finish + gap
        watched_until = min(event, end)
        j = 0
        while j < len(edges) and finish + edges[j] <= watched_until:
            at_risk[j] += 1
            j += 1
        if returns and event <= end and j < len(edges):
            at_risk[j] += 1
            returned[j] += 1
    return at_risk, returned


@settings(max_examples=200, deadline=None)
@given(st.lists(turn, min_size=1, max_size=40), st.floats(0, 300, allow_nan=False))
def test_counts_equal_the_product_limit_estimators_whatever_the_order_of_events(turns, end):
    turns = sorted(turns)
    est = ReturnEstimator(EDGES, prior_weight=0.0)
    events = []  # (time, order, kind, key): finishes before returns/drops at one instant, as a router sees them
    for k, (finish, gap, returns) in enumerate(turns):
        events.append((finish, 0, "finish", k))
        events.append((finish + gap, 1, "return" if returns else "drop", k))
    for t, _, kind, k in sorted(events):
        if t > end:
            break
        if kind == "finish":
            est.finished(k, "t", "g", t)
        elif kind == "return":
            est.returned(k, t)
        else:
            est.advance(t)
            dropped = est._open.pop(k, None)  # (already gone if it passed the last edge)
            if dropped is not None:
                dropped.live = False  # dropped from tracking: the bounded table's eviction, by hand
    est.advance(end)
    counts = est._counts.get("g")
    at_risk = [int(x) for x in counts.at_risk] if counts else [0] * len(EDGES)
    returned = [int(x) for x in counts.returned] if counts else [0] * len(EDGES)
    ref_at_risk, ref_returned = _reference_counts(turns, end, EDGES)
    assert (at_risk, returned) == (ref_at_risk, ref_returned)


def test_a_return_after_the_turn_was_dropped_is_not_counted_and_open_turns_never_bias_the_survival():
    est = ReturnEstimator(EDGES, max_open=2, prior_weight=0.0)
    est.finished("a", "t", "g", 0.0)
    est.finished("b", "t", "g", 1.0)
    est.finished("c", "t", "g", 2.0)  # table full: "a" is dropped (censored at 2 s, before any edge)
    assert len(est) == 2 and est.censored == 1
    assert est.returned("a", 15.0) is None
    assert est.returned("b", 16.0) == pytest.approx(15.0)  # bin 10-20 s: at risk in 0-10 and 10-20, returned in 10-20
    est.advance(1000.0)  # "c" never returns: at risk in every bin, returned in none
    s = est.survival("t", "g")
    # product-limit: bin 0: 2 at risk, 0 back; bin 1: 2 at risk, 1 back; then 1 at risk, 0 back
    assert s == pytest.approx([1.0, 0.5, 0.5, 0.5])


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 50), st.lists(st.tuples(st.integers(0, 200), st.floats(0, 50)), max_size=300))
def test_the_open_table_never_holds_more_than_max_open(max_open, calls):
    est = ReturnEstimator(EDGES, max_open=max_open)
    now = 0.0
    for key, step in calls:
        now += step
        if key % 3:
            est.finished(key, "t", "g", now)
        else:
            est.returned(key + 1, now)
        assert len(est) <= max_open
        assert sum(len(q) for q in est._queues) >= len(est)


def _feed(policy: LearntRetention, seed: int, conversations: int = 600) -> list:
    """A workload where later turns return more often than first ones, through the policy as a router would."""
    rng = random.Random(seed)
    events = []  # (time, kind, conversation, turn)
    for c in range(conversations):
        t = rng.uniform(0, 3000)
        turns = 1
        while rng.random() < (0.25 if turns == 1 else 0.7) and turns < 8:
            turns += 1
        for i in range(turns):
            events.append((t, 0, c, i))
            t += rng.uniform(1, 5)
            events.append((t, 1, c, i))
            t += rng.expovariate(1 / 60)
    turns, answers = {}, []
    for t, kind, c, i in sorted(events):
        if kind == 0:
            hold, group = policy.arrived("tenant", c if i > 0 else None, i, t)
            turns[c] = (hold, group)
            answers.append(hold)
        else:
            hold, group = turns[c]
            policy.finished(c, "tenant", group, 100, hold.retention_s, t)
    return answers


def test_the_same_calls_give_the_same_holds_to_the_bit():
    a = _feed(LearntRetention(LearntRetentionSettings(budget_size=2_000)), seed=3)
    b = _feed(LearntRetention(LearntRetentionSettings(budget_size=2_000)), seed=3)
    assert a == b and any(h.learnt for h in a)


def test_a_conversation_more_likely_to_return_is_kept_longer_and_the_budget_sets_the_price():
    tight = LearntRetention(LearntRetentionSettings(budget_size=1_000))
    _feed(tight, seed=5)
    first = tight.hold("tenant", ("tenant", TurnShape(0).bucket()))
    later = tight.hold("tenant", ("tenant", TurnShape(3, 30.0).bucket()))
    assert first.learnt and later.learnt
    assert later.retention_s > first.retention_s and later.return_chance > first.return_chance
    # the plan, scaled by how far the policy's own ledger ran from earlier plans, spends the budget: all of
    # it (the groups at the step of the price share it), not more
    assert tight.correction > 0
    assert tight.expected_held() * tight.correction == pytest.approx(1_000, rel=1e-6)
    loose = LearntRetention(LearntRetentionSettings(budget_size=math.inf))
    _feed(loose, seed=5)
    assert loose.price == 0.0
    assert loose.hold("tenant", ("tenant", TurnShape(0).bucket())).retention_s >= first.retention_s


def test_until_a_tenant_has_enough_returns_the_answer_is_the_fallback_ttl():
    policy = LearntRetention(LearntRetentionSettings(fallback_s=480.0, min_returns=20))
    hold, group = policy.arrived("t", None, 0, 0.0)
    assert (hold.retention_s, hold.learnt) == (480.0, False)
    policy.finished("c", "t", group, 10, hold.retention_s, 1.0)
    hold, _ = policy.arrived("t", "c", 1, 5.0)
    assert not hold.learnt  # one return is not enough


def test_holds_are_bin_edges_plus_the_margin_or_nothing():
    policy = LearntRetention(LearntRetentionSettings(budget_size=500, margin_s=5.0))
    for hold in _feed(policy, seed=9):
        if hold.learnt:
            assert hold.retention_s == 0.0 or hold.retention_s - 5.0 in DEFAULT_EDGES_S


@given(st.lists(st.tuples(st.integers(0, 5), st.floats(0.0, 50.0), st.sampled_from(("finish", "return")),
                          st.integers(1, 9), st.sampled_from((0.0, 10.0, 40.0, math.inf))), max_size=40))
@settings(max_examples=200, deadline=None)
def test_the_ledger_holds_what_a_direct_count_holds(steps):
    """What the policy believes D holds: each finished turn's size from its finish until its conversation
    returns, a later finish replaces it, or its hold ends; checked against a count from scratch."""
    policy = LearntRetention(LearntRetentionSettings(min_returns=1))
    now, held = 0.0, {}  # key -> (size, ends at)
    for key, dt, kind, size, retention_s in steps:
        now += dt
        if kind == "finish":
            policy.finished(key, "t", "g", size, retention_s, now)
            held[key] = (size, now + retention_s)
            if not retention_s > 0:
                del held[key]
        else:
            policy.arrived("t", key, 1, now)
            held.pop(key, None)
        policy._ledger_advance(now)
        direct = sum(size for size, ends in held.values() if ends > now)
        assert policy.held_now() == pytest.approx(direct)


@pytest.mark.parametrize("field, value", [("budget_size", 0), ("fallback_s", -1.0), ("margin_s", math.inf),
                                          ("min_returns", 0), ("window_turns", 1.5), ("refresh_interval_s", 0.0)])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        LearntRetentionSettings(**{field: value})


def test_bad_edges_are_refused():
    for edges in ((), (10.0, 5.0), (0.0, 10.0), (10.0, math.inf)):
        with pytest.raises(ValueError, match="edges_s"):
            ReturnEstimator(edges)
