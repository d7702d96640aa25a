"""The conversation store against a plain reference model (hypothesis stateful) plus its contracts."""

from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from impl.policy import ConversationEntry, ConversationStore, ItemsPrompt, MissReason, sequence_digest

TENANTS = ["acme", "globex"]
CONVS = ["c0", "c1", "c2", "c3", "c4"]
MARGIN = 5.0
BOUND = 3


def entry(tokens: list[int], expires_at: float, instance: str = "d0") -> ConversationEntry:
    return ConversationEntry(instance, {"remote_num_tokens": len(tokens)}, expires_at, len(tokens), len(tokens),
                             sequence_digest(tokens))


class StoreMachine(RuleBasedStateMachine):
    """Reference: key -> (tokens, expires_at) in recency order, with the rules spelled out.

    When the store purges is its own business (one-second buckets), so the reference drops an
    expired key whenever the store has; a live key may only leave by LRU eviction, oldest live first.
    """

    def __init__(self):
        super().__init__()
        self.store = ConversationStore(max_entries=BOUND, expiry_margin_s=MARGIN)
        self.now = 0.0
        self.ref: dict[tuple[str, str], tuple[list[int], float]] = {}  # insertion order == recency order

    def live(self, key) -> bool:
        return self.now < self.ref[key][1] - MARGIN

    def _touch(self, key):
        self.ref[key] = self.ref.pop(key)

    def _sync(self):
        gone = [k for k in self.ref if self.store.get(*k) is None]
        live_order = [k for k in self.ref if self.live(k)]
        evicted_live = [k for k in gone if self.live(k)]
        # live keys leave only by LRU: exactly the oldest live ones
        assert evicted_live == live_order[: len(evicted_live)], (evicted_live, live_order)
        for k in gone:
            del self.ref[k]

    @rule(dt=st.floats(min_value=0, max_value=40))
    def advance(self, dt):
        self.now += dt

    @rule(tenant=st.sampled_from(TENANTS), conv=st.sampled_from(CONVS),
          tokens=st.lists(st.integers(0, 3), min_size=1, max_size=6), ttl=st.floats(min_value=0, max_value=60))
    def succeed(self, tenant, conv, tokens, ttl):
        key = (tenant, conv)
        self.store.record_success(tenant, conv, entry(tokens, self.now + ttl), self.now)
        self.ref.pop(key, None)
        if self.now < self.now + ttl - MARGIN:
            self.ref[key] = (tokens, self.now + ttl)
            assert self.store.get(*key) is not None  # a fresh live entry is never the one evicted
        self._sync()

    @rule(tenant=st.sampled_from(TENANTS), conv=st.sampled_from(CONVS),
          prompt=st.lists(st.integers(0, 3), max_size=9))
    def lookup(self, tenant, conv, prompt):
        key = (tenant, conv)
        got = self.store.lookup(tenant, conv, ItemsPrompt(prompt), self.now)
        self._sync()
        ref = self.ref.get(key)
        valid = ref is not None and self.live(key) and prompt[: len(ref[0])] == ref[0]
        assert got.hit == valid, (key, got, ref, prompt)
        if got.hit:
            # never expired, never foreign, always continued
            assert self.now < got.entry.expires_at - MARGIN
            assert got.entry.held_digest == sequence_digest(prompt[: got.entry.held_len])
            self._touch(key)
        elif ref is not None and not self.live(key):
            assert got.miss is MissReason.EXPIRED
        elif ref is not None:
            assert got.miss is MissReason.GUARD
        elif any(k[1] == conv and self.live(k) for k in self.ref):
            assert got.miss is MissReason.TENANT

    @rule()
    def fail_turn(self):
        """A failed turn records nothing; the entry must survive (checked by later lookups)."""

    @invariant()
    def bounded(self):
        assert len(self.store) <= BOUND


TestStoreStateful = StoreMachine.TestCase
TestStoreStateful.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_failed_turn_keeps_entry_and_success_replaces():
    store = ConversationStore()
    store.record_success("t", "c", entry([1, 2, 3], 100.0, "d0"), now=0.0)
    first = store.lookup("t", "c", ItemsPrompt([1, 2, 3, 4]), now=10.0)
    assert first.hit
    # the turn failed downstream: nothing recorded; the next try still hits
    assert store.lookup("t", "c", ItemsPrompt([1, 2, 3, 4]), now=11.0).hit
    store.record_success("t", "c", entry([1, 2, 3, 4, 5], 120.0, "d1"), now=12.0)
    again = store.lookup("t", "c", ItemsPrompt([1, 2, 3, 4, 5, 6]), now=13.0)
    assert again.entry.decode_instance == "d1"


def test_miss_reasons():
    store = ConversationStore(max_entries=1, expiry_margin_s=5)
    store.record_success("a", "c", entry([1], 100.0), now=0.0)
    assert store.lookup("b", "c", ItemsPrompt([1]), now=1.0).miss is MissReason.TENANT
    assert store.lookup("a", "c", ItemsPrompt([2]), now=1.0).miss is MissReason.GUARD
    assert store.lookup("a", "c", ItemsPrompt([1]), now=95.0).miss is MissReason.EXPIRED
    assert store.lookup("a", "zz", ItemsPrompt([1]), now=1.0).miss is MissReason.UNKNOWN
    store.record_success("a", "c", entry([1], 100.0), now=2.0)
    store.record_success("a", "d", entry([1], 100.0), now=3.0)
    assert store.lookup("a", "c", ItemsPrompt([1]), now=4.0).miss is MissReason.EVICTED
    assert store.stats.misses[MissReason.EVICTED] == 1


def test_flood_of_ids_stays_bounded_and_purges():
    store = ConversationStore(max_entries=1000)
    for i in range(20_000):
        store.record_success("t", f"id{i}", entry([i], expires_at=i * 0.01 + 30.0), now=i * 0.01)
    assert len(store) == 1000
    assert sum(len(b) for b in store._wheel.values()) == 1000  # the expiry wheel holds only live entries
    store.purge(now=10_000.0)
    assert len(store) == 0 and not store._wheel


def test_validation():
    with pytest.raises(ValueError, match="max_entries"):
        ConversationStore(max_entries=0)
    with pytest.raises(ValueError, match="expiry_margin_s"):
        ConversationStore(expiry_margin_s=float("nan"))
