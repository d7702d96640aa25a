"""The prefill node's engine loop on a toy profile whose times are exact binary fractions: which turns
share a step, when a step starts, what each record says. Expected times are worked out by hand."""

from __future__ import annotations

import simpy

from impl.policy import FixedThreshold
from sim.engine.instant import after
from sim.engine.prefill import PrefillNode
from sim.engine.records import TurnRecord

PULL_S, OVERHEAD_S = 0.5, 0.25


class _Profile:
    """A step costs 1/1024 s per new token; a pull takes PULL_S, then OVERHEAD_S of reuse overhead."""

    block_size = 16

    def prefill_step_s(self, chunks):
        return sum(n for n, _ in chunks) / 1024

    def transfer_bytes(self, tokens):
        return float(tokens)

    def blocks_for(self, tokens):
        return -(-tokens // self.block_size)

    def transfer_fixed_s(self, blocks):
        return 0.0

    def reuse_overhead_s(self, tokens):
        return OVERHEAD_S if tokens else 0.0

    def pull_hidden_s(self):
        return 0.0


class _Interconnect:
    def __init__(self, env):
        self.env = env

    def start(self, src, dst, nbytes, fixed_s, on_done):
        after(self.env, PULL_S, lambda _e: on_done(PULL_S))


class _Decode:
    name = "d0"

    def __init__(self, env):
        self.env = env
        self.reads = []

    def begin_read(self, key, now):
        self.reads.append(("begin", now))
        return ""

    def end_read(self, key):
        self.reads.append(("end", self.env.now))


def _node(budget=4096):
    env = simpy.Environment()
    node = PrefillNode(env, "p0", _Profile(), FixedThreshold(0), _Interconnect(env), budget, 0, False)
    return env, node


def _serve(node, prompt, done_at, remote=None, turn=0):
    rec = TurnRecord("c", turn, "t", prompt, 1, node.env.now)
    node.serve(rec, ("t", f"c{prompt}"), 0, 0, remote, None, lambda: done_at.setdefault(rec.prompt_tokens, node.env.now))
    return rec


def test_turns_queued_at_one_instant_share_the_first_step():
    env, node = _node()
    done = {}
    a, b = _serve(node, 512, done), _serve(node, 256, done)
    env.run()
    assert done == {512: 0.75, 256: 0.75}  # (512 + 256) / 1024 s
    assert a.prefill_compute_s == b.prefill_compute_s == 0.75 and a.p_queue_s == b.p_queue_s == 0
    assert node.busy_s == 0.75 and node.queued_tokens == 0


def test_a_turn_arriving_mid_step_waits_for_the_next_step():
    env, node = _node()
    done = {}
    a = _serve(node, 1024, done)
    after(env, 0.25, lambda _e: late.append(_serve(node, 512, done)))
    late: list[TurnRecord] = []
    env.run()
    assert done == {1024: 1.0, 512: 1.5}
    assert a.p_queue_s == 0 and late[0].p_queue_s == 0.75 and late[0].prefill_compute_s == 0.5


def test_a_prompt_over_the_token_budget_is_chunked_and_a_short_one_joins_its_last_chunk():
    env, node = _node(budget=1024)
    done = {}
    long, short = _serve(node, 1536, done), _serve(node, 128, done)
    env.run()
    # step 1: 1024 tokens of the long prompt; step 2: its last 512 and the short one (640 tokens)
    assert done == {1536: 1.625, 128: 1.625}
    assert long.prefill_compute_s == 1.625 and short.p_queue_s == 1.0 and short.prefill_compute_s == 0.625


def test_a_pulled_turn_computes_what_it_did_not_pull_once_pull_and_overhead_are_over():
    env, node = _node()
    d = _Decode(env)
    done = {}
    rec = _serve(node, 1040, done, remote=(d, 1024, 0, 1000), turn=1)
    env.run()
    assert (rec.decision, rec.pulled_tokens, rec.reused_tokens, rec.recomputed_tokens) == ("pull", 1024, 1024, 16)
    assert d.reads == [("begin", 0), ("end", PULL_S)]
    assert (rec.d2p_transfer_s, rec.reuse_overhead_s, rec.p_queue_s) == (PULL_S, OVERHEAD_S, 0.0)
    assert rec.prefill_compute_s == 16 / 1024 and done == {1040: 0.75 + 16 / 1024}


def test_a_turn_due_at_the_instant_a_pulled_turn_is_ready_joins_its_step():
    # the pull ends at 0.5, its overhead at 0.75; a second turn is sent at 0.75 by a timer set after the
    # overhead's: simpy runs the overhead's timer first, and the second turn still makes the same step
    env, node = _node()
    d = _Decode(env)
    done = {}
    pulled = _serve(node, 1040, done, remote=(d, 1024, 0, 1000), turn=1)
    sent: list[TurnRecord] = []
    after(env, PULL_S, lambda _e: after(env, OVERHEAD_S, lambda _e: sent.append(_serve(node, 512, done))))
    env.run()
    step_s = (16 + 512) / 1024
    assert pulled.prefill_compute_s == sent[0].prefill_compute_s == step_s
    assert done == {1040: 0.75 + step_s, 512: 0.75 + step_s}
