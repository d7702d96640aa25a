"""sim.instant's queue entries keep simpy's order: a callback put on the queue with ``after`` or
``call_soon`` runs exactly where a Timeout or a process started at that moment would."""

from __future__ import annotations

import pytest
import simpy

from sim.instant import after, call_soon, nothing_due_now, succeed_now


def test_after_runs_where_a_timeout_made_at_the_same_moment_runs():
    env, order = simpy.Environment(), []
    # equal times everywhere: only the sequence of scheduling separates them
    for i in range(6):
        if i % 2:
            after(env, 1.0, lambda _e, i=i: order.append(i))
        else:
            env.timeout(1.0).callbacks.append(lambda _e, i=i: order.append(i))
    after(env, 0.5, lambda _e: order.append("early"))
    env.run()
    assert order == ["early", 0, 1, 2, 3, 4, 5]
    assert env.now == 1.0


def test_call_soon_runs_before_normal_events_due_now_like_a_new_process():
    env, order = simpy.Environment(), []

    def process():
        order.append("process")
        yield env.timeout(0)

    def at_one(_e):
        env.timeout(0).callbacks.append(lambda _e: order.append("timeout"))
        call_soon(env, lambda _e: order.append("call_soon"))
        env.process(process())

    after(env, 1.0, at_one)
    env.run()
    assert order == ["call_soon", "process", "timeout"]


def test_negative_delay_is_refused():
    with pytest.raises(ValueError, match="negative delay"):
        after(simpy.Environment(), -1.0, lambda _e: None)


def test_succeed_now_processes_on_the_spot_only_when_nothing_else_is_due():
    env, order = simpy.Environment(), []

    def at_one(_e):
        quiet = env.event()
        quiet.callbacks.append(lambda _e: order.append("quiet"))
        assert nothing_due_now(env)
        succeed_now(env, quiet)  # nothing due now: processed at once
        order.append("after quiet")
        env.timeout(0).callbacks.append(lambda _e: order.append("due"))
        busy = env.event()
        busy.callbacks.append(lambda _e: order.append("busy"))
        assert not nothing_due_now(env)
        succeed_now(env, busy)  # something is due now: queued behind it
        order.append("after busy")

    after(env, 1.0, at_one)
    env.run()
    assert order == ["quiet", "after quiet", "after busy", "due", "busy"]
