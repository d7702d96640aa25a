"""The router's LeastLoaded index (updated only from nodes that reported a load change) picks, at every
turn, what LeastLoaded.pick picks over every node's live load read at that moment, rng draws included."""

from __future__ import annotations

import copy

from hypothesis import given, strategies as st

from impl.policy import InstanceLoad, LeastLoaded, PlacementRequest
from sim.engine.cluster import Cluster
from tests.sim.test_invariants import PROFILE, SETTINGS, configs, conversations


def live_loads(cluster: Cluster) -> tuple[list[InstanceLoad], list[InstanceLoad]]:
    p_loads = [InstanceLoad(p.name, queued_prefill_tokens=p.queued_tokens) for p in cluster.prefill]
    d_loads = [InstanceLoad(d.name, running_requests=len(d.running), used_blocks=d.running_blocks + d.arriving_blocks,
                            retained_blocks=d.retained.blocks, total_blocks=d.capacity) for d in cluster.decode]
    return p_loads, d_loads


def watch_picks(cluster: Cluster) -> list[tuple[str, str]]:
    """Wrap the router's picks: each returns its own choice; the list collects (index pick, full poll pick)."""
    router, picks = cluster.router, []
    pick_p, pick_d = router._pick_p, router._pick_d

    def checked(pick, side, index):
        def wrapped(*args) -> str:
            rng_before = copy.deepcopy(router.rng)
            live = live_loads(cluster)[side]
            expected = LeastLoaded().pick(live, PlacementRequest(0), rng_before)  # LeastLoaded reads no request
            got = pick(*args)
            picks.append((got, expected))
            assert router.rng.getstate() == rng_before.getstate()
            # and the index held every node's live load, whether or not it changed the pick (a pool of
            # one has no index: its one node is the pick)
            if index is not None:
                assert {name: entry[:3] for name, entry in index._entry.items()} == {i.name: LeastLoaded.key(i) for i in live}
            return got
        return wrapped

    router._pick_p = checked(pick_p, 0, router._p_index)
    router._pick_d = checked(pick_d, 1, router._d_index)
    return picks


@SETTINGS
@given(cfg=configs(), convs=conversations(), nodes=st.tuples(st.integers(1, 4), st.integers(1, 4)))
def test_index_picks_what_a_full_poll_picks(cfg, convs, nodes):
    cfg.policy.placement = "least_loaded"
    cfg.topology.num_prefill, cfg.topology.num_decode = nodes
    cluster = Cluster(cfg.validate(), PROFILE)
    assert (cluster.router._p_index is not None) == (nodes[0] > 1)
    assert (cluster.router._d_index is not None) == (nodes[1] > 1)
    picks = watch_picks(cluster)
    cluster.run(convs)
    assert picks, "no turn was placed"
    assert all(got == expected for got, expected in picks), picks


def test_ties_between_idle_nodes_are_drawn_from_the_placement_rng():
    from sim.engine.config import SimConfig
    from sim.workload.model import Conversation, Turn

    cfg = SimConfig(seed=1)
    cfg.policy.placement = "least_loaded"
    cfg.topology.num_prefill = cfg.topology.num_decode = 4
    convs = [Conversation(f"c{i}", 1000.0 * i, (Turn(100, 10),)) for i in range(20)]
    cluster = Cluster(cfg.validate(), PROFILE)
    picks = watch_picks(cluster)
    result = cluster.run(convs)
    assert all(got == expected for got, expected in picks)
    # every node idle at each arrival: all four tie, so the draws spread the turns over several nodes
    assert len({r.prefill_instance for r in result.records}) > 1


def test_index_follows_admissions_of_turns_that_waited_for_blocks():
    """Small decode pools: turns wait for blocks and are admitted as finishes free some (admission
    changes D's load; admissions after a read ends are too rare here to count on)."""
    from sim.engine.config import SimConfig
    from sim.workload import load_workload

    cfg = SimConfig(seed=3)
    cfg.policy.placement = "least_loaded"
    cfg.topology.num_prefill, cfg.topology.num_decode, cfg.topology.decode_kv_blocks = 2, 3, 1500
    cfg.workload = {"kind": "synthetic", "num_conversations": 80, "arrival_rate_per_s": 2.0,
                    "inter_turn_gap_s": {"kind": "exponential", "mean": 5.0}}
    cluster = Cluster(cfg.validate(), PROFILE)
    waits = []
    for d in cluster.decode:
        released = d._released

        def counted(d=d, released=released):
            before = d.arriving_blocks
            released()
            waits.append(d.arriving_blocks - before)
        d._released = counted
    picks = watch_picks(cluster)
    cluster.run(load_workload(cfg.workload, cfg.seed))
    assert sum(1 for w in waits if w > 0) > 10  # the case under test happened
    assert all(got == expected for got, expected in picks)
