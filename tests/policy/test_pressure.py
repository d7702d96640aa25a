from __future__ import annotations

import math

from hypothesis import given, strategies as st

from impl.policy import BlockHolder, RetainedPool, choose_victims

holder_lists = st.lists(
    st.tuples(st.integers(1, 500), st.floats(min_value=0, max_value=1000, allow_nan=False), st.booleans()),
    max_size=40,
)


@given(raw=holder_lists, needed=st.integers(0, 5000), free=st.integers(0, 2000), now=st.floats(0, 1000))
def test_victims_free_enough_and_never_running(raw, needed, free, now):
    holders = [BlockHolder(i, b, math.inf if running else exp, running) for i, (b, exp, running) in enumerate(raw)]
    choice = choose_victims(holders, needed, free, now)
    by_key = {h.key: h for h in holders}
    assert all(not by_key[k].running for k in choice.victims)
    assert len(set(choice.victims)) == len(choice.victims)
    assert choice.freed_blocks == sum(by_key[k].blocks for k in choice.victims)
    reclaimable = sum(h.blocks for h in holders if not h.running)
    if free >= needed:
        assert choice.sufficient and choice.victims == ()
    elif free + reclaimable >= needed:
        assert choice.sufficient and free + choice.freed_blocks >= needed
        # minimal in its order: without the last victim it would not have been enough
        assert free + choice.freed_blocks - by_key[choice.victims[-1]].blocks < needed
    else:
        assert not choice.sufficient and choice.victims == ()


def test_victims_go_soonest_expiry_first():
    holders = [BlockHolder("late", 10, 500.0), BlockHolder("expired", 10, 50.0), BlockHolder("soon", 10, 200.0),
               BlockHolder("running", 100, math.inf, running=True)]
    assert choose_victims(holders, 25, 0, now=100.0).victims == ("expired", "soon", "late")
    assert choose_victims(holders, 15, 0, now=100.0).victims == ("expired", "soon")


@given(ops=st.lists(st.tuples(st.sampled_from(["add", "discard", "expire"]), st.integers(0, 15),
                              st.integers(1, 50), st.integers(0, 100)), max_size=80),
       needed=st.integers(0, 600), free=st.integers(0, 100))
def test_pool_agrees_with_snapshot_function(ops, needed, free):
    pool = RetainedPool()
    model: dict[int, tuple[int, float]] = {}
    for op, key, blocks, t in ops:
        if op == "add":
            pool.add(key, blocks, float(t))
            model.pop(key, None)
            model[key] = (blocks, float(t))
        elif op == "discard":
            assert pool.discard(key) == model.pop(key, (0, 0))[0]
        else:
            gone = dict(pool.pop_expired(float(t)))
            assert gone == {k: b for k, (b, exp) in model.items() if exp <= t}
            model = {k: v for k, v in model.items() if v[1] > t}
    assert pool.blocks == sum(b for b, _ in model.values())
    assert len(pool) == len(model)
    assert pool.next_expiry() == (min(e for _, e in model.values()) if model else None)
    snapshot = [BlockHolder(k, b, e) for k, (b, e) in model.items()]
    assert pool.choose_victims(needed, free) == choose_victims(snapshot, needed, free, now=0.0)
