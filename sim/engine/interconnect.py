"""The interconnect: per-node NICs shared fairly by concurrent KV transfers, both directions alike.

A transfer first pays its fixed part (setup + per-descriptor work, from the profile), then moves its
bytes as a flow. A flow's rate is the smallest of: the per-transfer rate the profile measured (one
transfer alone is setup/overhead bound, not wire bound: see calibration/README.md), and an equal share
of each endpoint NIC's usable capacity (line rate x efficiency). P->D and D->P flows use the same NICs
and contend. Rates change only when a flow starts or ends on one of a flow's two NICs (processor
sharing), so the cost is per transfer, not per byte, and a flow elsewhere costs nothing.

Events: most transfers meet no other on their NICs. A transfer is *alone* while no other moves on
its NICs during its own *window* (from the end of its fixed part to ``(start + fixed) + bytes /
rate``, its end at the rate of a flow alone): then its end is known when it is started and is its one
event. A transfer whose window meets a neighbour's is *shared*, and so is every alone flow on a
shared flow's NICs that is not over before that flow moves (a shared flow's end is open). A shared
flow's start is an event (it may change its neighbours' rates), and each start or end re-rates only
the moving flows on the two NICs it touches. A flow's timer never fires late: when a flow slows
down its timer stays and, firing early, moves to the new end; only a speed-up (a neighbour's end)
sets an earlier timer, leaving the old one to fire as a no-op.
"""

from __future__ import annotations

import collections
from typing import Callable

import simpy

from sim.engine.instant import Timer, after, at, nothing_due_now

# a flow is done when what is left would take under a nanosecond (float residue of re-rating)
_DONE_WITHIN_S = 1e-9


class _EndTimer(Timer):
    """A flow's end timer: it carries its flow, so one bound method serves every flow's timers."""

    __slots__ = ("flow",)
    flow: _Flow


class _BeginTimer(Timer):
    """A shared flow's start timer (the end of its fixed part), carrying its flow."""

    __slots__ = ("flow",)
    flow: _Flow


class _Flow:
    """One transfer, from its start to its done callback. No ``__init__``: ``Interconnect.start`` fills
    every field itself (a class call with a Python ``__init__`` is a layer more per transfer)."""

    __slots__ = ("net", "nbytes", "started", "on_done", "src", "dst", "begins", "remaining", "rate", "since", "end",
                 "timer", "timer_at", "alone", "moving")
    net: "Interconnect"
    nbytes: float  # as asked (what bytes_moved adds up)
    started: float  # when asked (what ``on_done`` is told is the elapsed time from)
    on_done: Callable[[float], None]
    src: str
    dst: str
    begins: float  # when the fixed part ends and the bytes start to move
    remaining: float  # bytes left at ``since``
    since: float
    rate: float
    end: float  # when the bytes are all moved, at the current rate
    timer: "_EndTimer | None"  # the one of this flow's end timers that is not superseded
    timer_at: float
    alone: bool  # no neighbour moves during its window: rate and end fixed from the start
    moving: bool  # a shared flow past its fixed part (counted on its NICs)

    def done(self, _timer: object = None) -> None:
        """The transfer ended: count it, then tell the caller how long it took."""
        net = self.net
        net.bytes_moved += self.nbytes
        net.transfers += 1
        self.on_done(net.env._now - self.started)


def _window_meets(flow: _Flow, others: list[_Flow]) -> bool:
    """Whether one of ``others`` may move during ``flow``'s window (a shared flow's end is open)."""
    for other in others:
        if flow.end > other.begins and not (other.alone and other.end <= flow.begins):
            return True
    return False


class Interconnect:
    def __init__(self, env: simpy.Environment, nic_capacity_bytes_per_s: float, per_transfer_bytes_per_s: float) -> None:
        self.env = env
        self.nic_capacity = nic_capacity_bytes_per_s
        self.per_transfer_cap = per_transfer_bytes_per_s
        self._on_nic: collections.defaultdict[str, list[_Flow]] = collections.defaultdict(list)  # started, not ended
        self._moving: collections.Counter[str] = collections.Counter()  # shared flows moving, per NIC
        self._alone_rate = self._rate_at(1, 1)
        self._on_timer_bound = self._on_timer  # every end timer's callback, bound once
        self.bytes_moved = 0.0
        self.transfers = 0

    def start(self, src: str, dst: str, nbytes: float, fixed_s: float, on_done: Callable[[float], None]) -> None:
        """Move ``nbytes`` from ``src`` to ``dst``; ``on_done(elapsed seconds)`` runs from the event that
        ends the transfer (no process needed)."""
        env = self.env
        now = env._now
        flow = _Flow()
        flow.net, flow.nbytes, flow.started, flow.on_done = self, nbytes, now, on_done
        if nbytes <= 0:
            if fixed_s > 0:
                after(env, fixed_s, flow.done)
            else:
                flow.done()
            return
        flow.src, flow.dst = src, dst
        begins = flow.begins = flow.since = now + fixed_s
        remaining = flow.remaining = float(nbytes)
        rate = flow.rate = self._alone_rate
        flow.end = begins + remaining / rate  # if alone: no neighbour moves while it does
        flow.alone, flow.moving = True, False
        on_src, on_dst = self._on_nic[src], self._on_nic[dst]
        alone = not (on_src or on_dst) or not _window_meets(flow, on_src + on_dst)
        on_src.append(flow)
        on_dst.append(flow)
        if alone:
            # most transfers are alone, and their end is their one event
            self._arm(flow)
            return
        flow.timer, flow.timer_at = None, 0.0
        self._unalone(flow)
        if fixed_s > 0:
            self._begin_at(flow)
        else:
            self._begin(flow)

    def _rate_at(self, at_src: int, at_dst: int) -> float:
        share = self.nic_capacity / (at_dst if at_dst > at_src else at_src)
        return share if share < self.per_transfer_cap else self.per_transfer_cap

    def _unalone(self, flow: _Flow) -> None:
        """``flow`` is shared from now on, its end open: the alone flows on its NICs that are not over
        before it moves may now meet it, so they are shared too."""
        flow.alone = False
        for other in self._on_nic[flow.src] + self._on_nic[flow.dst]:
            if other.alone and other.end > flow.begins:
                self._share(other)

    def _share(self, flow: _Flow) -> None:
        """An alone flow may meet a shared neighbour: from now on its NICs count it and its rate can
        change. Its end timer stays (no neighbour can make it end sooner than alone)."""
        if flow.begins <= self.env._now:
            # moving since ``begins`` at the alone rate: ``since``, ``remaining`` and ``end`` say so already
            flow.moving = True
            self._moving[flow.src] += 1
            self._moving[flow.dst] += 1
        else:
            self._begin_at(flow)
        self._unalone(flow)

    def _begin_at(self, flow: _Flow) -> None:
        timer = _BeginTimer()
        timer.flow = flow
        at(self.env, flow.begins, self._on_begin_timer, timer)

    def _on_begin_timer(self, timer: _BeginTimer) -> None:
        self._begin(timer.flow)

    def _begin(self, flow: _Flow) -> None:
        """A shared flow's fixed part ends: it moves, and slows the flows it now shares a NIC with."""
        moving = self._moving
        moving[flow.src] += 1
        moving[flow.dst] += 1
        flow.moving = True
        self._rerate_neighbours(flow)
        now = self.env._now
        flow.since = now
        flow.rate = self._rate_at(moving[flow.src], moving[flow.dst])
        flow.end = now + flow.remaining / flow.rate
        if flow.timer is None or flow.end < flow.timer_at:
            self._arm(flow)

    def _rerate_neighbours(self, flow: _Flow) -> None:
        """New rates for the moving flows on ``flow``'s NICs (``flow`` itself excepted), whose count changed."""
        now, moving = self.env._now, self._moving
        src, dst = flow.src, flow.dst
        for other in self._on_nic[src] + [f for f in self._on_nic[dst] if f.src != src and f.dst != src]:
            if other is flow or not other.moving:
                continue
            rate = self._rate_at(moving[other.src], moving[other.dst])
            if rate == other.rate:
                continue  # the per-transfer cap hides the new count: its end stands
            left = other.remaining - other.rate * (now - other.since)
            if 0.0 > left:
                left = 0.0
            other.remaining, other.since, other.rate = left, now, rate
            other.end = now + left / rate
            if other.end < other.timer_at:  # sped up: its timer would fire late
                self._arm(other)

    def _arm(self, flow: _Flow) -> None:
        """An end timer for ``flow`` at its current end (it supersedes the flow's earlier ones)."""
        timer = flow.timer = _EndTimer()
        timer.flow = flow
        at(self.env, flow.end, self._on_timer_bound, timer)
        flow.timer_at = flow.end

    def _on_timer(self, timer: _EndTimer) -> None:
        flow = timer.flow
        if timer is not flow.timer:
            return  # superseded: the flow sped up and an earlier timer was set
        if not flow.alone and not flow.moving:
            flow.timer = None  # a shared flow still in its fixed part: its start arms its end
            return
        now = self.env._now
        if flow.end - now > _DONE_WITHIN_S:
            self._arm(flow)  # fired early: the flow slowed down after this timer was set
            return
        flow.timer = None  # no flow <-> timer cycle left behind: refcounting frees both, not the cyclic GC
        self._on_nic[flow.src].remove(flow)
        self._on_nic[flow.dst].remove(flow)
        if flow.moving:
            self._moving[flow.src] -= 1
            self._moving[flow.dst] -= 1
            self._rerate_neighbours(flow)
        if nothing_due_now(self.env):
            flow.done()  # this timer's last action, where the flow's done event would run
        else:
            after(self.env, 0, flow.done)  # the queue entry the flow's done event had
