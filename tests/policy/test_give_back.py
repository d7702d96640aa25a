"""The give-back protocol (impl.policy.give_back): a read never overlaps a free.

The harness plays D (a GiveBackLedger: renewals when the router asks, pressure withholding what
``releases`` names, freeing only what ``due`` says), the router (it gets D's published expiries over a
network that delays, drops and reorders them, and keeps the last one it received) and P (it reads
only while ``now_P < usable_until(seen, margin)``, vLLM's rule, on a clock off from D's by up to
``clock_error_s``; a read lasts up to ``margin - clock_error_s``, the assumption vLLM's 5 s margin
makes). Whatever hypothesis draws, every read must end before its entry is freed.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings, strategies as st

from impl.policy import GiveBack, GiveBackLedger, RetainedPool, releases
from impl.policy.store import usable_until

RULES = GiveBack(publish_window_s=15.0, headroom_fraction=0.1, expiry_margin_s=5.0)
KEYS = st.integers(0, 2)  # few keys, so finishes, asks, pressure and reads meet on the same entries

op = st.one_of(
    st.tuples(st.just("finish"), KEYS, st.integers(1, 50), st.sampled_from([1.0, 20.0, 60.0, 480.0, math.inf])),
    st.tuples(st.just("advance"), st.floats(0.0, 25.0)),
    st.tuples(st.just("pressure"), st.integers(0, 120)),
    st.tuples(st.just("ask"), KEYS),  # the router asks D to renew before it sends a turn to P
    st.tuples(st.just("heartbeat"), KEYS, st.floats(0.0, 600.0)),  # a lease's heartbeat moves the intended expiry
    # a read: the key, P's clock error (fraction of the bound), the read's length (fraction of what is left)
    st.tuples(st.just("read"), KEYS, st.floats(-1.0, 1.0), st.floats(0.0, 1.0)),
    # the adversarial read: P's clock as far behind as allowed, starting at the last instant P accepts, for
    # as long as a read may last (it ends at the very expiry P was given)
    st.tuples(st.just("edge_read"), KEYS, st.floats(1e-6, 1e-3)),
    # a published expiry's trip to the router: delay, or lost
    st.tuples(st.just("network"), st.floats(0.0, 40.0), st.booleans()),
)


class Deployment:
    def __init__(self, clock_error_s: float) -> None:
        self.now = 0.0
        self.d = GiveBackLedger(RULES)
        self.clock_error_s = clock_error_s
        self.in_flight: list[tuple[float, object, float]] = []  # (arrives at, key, expiry)
        self.router: dict[object, float] = {}  # key -> the last expiry it received
        self.generation: dict[object, int] = {}  # key -> how many times it was retained
        self.freed_at: dict[tuple[object, int], float] = {}  # (key, generation) -> when D freed it
        self.reads: list[tuple[object, int, float, float]] = []  # (key, generation, start, end) on D's clock
        self.delay_s, self.lose = 0.0, False

    def send(self, key: object, expiry: float) -> None:
        if not self.lose:
            self.in_flight.append((self.now + self.delay_s, key, expiry))

    def finish(self, key: object, blocks: int, ttl: float) -> None:
        if key in self.d:
            return  # one retained turn per key at a time (the next turn takes it first)
        self.generation[key] = self.generation.get(key, 0) + 1
        self.router.pop(key, None)  # the router's entry is replaced by the new turn's
        self.send(key, self.d.add(key, blocks, self.now, self.now + ttl))

    def advance(self, dt: float) -> None:
        end = self.now + dt
        while True:
            # D's and the network's events in time order: frees when due, deliveries to the router
            nxt = min([end] + [t for t, _, _ in self.in_flight] + [self.d.free_at(k) for k in self._held()])
            self.now = max(self.now, nxt)
            for key in self.d.due(self.now):
                self.d.remove(key)
                self.freed_at[(key, self.generation[key])] = self.now
            arrived = [m for m in self.in_flight if m[0] <= self.now]
            self.in_flight = [m for m in self.in_flight if m[0] > self.now]
            for _, key, expiry in arrived:
                self.router[key] = expiry  # the last received: a reordered or stale one included
            if self.now >= end:
                return

    def ask(self, key: object) -> None:
        expiry = self.d.renew(key, self.now)
        if expiry is not None:
            self.send(key, expiry)

    def edge_read(self, key: object, early_s: float) -> None:
        seen = self.router.get(key)
        if seen is None:
            return
        start = usable_until(seen, RULES.expiry_margin_s) + self.clock_error_s - early_s
        if start > self.now:
            self.advance(start - self.now)
        self.read(key, -1.0, 1.0)

    def _held(self):
        return [k for k in range(3) if k in self.d]

    def read(self, key: object, error_fraction: float, length_fraction: float) -> None:
        seen = self.router.get(key)
        if seen is None:
            return
        p_now = self.now + error_fraction * self.clock_error_s
        if p_now >= usable_until(seen, RULES.expiry_margin_s):
            return  # P declines
        length = length_fraction * (RULES.expiry_margin_s - self.clock_error_s)
        self.reads.append((key, self.generation[key], self.now, self.now + length))
        assert key in self.d, f"P read {key!r} at {self.now} after D freed it"


@settings(max_examples=400, deadline=None)
@given(ops=st.lists(op, max_size=40), clock_error_fraction=st.floats(0.0, 0.99))
# the cases a wrong rule breaks first: a lapsing entry read at the last instant P accepts, after the
# expiry it was published with (freeing before it) or after the router asked again (renewing it)
@example(ops=[("finish", 0, 10, 480.0), ("advance", 1.0), ("pressure", 5), ("edge_read", 0, 1e-4)],
         clock_error_fraction=0.5)
@example(ops=[("finish", 0, 10, 480.0), ("advance", 1.0), ("pressure", 5), ("advance", 10.0), ("ask", 0),
              ("advance", 0.1), ("edge_read", 0, 1e-4)], clock_error_fraction=0.5)
def test_a_read_never_overlaps_a_free_and_memory_given_back_is_back_within_a_window(ops, clock_error_fraction):
    dep = Deployment(clock_error_fraction * RULES.expiry_margin_s)
    withheld: dict[tuple[object, int], float] = {}
    for o in ops:
        kind = o[0]
        if kind == "finish":
            dep.finish(*o[1:])
        elif kind == "advance":
            dep.advance(o[1])
        elif kind == "pressure":
            for key in dep.d.withhold_for(o[1], dep.now):
                withheld[(key, dep.generation[key])] = dep.now
        elif kind == "read":
            dep.read(*o[1:])
        elif kind == "edge_read":
            dep.edge_read(*o[1:])
        elif kind == "ask":
            dep.ask(o[1])
        elif kind == "heartbeat":
            dep.d.extend(o[1], dep.now + o[2])
        else:
            dep.delay_s, dep.lose = o[1], o[2]
    dep.d.withhold_for(10**9, dep.now)  # then give everything back: it all frees within a window
    dep.advance(RULES.publish_window_s)
    assert dep.d.lapsing_blocks == 0 and len(dep.d) == 0
    for key, generation, start, end in dep.reads:
        freed = dep.freed_at[(key, generation)]
        assert end < freed, (key, generation, start, end, freed)
    # and what was given back came back within one window of being asked for
    for entry, at in withheld.items():
        assert dep.freed_at[entry] <= at + RULES.publish_window_s, (entry, at, dep.freed_at[entry])


def test_renewed_on_use_given_back_at_the_last_published_expiry_or_at_once_when_idle():
    d = GiveBackLedger(RULES)
    assert d.add("a", 10, finished_at=3.0, intended_expiry=3.0 + 480.0) == 18.0  # finish + window, not the TTL
    assert d.add("idle", 10, finished_at=3.0, intended_expiry=3.0 + 480.0) == 18.0
    # the router asks before each turn: the window moves up from then, far enough that P does not decline
    assert d.renew("a", 40.0) == 55.0
    assert usable_until(d.renew("a", 41.0), RULES.expiry_margin_s) > 41.0 + (RULES.publish_window_s - 2 * RULES.expiry_margin_s)
    assert d.withhold_for(15, now=47.0) == ["a", "idle"] and d.is_lapsing("a")
    assert d.renew("a", 50.0) is None  # nothing more is published for it
    # the one renewed lately is back at its last published expiry, within one window of being asked for;
    # the idle one (its only published expiry long past) at once
    assert d.free_at("a") == 56.0 and 56.0 - 47.0 <= RULES.publish_window_s
    assert d.free_at("idle") == 47.0 and d.due(47.0) == ["idle"] and d.due(56.0) == ["a", "idle"]


def test_renewal_never_publishes_beyond_the_intended_expiry():
    d = GiveBackLedger(RULES)
    assert d.add("short", 4, finished_at=0.0, intended_expiry=12.0) == 12.0
    assert d.renew("short", 10.0) == 12.0
    assert d.free_at("short") == 12.0
    d.extend("short", 100.0)  # a lease's heartbeat
    assert d.renew("short", 11.0) == 26.0 and d.free_at("short") == 100.0


def test_releases_follow_the_pressure_order_and_skip_what_is_already_lapsing():
    pool = RetainedPool()
    for key, blocks, expiry in (("late", 10, 900.0), ("soon", 10, 100.0), ("mid", 30, 500.0)):
        pool.add(key, blocks, expiry)
    assert releases(pool, 15) == ["soon", "mid"]
    assert releases(pool, 15, lapsing={"soon"}) == ["mid"]
    assert releases(pool, 1000) == ["soon", "mid", "late"]  # all of them when even all fall short
    assert releases(pool, 0) == []


@pytest.mark.parametrize("kwargs, names", [
    ({"publish_window_s": 5.0}, "publish_window_s must exceed the expiry margin"),
    ({"headroom_fraction": 1.0}, "headroom_fraction must be in [0, 1)"),
    ({"publish_window_s": math.inf}, "publish_window_s must be a finite"),
])
def test_settings_that_would_break_the_protocol_are_refused_by_name(kwargs, names):
    with pytest.raises(ValueError, match=names.replace("[", r"\[").replace(")", r"\)")):
        GiveBack(**kwargs)
