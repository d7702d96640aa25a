from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, strategies as st

from impl.policy import FixedTTL, GapQuantileTTL, HeartbeatLease

times = st.floats(min_value=0, max_value=1e6, allow_nan=False)


@given(ttl=st.floats(min_value=0, max_value=1e5), finished=times, renewals=st.lists(times, max_size=20))
def test_fixed_ttl_never_renews(ttl, finished, renewals):
    policy = FixedTTL(ttl)
    expiry = policy.expiry_on_finish(finished)
    assert expiry == finished + ttl
    for now in sorted(renewals):
        assert policy.renew(expiry, finished, now) == expiry


@given(lease=st.floats(min_value=1, max_value=600), frac=st.floats(min_value=0.05, max_value=0.95),
       finished=times, beats=st.lists(st.floats(min_value=0, max_value=5000), min_size=1, max_size=30))
def test_lease_expiry_covers_last_renewal(lease, frac, finished, beats):
    policy = HeartbeatLease(lease_s=lease, heartbeat_interval_s=lease * frac, max_hold_s=math.inf)
    expiry = policy.expiry_on_finish(finished)
    assert expiry == finished + lease
    for offset in sorted(beats):
        now = finished + offset
        renewed = policy.renew(expiry, finished, now)
        assert renewed >= expiry  # never shortened
        if now <= expiry:
            assert renewed >= now + lease
        else:
            assert renewed == expiry  # a lapsed lease is not revived
        expiry = renewed


def test_lease_is_capped_and_idle_reclaims():
    policy = HeartbeatLease(lease_s=30, heartbeat_interval_s=10, max_hold_s=100)
    expiry = policy.expiry_on_finish(0.0)
    for now in range(10, 200, 10):
        expiry = policy.renew(expiry, 0.0, float(now))
    assert expiry == 100.0
    # no heartbeats after t=50: the blocks are gone by t=80, long before a 480 s TTL
    expiry = policy.expiry_on_finish(0.0)
    for now in range(10, 60, 10):
        expiry = policy.renew(expiry, 0.0, float(now))
    assert expiry == 80.0
    assert policy.last_heartbeat_before(0.0, 55.0) == 50.0


def test_lease_rejects_interval_not_below_lease():
    with pytest.raises(ValueError, match="heartbeat_interval_s"):
        HeartbeatLease(lease_s=10, heartbeat_interval_s=10)


def nearest_rank(window: list[float], q: float) -> float:
    """The smallest sample with at least a fraction q of the window at or below it (counted, not ranked)."""
    return min(x for x in window if sum(1 for y in window if y <= x) >= q * len(window))


WINDOW, MIN_SAMPLES = 100, 20
# quantiles where ceil(q*n) and round(q*n) part for many window lengths, plus arbitrary ones
quantiles = st.one_of(st.sampled_from([0.5, 0.75, 0.9, 0.95, 0.99, 1.0, 0.01]), st.floats(min_value=0.01, max_value=1.0))
# mostly distinct gaps (so a wrong rank shows as a wrong value), some repeated (ties)
gap_values = st.one_of(st.integers(0, 5000).map(float), st.sampled_from([0.0, 30.0, 126.0]),
                       st.floats(min_value=0, max_value=5000, allow_nan=False))


@given(n=st.one_of(st.sampled_from([MIN_SAMPLES - 1, MIN_SAMPLES, WINDOW, WINDOW + 1]),
                   st.integers(MIN_SAMPLES, 3 * WINDOW)),
       data=st.data(), q=quantiles)
def test_gap_quantile_ttl_is_clamped_quantile_of_window(n, data, q):
    """Windows of at least ``min_samples`` (the quantile branch) and beyond the window bound (old gaps leave)."""
    gaps = data.draw(st.lists(gap_values, min_size=n, max_size=n), label="gaps")
    policy = GapQuantileTTL(quantile=q, cap_s=900, floor_s=10, initial_s=480, min_samples=MIN_SAMPLES, window=WINDOW,
                            margin_s=5)
    # checked after every observation from the 19th on: the window rolls, the quantile follows
    for i, g in enumerate(gaps, start=1):
        policy.observe_gap(g)
        if i < MIN_SAMPLES - 1 or (i % 7 and i != len(gaps)):
            continue
        window = gaps[:i][-WINDOW:]
        if len(window) < MIN_SAMPLES:
            assert policy.ttl_s == 480
        else:
            assert policy.ttl_s == min(max(nearest_rank(window, q) + 5, 10), 900), (i, q)
    assert policy.renew(123.0, 0.0, 50.0) == 123.0


def test_gap_quantile_nearest_rank_is_the_ceiling():
    # 25 distinct gaps 1..25 s, q = 0.9: 0.9 x 25 = 22.5, so the nearest rank is the 23rd smallest (23 s),
    # not the 22nd that rounding would give; + 5 s margin
    policy = GapQuantileTTL(quantile=0.9, floor_s=0, min_samples=20, window=25, margin_s=5)
    for g in range(25, 0, -1):
        policy.observe_gap(float(g))
    assert policy.ttl_s == 23 + 5
    # the window keeps the 25 most recent: three short gaps push out the three oldest (25, 24, 23 s),
    # not the three smallest; the window is then 0.5 x 3 and 1..22, whose 23rd smallest is 20 s
    for _ in range(3):
        policy.observe_gap(0.5)
    assert policy.ttl_s == 20 + 5
    policy.observe_gap(0.25)  # 22 leaves; the 23rd smallest of {0.25, 0.5 x 3, 1..21} is 19
    assert policy.ttl_s == 19 + 5


def test_gap_quantile_ignores_bad_samples_and_validates():
    policy = GapQuantileTTL(min_samples=1, window=4)
    policy.observe_gap(float("nan"))
    policy.observe_gap(-3)
    assert policy.ttl_s == 480
    with pytest.raises(ValueError, match="quantile"):
        GapQuantileTTL(quantile=0)
    with pytest.raises(ValueError, match="floor_s"):
        GapQuantileTTL(floor_s=100, cap_s=50)
    with pytest.raises(ValueError, match="seconds must be"):
        FixedTTL(-1)
