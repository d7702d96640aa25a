"""Trigger an event and, when nothing else is due at this instant, process it on the spot.

``event.succeed()`` queues the event; simpy processes it after everything already due at this time.
When nothing else is due now (``env.peek() > env.now``) the queue would process it next anyway, so
running its callbacks right away is the same order of everything, minus one heap round trip (a few
per simulated turn). Only safe as the last thing an event *callback* does (a timer's): from process
code the resumed process would run inside the caller's generator, before the caller's next yield.

The same rule one step further (``sim.engine.prefill._Turn.pulled``): a timer set as the very last thing
an event's processing does, when no queued entry comes before its time, is the entry the queue pops
next; moving the clock there and running its callback on the spot is the same order of everything
(the entry's sequence number is not drawn, and numbers only order entries among themselves; ``run``'s
stop event is a queued entry like any other, so no jump passes it). Each jump nests a call, so the
callback must get back to the queue before another jump.

Also the cheapest way to put a callback on simpy's queue (``after``, ``call_soon``): the same queue
entries simpy's own classes make, without their call layers.
"""

from __future__ import annotations

import heapq
import itertools
import sys
from typing import Any, Callable

import simpy
from simpy.core import StopSimulation
from simpy.events import NORMAL, URGENT, EventPriority


def process_now(event: simpy.Event) -> None:
    """What simpy's ``succeed()`` followed by the ``step()`` that pops it do, without the queue.
    The caller has checked that the queue would have processed ``event`` next."""
    event._ok = True
    event._value = None
    callbacks, event.callbacks = event.callbacks, None  # type: ignore[assignment]  # as simpy's step does
    for callback in callbacks:
        callback(event)


def succeed_now(env: simpy.Environment, event: simpy.Event) -> None:
    queue = env._queue
    if not queue or queue[0][0] > env._now:
        process_now(event)
    else:
        event.succeed()


class Timer:
    """A timer's queue entry: what ``Environment.step`` reads of a triggered Timeout (its callbacks, and
    that it succeeded), without an Event's per-instance dict. Never handed to code that waits on events.
    No ``__init__``: ``after`` fills ``callbacks`` itself (a Python call less per event)."""

    __slots__ = ("callbacks",)
    _ok = True
    _value = None
    # a tuple, not a list: nothing appends to a timer's callbacks, and the queue loop only iterates them;
    # None once popped, as an Event's (Any: under sim.native's compiled build a declared type is checked)
    callbacks: Any


def after(env: simpy.Environment, delay: float, callback: Callable[[Any], None]) -> Timer:
    """``env.timeout(delay).callbacks.append(callback)``: the same queue entry (time, priority, sequence
    number) a Timeout gets, so the same order of everything. ``callback`` is called with the returned
    entry (a caller can tell its timers apart)."""
    if delay < 0:
        raise ValueError(f"negative delay {delay}")
    timer = Timer()
    timer.callbacks = (callback,)
    heapq.heappush(env._queue, (env._now + delay, NORMAL, next(env._eid), timer))  # type: ignore[misc]
    return timer


def at(env: simpy.Environment, when: float, callback: Callable[[Any], None], timer: Timer | None = None) -> Timer:
    """``after`` at an absolute time (``now + (when - now)`` need not round back to ``when``); ``timer``:
    an entry of a subclass carrying more (its callbacks are set here)."""
    if when < env._now:
        raise ValueError(f"time {when} is in the past (now {env._now})")
    if timer is None:
        timer = Timer()
    timer.callbacks = (callback,)
    heapq.heappush(env._queue, (when, NORMAL, next(env._eid), timer))  # type: ignore[misc]
    return timer


def nothing_due_now(env: simpy.Environment) -> bool:
    """Whether no event is queued at the current instant (``env.peek() > env.now``)."""
    queue = env._queue
    return not queue or queue[0][0] > env._now


def call_soon(env: simpy.Environment, callback: Callable[[simpy.Event], None]) -> None:
    """Run ``callback`` from an urgent event at this instant: where simpy starts a process created now
    (its Initialize event), so a callback chain started here keeps a process's place in the order."""
    event = simpy.Event(env)
    event._ok = True
    event._value = None
    event.callbacks.append(callback)
    env.schedule(event, URGENT)


def run(env: simpy.Environment, until: float | None = None, progress: Callable[[float], None] | None = None,
        every: int = 4096) -> None:
    """``env.run(until)``, and ``progress(now)`` after every ``every`` events: simpy's loop with its
    ``step`` inlined (no method call per event, a few per simulated turn). The same queue, the same
    ``until`` event (an urgent one at ``until``, scheduled the way simpy's run schedules it, so the run
    stops at the same instant and after the same events), the same handling of a failed event."""
    if until is not None:
        stop_at = until if isinstance(until, int) else float(until)
        if stop_at <= env._now:
            raise ValueError(f"until ({stop_at}) must be greater than the current simulation time")
        stop = simpy.Event(env)
        stop._ok = True
        stop._value = None
        env.schedule(stop, URGENT, stop_at - env._now)
        stop.callbacks.append(StopSimulation.callback)
    try:
        if progress is None:
            _steps(env, sys.maxsize)
        else:
            while _steps(env, every):
                progress(env._now)
    except StopSimulation:
        pass


def _steps(env: simpy.Environment, limit: int) -> bool:
    """Up to ``limit`` of ``env.step()``, inlined; False once the queue is empty (where ``run`` would
    return, as simpy's does on its EmptySchedule)."""
    queue, pop = env._queue, heapq.heappop
    # a simpy Event or a Timer (Any: the compiled build would check an Event's list of callbacks)
    event: Any
    callbacks: Any
    for _ in itertools.repeat(None, limit):
        try:
            env._now, _, _, event = pop(queue)
        except IndexError:
            return False
        # as Environment.step: callbacks taken before they run (no concurrent modification), a stop
        # re-queues the callbacks it did not run, a failed event nobody defused crashes the run
        callbacks, event.callbacks = event.callbacks, None
        try:
            for callback in callbacks:
                callback(event)
        except StopSimulation:
            event.callbacks = callbacks[callbacks.index(callback) + 1:]
            env.schedule(event, EventPriority(-1))
            raise
        if not event._ok and not hasattr(event, "_defused"):
            exc = type(event._value)(*event._value.args)
            exc.__cause__ = event._value
            raise exc
    return True
