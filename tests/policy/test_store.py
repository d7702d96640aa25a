"""The conversation store against a plain reference model (hypothesis stateful) plus its contracts."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from impl.policy import ConversationEntry, ConversationStore, ItemsPrompt, MissReason, sequence_digest
from impl.policy.store import entry_bytes, usable_until

TENANTS = ["acme", "globex"]
CONVS = ["c0", "c1", "c2", "c3"]
BOUND = 3
EIGHTH = 0.125  # every time and TTL is a multiple of 1/8 s: exact in binary, so edges are exact too

# where a time step lands relative to an entry's usable end u = expires_at - margin: inside the
# purge bucket before u (the wheel must not sweep it early), exactly at u, inside the margin
# window [u, expires_at), at expiry and just past it
EDGE_OFFSETS = [-1.0, -0.5, -EIGHTH, 0.0, EIGHTH, 2.5, 4.875, 5.0, 5.125]


def entry(tokens: list[int], expires_at: float, instance: str = "d0") -> ConversationEntry:
    return ConversationEntry(instance, {"remote_num_tokens": len(tokens)}, expires_at, len(tokens), len(tokens),
                             sequence_digest(tokens))


class StoreMachine(RuleBasedStateMachine):
    """Reference: key -> (tokens, expires_at, instance) in recency order, with the rules spelled out.

    Prompts are mostly drawn from what is stored (continuations, shortened or edited copies), so hits,
    guard misses, LRU reordering of a full store and the margin window are all reached. When the store
    purges an expired entry is its own business (buckets of ``bucket_s``); a live one may only leave by
    LRU eviction, in a ``record_success`` that overfilled the store, oldest live first.
    """

    def __init__(self):
        super().__init__()
        self.now = 0.0
        self.ref: dict[tuple[str, str], tuple[list[int], float, str]] = {}  # insertion order == recency
        self.turns = 0
        self.hits = 0

    @initialize(margin=st.sampled_from([5.0, 0.0, 2.5]), bucket_s=st.sampled_from([1.0, 0.25, 7.0, 0.1]))
    def setup(self, margin, bucket_s):
        # times and TTLs are multiples of 1/8 s and so are the bucket sizes but 0.1, whose edges are
        # inexact (the purge must agree with floor(now / bucket_s) there too)
        self.margin = margin
        self.store = ConversationStore(max_entries=BOUND, expiry_margin_s=margin, bucket_s=bucket_s)

    def live(self, key) -> bool:
        return self.now < self.ref[key][1] - self.margin

    def _sync(self, may_evict: bool):
        gone = [k for k in self.ref if self.store.get(*k) is None]
        live_order = [k for k in self.ref if self.live(k)]
        evicted_live = [k for k in gone if self.live(k)]
        if not may_evict:
            assert not evicted_live, f"live entries left without an insertion: {evicted_live}"
        else:
            # at most one per insertion, only from a store at its bound, and the least recently used
            assert len(evicted_live) <= 1 and (not evicted_live or len(self.store) == BOUND), evicted_live
            assert evicted_live == live_order[: len(evicted_live)], (evicted_live, live_order)
        for k in gone:
            del self.ref[k]
        # the purge's contract: after a call at ``now``, no entry whose usable end lies in an earlier
        # bucket is left (what keeps a flood of ids from holding memory until the LRU bound)
        bucket = self.store._bucket_s
        current = math.floor(self.now / bucket)
        stale = [k for k, (_, expires_at, _) in self.ref.items()
                 if expires_at < math.inf and math.floor((expires_at - self.margin) / bucket) < current]
        assert not stale, f"expired entries left behind by the purge: {stale}"

    def _time_to(self, t: float) -> None:
        assert t >= self.now
        self.now = t

    # -- time ----------------------------------------------------------------------------------
    @rule(steps=st.integers(0, 320))
    def advance(self, steps):
        self._time_to(self.now + steps * EIGHTH)

    @precondition(lambda self: self.ref)
    @rule(data=st.data(), offset=st.sampled_from(EDGE_OFFSETS))
    def advance_to_an_edge(self, data, offset):
        key = data.draw(st.sampled_from(sorted(self.ref)))
        target = self.ref[key][1] - self.margin + offset
        if self.now <= target < math.inf:
            self._time_to(target)

    # -- turns ---------------------------------------------------------------------------------
    @rule(tenant=st.sampled_from(TENANTS), conv=st.sampled_from(CONVS), data=st.data(),
          ttl_eighths=st.one_of(st.integers(0, 960), st.none()))  # None: kept until evicted
    def succeed(self, tenant, conv, data, ttl_eighths):
        key = (tenant, conv)
        held = self.ref.get(key)
        if held is not None and data.draw(st.booleans(), label="continue the held sequence"):
            tokens = held[0] + data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=3), label="suffix")
        else:
            tokens = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=6), label="tokens")
        expires_at = math.inf if ttl_eighths is None else self.now + ttl_eighths * EIGHTH
        self.turns += 1
        instance = f"d{self.turns}"
        self.store.record_success(tenant, conv, entry(tokens, expires_at, instance), self.now)
        self.ref.pop(key, None)
        if self.now < expires_at - self.margin:
            self.ref[key] = (tokens, expires_at, instance)
            assert self.store.get(*key).decode_instance == instance  # a fresh live entry is never the one evicted
        else:
            assert self.store.get(*key) is None  # born expired: not stored, not even the old turn's entry
        self._sync(may_evict=True)

    def _prompt_for(self, key, data) -> list[int]:
        """Mostly a continuation of what ``key`` holds; else exactly it, one short, edited, another
        key's history (a foreign tenant's), or anything."""
        stored = sorted(self.ref)
        shape = data.draw(st.sampled_from(["continue"] * 3 + ["exact", "short", "edit", "other", "random"]),
                          label="shape")
        if shape == "random" or not stored:
            return data.draw(st.lists(st.integers(0, 3), max_size=9), label="prompt")
        source = key if key in self.ref and shape != "other" else data.draw(st.sampled_from(stored), label="source")
        base = list(self.ref[source][0])
        if shape in ("continue", "other"):
            return base + data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=4), label="suffix")
        if shape == "exact":
            return base
        if shape == "short":
            return base[:-1]
        i = data.draw(st.integers(0, len(base) - 1), label="edited at")
        return base[:i] + [base[i] + 1] + base[i + 1:] + [0]

    @rule(tenant=st.sampled_from(TENANTS), conv=st.sampled_from(CONVS), data=st.data())
    def lookup(self, tenant, conv, data):
        stored = sorted(self.ref)
        if stored and data.draw(st.integers(0, 3), label="look up a stored key"):
            tenant, conv = data.draw(st.sampled_from(stored), label="key")  # hits, and LRU reordering of a full store
        self._check_lookup((tenant, conv), self._prompt_for((tenant, conv), data))

    @precondition(lambda self: self.ref)
    @rule(data=st.data(), offset=st.sampled_from(EDGE_OFFSETS))
    def lookup_at_an_edge(self, data, offset):
        """Time moves onto one of a stored entry's edges (its purge bucket, usable end, margin window,
        expiry) and the conversation's next turn arrives right then."""
        key = data.draw(st.sampled_from(sorted(self.ref)), label="key")
        target = self.ref[key][1] - self.margin + offset
        if self.now <= target < math.inf:
            self._time_to(target)
        self._check_lookup(key, self._prompt_for(key, data))

    def _check_lookup(self, key, prompt):
        tenant, conv = key
        got = self.store.lookup(tenant, conv, ItemsPrompt(prompt), self.now)
        self._sync(may_evict=False)
        ref = self.ref.get(key)
        valid = ref is not None and self.live(key) and prompt[: len(ref[0])] == ref[0]
        assert got.hit == valid, (key, got, ref, prompt, self.now)
        if got.hit:
            # never expired, never foreign, always continued, always the latest turn's entry
            assert self.now < got.entry.expires_at - self.margin
            assert got.entry.held_digest == sequence_digest(prompt[: got.entry.held_len])
            assert got.entry.decode_instance == ref[2]
            self.ref[key] = self.ref.pop(key)  # a hit makes it the most recently used
            self.hits += 1
        elif ref is not None and not self.live(key):
            assert got.miss is MissReason.EXPIRED
        elif ref is not None:
            assert got.miss is MissReason.GUARD
        elif any(k[1] == conv and self.live(k) for k in self.ref):
            assert got.miss is MissReason.TENANT
        assert self.store.stats.hits == self.hits

    @rule()
    def fail_turn(self):
        """A failed turn records nothing; the entry must survive (checked by later lookups)."""

    @invariant()
    def bounded(self):
        if hasattr(self, "store"):
            assert len(self.store) <= BOUND

    @invariant()
    def books_match_the_live_entries(self):
        """What replacing, evicting and purging leave on the books is what the live entries cost, and
        the expiry wheel holds each live entry once, in the bucket of its usable end (the in-process
        store's books: the machine also drives the Redis store, tests/router/test_store_redis.py)."""
        if not isinstance(getattr(self, "store", None), ConversationStore):
            return
        live = self.store._entries
        assert self.store.bytes == sum(entry_bytes(k, e) for k, e in live.items())
        in_wheel = [(k, b) for b, bucket in self.store._wheel.items() for k in bucket]
        assert sorted(k for k, _ in in_wheel) == sorted(live)
        for k, b in in_wheel:
            until = live[k].expires_at - self.margin
            assert b == (1 << 62 if until == math.inf else math.floor(until / self.store._bucket_s))


TestStoreStateful = StoreMachine.TestCase
TestStoreStateful.settings = settings(max_examples=300, stateful_step_count=40)


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


def test_a_hit_makes_the_entry_most_recently_used():
    store = ConversationStore(max_entries=3)
    for i, conv in enumerate(["a", "b", "c"]):
        store.record_success("t", conv, entry([i], 100.0), now=float(i))
    assert store.lookup("t", "a", ItemsPrompt([0, 9]), now=4.0).hit  # "a" was the oldest; now the newest
    store.record_success("t", "d", entry([3], 100.0), now=5.0)  # one over the bound: the LRU entry goes
    assert [c for c in "abcd" if store.get("t", c) is not None] == ["a", "c", "d"]
    assert store.lookup("t", "b", ItemsPrompt([1]), now=6.0).miss is MissReason.EVICTED
    # a miss does not refresh: "c" failed the guard, stays least recent, and is the next to go
    assert store.lookup("t", "c", ItemsPrompt([7]), now=7.0).miss is MissReason.GUARD
    store.record_success("t", "e", entry([4], 100.0), now=8.0)
    assert [c for c in "acde" if store.get("t", c) is not None] == ["a", "d", "e"]


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


def test_replacing_an_entry_nobody_sized_moves_its_wheel_slot():
    """An unbounded store replaces a never-sized entry on its own path (no bytes bookkeeping): the
    wheel still holds each live entry once, in its latest bucket, and the entry still counts when read."""
    store = ConversationStore(max_entries=10)
    for turn in range(5):
        store.record_success("t", "c", entry([turn], expires_at=100.0 + 10 * turn), now=float(turn))
    assert [list(b) for b in store._wheel.values()] == [[("t", "c")]]
    assert store._bucket_of[("t", "c")] == math.floor(usable_until(140.0, store.expiry_margin_s))
    assert store.bytes == entry_bytes(("t", "c"), store.get("t", "c"))
    store.record_success("t", "c", entry([9], expires_at=200.0), now=6.0)  # sized now: the other path
    assert [list(b) for b in store._wheel.values()] == [[("t", "c")]]
    assert store.bytes == entry_bytes(("t", "c"), store.get("t", "c"))
    assert store.purge(now=1_000.0) == 1 and not store._wheel


def test_an_entry_is_offered_strictly_before_its_usable_end():
    store = ConversationStore(expiry_margin_s=5.0)
    store.record_success("t", "c", entry([1], expires_at=100.0), now=0.0)
    end = usable_until(100.0, 5.0)
    assert end == 95.0
    assert store.lookup("t", "c", ItemsPrompt([1]), now=math.nextafter(end, 0.0)).hit
    assert store.lookup("t", "c", ItemsPrompt([1]), now=end).miss is MissReason.EXPIRED
    store.record_success("t", "c", entry([1], expires_at=100.0), now=end)  # born at its end: not kept
    assert store.get("t", "c") is None


def test_a_next_turn_replaces_in_place_of_recency_and_keeps_the_tenant_count():
    store = ConversationStore(max_entries=2)
    store.record_success("t", "a", entry([1], 100.0), now=0.0)
    store.record_success("u", "b", entry([1], 100.0), now=1.0)
    store.record_success("t", "a", entry([1, 2], 200.0), now=2.0)  # a's next turn: a becomes the newest
    store.record_success("t", "c", entry([1], 100.0), now=3.0)  # over the bound: b, the oldest, goes
    assert [k for k in [("t", "a"), ("u", "b"), ("t", "c")] if store.get(*k) is not None] == [("t", "a"), ("t", "c")]
    assert store.lookup("u", "a", ItemsPrompt([1, 2]), now=4.0).miss is MissReason.TENANT
    store.forget("t", "a")
    assert store.lookup("u", "a", ItemsPrompt([1, 2]), now=4.0).miss is MissReason.UNKNOWN


@settings(max_examples=200)
@given(ops=st.lists(st.tuples(st.sampled_from(["record", "forget", "bytes"]), st.sampled_from(CONVS),
                              st.integers(0, 40), st.integers(1, 12)), max_size=40))
def test_a_store_without_a_byte_bound_counts_the_bytes_a_bounded_one_does(ops):
    """The unbounded store sizes entries only when ``bytes`` is read; what it reports is what a store
    with a (never reached) byte bound, sizing each entry as it is stored, reports."""
    lazy, eager = ConversationStore(max_entries=BOUND), ConversationStore(max_entries=BOUND, max_bytes=10**9)
    now = 0.0
    for op, conv, ttl, tokens in ops:
        now += 1.0
        for store in (lazy, eager):
            if op == "record":
                store.record_success("t", conv, entry(list(range(tokens)), now + ttl, "d" * tokens), now)
            elif op == "forget":
                store.forget("t", conv)
        if op == "bytes":
            assert lazy.bytes == eager.bytes
    assert lazy.bytes == eager.bytes == sum(entry_bytes(k, e) for k, e in eager._entries.items())


def test_validation():
    with pytest.raises(ValueError, match="max_entries"):
        ConversationStore(max_entries=0)
    with pytest.raises(ValueError, match="expiry_margin_s"):
        ConversationStore(expiry_margin_s=float("nan"))
