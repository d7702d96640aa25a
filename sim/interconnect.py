"""The interconnect: per-node NICs shared fairly by concurrent KV transfers, both directions alike.

A transfer first pays its fixed part (setup + per-descriptor work, from the profile), then moves its
bytes as a flow. A flow's rate is the smallest of: the per-transfer rate the profile measured (one
transfer alone is setup/overhead bound, not wire bound: see calibration/README.md), and an equal share
of each endpoint NIC's usable capacity (line rate x efficiency). P->D and D->P flows use the same NICs
and contend. Rates are recomputed only when a flow starts or ends (processor sharing), so the cost
is per transfer, not per byte.
"""

from __future__ import annotations

import collections
from typing import Callable

import simpy

from sim.instant import after, nothing_due_now


class _Flow:
    __slots__ = ("src", "dst", "remaining", "rate", "on_end")

    def __init__(self, src: str, dst: str, nbytes: float, on_end: Callable[..., None]) -> None:
        self.src, self.dst, self.remaining, self.rate, self.on_end = src, dst, nbytes, 0.0, on_end


class Interconnect:
    def __init__(self, env: simpy.Environment, nic_capacity_bytes_per_s: float, per_transfer_bytes_per_s: float) -> None:
        self.env = env
        self.nic_capacity = nic_capacity_bytes_per_s
        self.per_transfer_cap = per_transfer_bytes_per_s
        self._flows: list[_Flow] = []
        self._per_nic: collections.Counter[str] = collections.Counter()
        self._last_update = 0.0
        self._timer: object = None  # the one timer that is not superseded (a flow started or ended since the others)
        self.bytes_moved = 0.0
        self.transfers = 0

    def start(self, src: str, dst: str, nbytes: float, fixed_s: float, on_done: Callable[[float], None]) -> None:
        """Move ``nbytes`` from ``src`` to ``dst``; ``on_done(elapsed seconds)`` runs from the event that
        ends the transfer (no process needed)."""
        start = self.env._now

        def finish(_event: object = None) -> None:
            self.bytes_moved += nbytes
            self.transfers += 1
            on_done(self.env._now - start)

        if nbytes > 0:
            if fixed_s > 0:
                after(self.env, fixed_s, lambda _event: self._start_flow(src, dst, nbytes, finish))
            else:
                self._start_flow(src, dst, nbytes, finish)
        elif fixed_s > 0:
            after(self.env, fixed_s, finish)
        else:
            finish()

    def _start_flow(self, src: str, dst: str, nbytes: float, on_end: Callable[..., None]) -> None:
        self._advance()
        self._flows.append(_Flow(src, dst, float(nbytes), on_end))
        self._per_nic[src] += 1
        self._per_nic[dst] += 1
        self._reschedule()

    def _advance(self) -> None:
        now = self.env._now
        elapsed = now - self._last_update
        if elapsed > 0:
            for flow in self._flows:
                flow.remaining -= flow.rate * elapsed
        self._last_update = now

    def _reschedule(self) -> None:
        if not self._flows:
            self._timer = None
            return
        # every flow, at every start and end (O(flows), the hot loop at 64P64D): min/max spelled out as
        # comparisons, which pick the same operand the builtins do
        soonest = float("inf")
        capacity, cap, per_nic = self.nic_capacity, self.per_transfer_cap, self._per_nic
        for flow in self._flows:
            at_src, at_dst = per_nic[flow.src], per_nic[flow.dst]
            share = capacity / (at_dst if at_dst > at_src else at_src)
            rate = flow.rate = share if share < cap else cap
            left = flow.remaining
            if 0.0 > left:
                left = 0.0
            t = left / rate
            if t < soonest:
                soonest = t
        self._timer = after(self.env, soonest, self._on_timer)

    def _on_timer(self, timer: object) -> None:
        if timer is not self._timer:
            return  # a flow started or ended since this timer was set
        self._advance()
        # a flow is done when what is left would take under a nanosecond (float residue)
        finished = [f for f in self._flows if f.remaining <= f.rate * 1e-9]
        for flow in finished:
            self._flows.remove(flow)
            self._per_nic[flow.src] -= 1
            self._per_nic[flow.dst] -= 1
        if len(finished) == 1:
            self._reschedule()
            if nothing_due_now(self.env):
                finished[0].on_end()  # this timer's last action, where the flow's done event would run
                return
            # something is due now (maybe the timer just set): queue the end before a new timer, as
            # always; the timer just set is superseded (a no-op when it fires)
            self._queue_end(finished[0])
            self._reschedule()
            return
        for flow in finished:
            self._queue_end(flow)
        self._reschedule()

    def _queue_end(self, flow: _Flow) -> None:
        after(self.env, 0, flow.on_end)  # the queue entry the flow's done event had
