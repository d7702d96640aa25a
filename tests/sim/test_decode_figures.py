"""The decode node's running figures (sim.engine.decode): the batch's context, the blocks its next steps add and
what a leaving sequence holds, against the same figures counted sequence by sequence."""

from __future__ import annotations

import simpy
from hypothesis import given, settings, strategies as st

from calibration.profile import LatencyProfile
from sim.engine.decode import DecodeNode, _Seq

PROFILE = LatencyProfile.load("qwen3-32b@p5en-tp8")
BS = PROFILE.block_size


def blocks(tokens: int) -> int:
    return (tokens + BS - 1) // BS


def bare_node() -> DecodeNode:
    return DecodeNode(simpy.Environment(), "d0", PROFILE, capacity_blocks=10**9, max_num_seqs=10**6, retention=None,
                      bidirectional=False, prefix_caching=False, expiry_margin_s=0.0, interconnect=None,
                      on_finish=lambda *_: None)


batches = st.lists(st.tuples(st.integers(1, 5000), st.booleans()), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(batch=batches, start=st.integers(0, 10**6), taken=st.integers(0, 100), j=st.integers(1, 3 * BS + 1))
def test_block_growth_and_context_match_a_count_sequence_by_sequence(batch, start, taken, j):
    node = bare_node()
    node._steps = start
    seqs = []
    for i, (context, preempted) in enumerate(batch):
        # a preempted sequence rejoins holding room for one more token than its context
        held = blocks(context + 1) if preempted else blocks(context)
        seq = _Seq(None, ("t", f"c{i}"), 0, context, 10**6, held, lambda: None)
        node._enter(seq, node._steps)
        seqs.append((seq, context, held))
    if taken:  # the batch formed a segment (reserving the blocks of its steps) and took ``taken`` steps
        node._unstepped_extra = 0
        node._steps += taken
    now = [context + taken for _, context, _ in seqs]
    assert node._base_sum + len(seqs) * node._steps == sum(now)
    if taken:  # every sequence holds exactly its context's blocks once it has taken a step
        expected = sum(blocks(c + j) - blocks(c) for c in now)
    else:
        expected = sum(blocks(c + j) - held for (_, _, held), c in zip(seqs, now))
    assert node._crossings(j) - (0 if taken else node._unstepped_extra) == expected
    # leaving (newest first, as preemption does) gives each sequence its context and blocks back
    for seq, context, held in reversed(seqs):
        assert node.running.popitem()[1] is seq
        node._leave(seq)
        assert seq.context == context + taken
        assert seq.remaining == 10**6 - taken
        assert seq.blocks == (blocks(context + taken) if taken else held)
    assert node._base_sum == node._unstepped_extra == 0
    assert not any(node._by_phase)
