"""sim.engine.instant's queue entries keep simpy's order: a callback put on the queue with ``after`` or
``call_soon`` runs exactly where a Timeout or a process started at that moment would."""

from __future__ import annotations

import pytest
import simpy

from sim.engine.instant import after, call_soon, nothing_due_now, run, succeed_now


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


def _world(log: list) -> simpy.Environment:
    """Processes, timeouts at shared instants and a plain callback: an order for run() to keep."""
    env = simpy.Environment()

    def worker(name: str, delays: list[float]):
        for d in delays:
            yield env.timeout(d)
            log.append((env.now, name))

    env.process(worker("a", [1, 1, 0, 2.5]))
    env.process(worker("b", [1, 0, 1, 1]))
    after(env, 2, lambda _t: log.append((env.now, "timer")))
    return env


def test_run_keeps_simpys_order_and_its_until():
    for until in (None, 2, 3.5, 100):
        by_simpy, by_us, progress = [], [], []
        env = _world(by_simpy)
        env.run(until=until)
        ours = _world(by_us)
        run(ours, until, progress=progress.append, every=2)
        assert by_us == by_simpy
        assert ours.now == env.now
        assert progress and progress == sorted(progress)  # every 2 events, on the clock


def test_run_crashes_on_a_failed_event_as_simpy_does():
    for runner in (lambda env: env.run(), lambda env: run(env)):
        env = simpy.Environment()
        env.timeout(1).callbacks.append(lambda _e: env.event().fail(KeyError("boom")))
        try:
            runner(env)
        except KeyError as exc:
            assert exc.args == ("boom",) and isinstance(exc.__cause__, KeyError)
        else:
            raise AssertionError("a failed event nobody defused must crash the run")
    with pytest.raises(ValueError):
        run(simpy.Environment(), 0)
