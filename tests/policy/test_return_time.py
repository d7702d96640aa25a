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


def _reference_rates(turns, end, edges):
    """Returns and exposure per bin written out directly from each turn's fate, not incrementally: a turn
    is watched until its return, its drop or the end of the run; it spends a bin's whole width in every
    bin whose end it was watched past, the part up to that moment in the bin it is in then (a return
    exactly at an edge is in the next bin), and is back in that bin if it returned; a turn that passes the
    last edge is done."""
    starts = (0.0,) + tuple(edges[:-1])
    returned, exposure = [0] * len(edges), [0.0] * len(edges)
    for finish, gap, returns in turns:
        event = finish + gap
        watched_until = min(event, end)
        for j, (start, edge) in enumerate(zip(starts, edges)):
            if finish + edge <= watched_until:
                exposure[j] += edge - start
            elif finish + start <= watched_until:
                exposure[j] += watched_until - (finish + start)
                if returns and event <= end:
                    returned[j] += 1
                break
    return returned, exposure


@settings(max_examples=200, deadline=None)
@given(st.lists(turn, min_size=1, max_size=40), st.floats(0, 300, allow_nan=False))
def test_returns_and_exposure_equal_a_count_from_scratch_whatever_the_order_of_events(turns, end):
    """The estimate's statistics -- per bin, returns and the seconds turns spent there, censored ones
    included for as long as they were watched -- equal a count from each turn's whole fate."""
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
                est._censor(dropped)  # dropped from tracking: the bounded table's eviction, by hand
    est.advance(end)
    got = est.rates("group", "g")
    returned, exposure = got if got is not None else ([0.0] * len(EDGES), [0.0] * len(EDGES))
    ref_returned, ref_exposure = _reference_rates(turns, end, EDGES)
    assert [int(r) for r in returned] == ref_returned
    assert exposure == pytest.approx(ref_exposure, rel=1e-9, abs=1e-6)


def test_a_return_after_the_turn_was_dropped_is_not_counted_and_open_turns_never_bias_the_survival():
    est = ReturnEstimator(EDGES, max_open=2, prior_weight=0.0)
    est.finished("a", "t", "g", 0.0)
    est.finished("b", "t", "g", 1.0)
    est.finished("c", "t", "g", 2.0)  # table full: "a" is dropped (censored at 2 s: 2 s in bin 0)
    assert len(est) == 2 and est.censored == 1
    assert est.returned("a", 15.0) is None
    assert est.returned("b", 16.0) == pytest.approx(15.0)  # 10 s in bin 0, back 5 s into bin 1
    est.advance(1000.0)  # "c" never returns: the whole of every bin
    returned, exposure = est.rates("group", "g")
    assert returned == [0.0, 1.0, 0.0, 0.0] and exposure == pytest.approx([22.0, 15.0, 20.0, 40.0])
    # bin 1: one return in 15 s of exposure over a 10 s bin; no return elsewhere
    h = -math.expm1(-10.0 / 15.0)
    assert est.survival("t", "g") == pytest.approx([1.0, 1.0 - h, 1.0 - h, 1.0 - h])


def test_a_turn_still_waiting_counts_as_not_back_for_as_long_as_it_has_waited():
    """Counting a wide bin only for turns watched through its end would read it as all returns while
    the survivors are still inside it: here one turn returns 60 s into the 10-1000 s bin and nine wait."""
    est = ReturnEstimator((10.0, 1000.0), prior_weight=0.0)
    for k in range(10):
        est.finished(k, "t", "g", 0.0)
    est.returned(0, 70.0)
    est.advance(100.0)
    returned, exposure = est.rates("group", "g")
    assert returned == [0.0, 1.0] and exposure == pytest.approx([100.0, 60.0 + 9 * 90.0])
    assert est.survival("t", "g")[1] == pytest.approx(math.exp(-990.0 / 870.0))


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
