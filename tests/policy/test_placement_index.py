"""LeastLoadedIndex picks what LeastLoaded.pick picks over the same loads, rng draws included."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, strategies as st

from impl.policy import InstanceLoad, LeastLoaded, LeastLoadedIndex, PlacementRequest

NAMES = [f"n{i}" for i in range(6)]
# few distinct values, so ties (and the rng draw that breaks them) are common
load = st.builds(InstanceLoad, name=st.sampled_from(NAMES), healthy=st.booleans(),
                 queued_prefill_tokens=st.integers(0, 2), used_blocks=st.integers(0, 3),
                 running_requests=st.integers(0, 2), total_blocks=st.sampled_from([3, 6]))


@given(size=st.integers(1, 6), changes=st.lists(load, max_size=40), seed=st.integers(0, 2**32 - 1))
def test_index_picks_what_the_list_policy_picks_after_every_change(size, changes, seed):
    current = {name: InstanceLoad(name) for name in NAMES[:size]}
    index = LeastLoadedIndex(list(current.values()))
    rng_index, rng_list = random.Random(seed), random.Random(seed)
    for change in changes:
        if change.name not in current:
            continue
        current[change.name] = change
        if change.healthy and change.running_requests % 2:  # both ways in, interleaved
            index.update_load(change.name, queued_prefill_tokens=change.queued_prefill_tokens,
                              running_requests=change.running_requests, used_blocks=change.used_blocks,
                              total_blocks=change.total_blocks)
        else:
            index.update(change)
        expected = LeastLoaded().pick(list(current.values()), PlacementRequest(1), rng_list)
        assert index.pick(rng_index) == expected
        assert rng_index.getstate() == rng_list.getstate()  # the same draws, so later picks agree too


def test_ties_are_broken_among_the_tied_instances_in_their_order():
    loads = [InstanceLoad("a", queued_prefill_tokens=5), InstanceLoad("b"), InstanceLoad("c", healthy=False),
             InstanceLoad("d")]
    index = LeastLoadedIndex(loads)
    picks = {index.pick(random.Random(seed)) for seed in range(50)}
    assert picks == {"b", "d"}


def test_no_healthy_instance_picks_none():
    index = LeastLoadedIndex([InstanceLoad("a")])
    index.update(InstanceLoad("a", healthy=False))
    assert index.pick(random.Random(0)) is None


def test_update_load_refuses_what_an_instance_load_refuses():
    index = LeastLoadedIndex([InstanceLoad("a")])
    with pytest.raises(ValueError, match="total_blocks must be >= 1"):
        index.update_load("a", total_blocks=0)


def test_duplicate_names_are_refused():
    with pytest.raises(ValueError, match="unique"):
        LeastLoadedIndex([InstanceLoad("a"), InstanceLoad("a")])
