"""The decode node's running figures (sim.engine.decode): the batch's context, the blocks its next steps add and
what a leaving sequence holds, against the same figures counted sequence by sequence. Sequences join through
the engine loop production runs (DecodeNode._join), which keeps the join's figures inline."""

from __future__ import annotations

import simpy
from hypothesis import given, settings, strategies as st

from calibration.profile import LatencyProfile
from sim.engine.decode import DecodeNode, _Seq
from sim.engine.records import TurnRecord

PROFILE = LatencyProfile.load("qwen3-32b@p5en-tp8")
BS = PROFILE.block_size


def blocks(tokens: int) -> int:
    return (tokens + BS - 1) // BS


def bare_node() -> DecodeNode:
    return DecodeNode(simpy.Environment(), "d0", PROFILE, capacity_blocks=10**9, max_num_seqs=10**6, retention=None,
                      bidirectional=False, prefix_caching=False, expiry_margin_s=0.0, interconnect=None,
                      on_finish=lambda *_: None)


def join(node: DecodeNode, batch: list[tuple[int, bool, int]]) -> list[tuple[_Seq, int, int]]:
    """The sequences of ``batch`` ((context, preempted, remaining steps)) join the running batch the way a
    turn's KV arriving joins it (DecodeNode._join wakes the engine loop, which takes every joining sequence);
    returns (sequence, context, blocks it joined with)."""
    seqs = []
    for i, (context, preempted, remaining) in enumerate(batch):
        # a preempted sequence rejoins holding room for one more token than its context
        held = blocks(context + 1) if preempted else blocks(context)
        rec = TurnRecord(f"c{i}", 1, "t", context, remaining + 1, 0.0)
        seqs.append((_Seq(rec, ("t", f"c{i}"), 0, context, remaining, held, lambda: None), context, held))
        node.arriving_blocks += held  # allocated at admission, running once joined
    node._joining.extend(seq for seq, _, _ in seqs[:-1])
    node._join(seqs[-1][0], node._joining)
    return seqs


batches = st.lists(st.tuples(st.integers(1, 5000), st.booleans(), st.integers(1, 3 * BS + 1)), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(batch=batches, start=st.integers(0, 10**6), taken=st.integers(1, 100), j=st.integers(1, 3 * BS + 1))
def test_block_growth_and_context_match_a_count_sequence_by_sequence(batch, start, taken, j):
    node = bare_node()
    node._steps = start
    seqs = join(node, batch)
    # the joins formed a segment up to the first sequence's end, reserving what each holds after its steps
    k = min(remaining for _, _, remaining in batch)
    assert node._segment[2] == k
    assert node._base_sum + len(seqs) * node._steps == sum(context for _, context, _ in seqs)
    assert node._segment_crossings == sum(blocks(c + k) - blocks(c) for _, c, _ in seqs)
    assert node.running_blocks == sum(blocks(c + k) for _, c, _ in seqs)
    node._steps += taken  # the batch took ``taken`` steps (a segment's end adds them so)
    now = [context + taken for _, context, _ in seqs]
    assert node._base_sum + len(seqs) * node._steps == sum(now)
    assert node._crossings(j, len(node.running)) == sum(blocks(c + j) - blocks(c) for c in now)
    # preempting (the newest first) gives each sequence its context, remaining steps and blocks back, and
    # re-queues it with room for one more token
    for (seq, context, _), remaining in zip(reversed(seqs), reversed([r for _, _, r in batch])):
        assert next(reversed(node.running.values())) is seq
        node._leave(0.0, preempt=True)
        assert seq not in node.running.values()
        assert seq.context == context + taken
        assert seq.remaining == remaining - taken
        assert seq.blocks == blocks(context + taken + 1) and seq.rec.preempted == 1
    assert node.running_blocks == sum(blocks(c + k) - blocks(c + taken) for _, c, _ in seqs)  # reserved, not taken
    assert node._base_sum == node._unstepped_extra == 0
    assert not any(node._by_phase)


@settings(max_examples=100, deadline=None)
@given(batch=st.lists(st.tuples(st.integers(1, 5000), st.booleans()), min_size=1, max_size=40),
       start=st.integers(0, 10**6))
def test_a_sequence_done_when_it_joins_leaves_with_the_blocks_it_joined_with(batch, start):
    """The join finishes it at once (DecodeNode._leave, never having taken a step)."""
    node = bare_node()
    node._steps = start
    seqs = join(node, [(context, preempted, 0) for context, preempted in batch])  # one-token answers
    assert not node.running and node.running_blocks == 0
    for seq, context, held in seqs:
        assert (seq.context, seq.remaining, seq.blocks) == (context, 0, held)
        assert seq.rec.completion_s == 0.0
    assert node._base_sum == node._unstepped_extra == 0
    assert not any(node._by_phase)
