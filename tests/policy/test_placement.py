from __future__ import annotations

import random

from hypothesis import given, strategies as st

from impl.policy import InstanceLoad, KVAwareCost, LeastLoaded, PlacementRequest, RoundRobin

loads = st.lists(st.builds(InstanceLoad, name=st.text(min_size=1, max_size=3), healthy=st.booleans(),
                           queued_prefill_tokens=st.integers(0, 10_000), used_blocks=st.integers(0, 100),
                           total_blocks=st.just(100)), max_size=6, unique_by=lambda i: i.name)


@given(instances=loads, seed=st.integers(0, 2**32 - 1), prompt=st.integers(0, 5000))
def test_every_policy_picks_a_healthy_instance_or_none(instances, seed, prompt):
    request = PlacementRequest(prompt, {i.name: prompt // 2 for i in instances[:1]})
    healthy = {i.name for i in instances if i.healthy}
    for policy in (RoundRobin(), LeastLoaded(), KVAwareCost()):
        picked = policy.pick(instances, request, random.Random(seed))
        assert (picked in healthy) if healthy else picked is None


@given(instance=st.builds(InstanceLoad, name=st.text(min_size=1, max_size=3), queued_prefill_tokens=st.integers(0, 10_000),
                          running_requests=st.integers(0, 50), used_blocks=st.integers(0, 100), total_blocks=st.just(100)),
       seed=st.integers(0, 2**32 - 1), prompt=st.integers(0, 5000), repeats=st.integers(1, 3))
def test_a_pool_of_one_healthy_instance_is_picked_without_drawing_from_rng(instance, seed, prompt, repeats):
    """What lets the simulator's router skip placement for a pool of one (sim/engine/router.py): every policy
    picks the instance, every time, and leaves ``rng`` as it was."""
    request = PlacementRequest(prompt, {instance.name: prompt // 2}, prompt // 3, prompt // 16)
    for policy in (RoundRobin(), LeastLoaded(), KVAwareCost()):
        rng = random.Random(seed)
        state = rng.getstate()
        assert [policy.pick([instance], request, rng) for _ in range(repeats)] == [instance.name] * repeats
        assert rng.getstate() == state


def test_round_robin_cycles_and_skips_dead():
    rr = RoundRobin()
    insts = [InstanceLoad("a"), InstanceLoad("b", healthy=False), InstanceLoad("c")]
    rng = random.Random(0)
    assert [rr.pick(insts, PlacementRequest(1), rng) for _ in range(4)] == ["a", "c", "a", "c"]


def test_kv_aware_prefers_cached_instance_unless_much_busier():
    req = PlacementRequest(8000, cached_tokens={"p1": 7000})
    rng = random.Random(0)
    quiet = [InstanceLoad("p0"), InstanceLoad("p1", queued_prefill_tokens=2000)]
    assert KVAwareCost().pick(quiet, req, rng) == "p1"  # 1000 + 2000 < 8000
    swamped = [InstanceLoad("p0"), InstanceLoad("p1", queued_prefill_tokens=20_000)]
    assert KVAwareCost().pick(swamped, req, rng) == "p0"
    assert LeastLoaded().pick(quiet, req, rng) == "p0"


def test_ties_use_the_given_rng_deterministically():
    insts = [InstanceLoad(n) for n in "abcd"]
    picks = [LeastLoaded().pick(insts, PlacementRequest(1), random.Random(7)) for _ in range(5)]
    assert len(set(picks)) == 1
