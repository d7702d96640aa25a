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


@given(gaps=st.lists(st.floats(min_value=0, max_value=5000, allow_nan=False), min_size=0, max_size=300),
       q=st.floats(min_value=0.01, max_value=1.0))
def test_gap_quantile_ttl_is_clamped_quantile_of_window(gaps, q):
    policy = GapQuantileTTL(quantile=q, cap_s=900, floor_s=10, initial_s=480, min_samples=20, window=100, margin_s=5)
    for g in gaps:
        policy.observe_gap(g)
    window = gaps[-100:]
    if len(window) < 20:
        assert policy.ttl_s == 480
    else:
        ordered = sorted(window)
        at_or_below = [x for x in ordered if sum(1 for y in ordered if y <= x) >= q * len(ordered)]
        expected = min(max(at_or_below[0] + 5, 10), 900)
        assert policy.ttl_s == pytest.approx(expected)
    assert 10 <= policy.ttl_s <= 900
    assert policy.renew(123.0, 0.0, 50.0) == 123.0


def test_gap_quantile_ignores_bad_samples_and_validates():
    policy = GapQuantileTTL(min_samples=1, window=4)
    policy.observe_gap(float("nan"))
    policy.observe_gap(-3)
    assert policy.ttl_s == 480
    with pytest.raises(ValueError, match="quantile"):
        GapQuantileTTL(quantile=0)
    with pytest.raises(ValueError, match="floor_s"):
        GapQuantileTTL(floor_s=100, cap_s=50)
    with pytest.raises(ValueError, match="decoder_kv_blocks_ttl_s"):
        FixedTTL(-1)
