"""One conversation's client, closed loop, as callbacks: a turn is released a think/tool gap after the
previous one completed (or at its trace arrival time, if later). Under a heartbeat lease the client
heartbeats after a turn for as long as its renewal behaviour says (:mod:`sim.clients.renewal`).

Callbacks rather than a simpy process per conversation: the client acts at the same events a process
would resume at (the first arrival, each turn's end, each gap's and heartbeat's timer), in the same
order, without a resume, a generator per turn, or the events a process's start and end cost.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Callable, Protocol, Sequence

import simpy
from simpy.events import NORMAL

from sim.clients.renewal import ClientRenewal
from sim.engine.instant import Timer, after, call_soon
from sim.workload.model import Conversation, Lineage


class ClientHost(Protocol):
    """What a client uses of :class:`sim.engine.cluster.Cluster` (which starts the clients, so it imports this
    module, never the other way)."""

    env: simpy.Environment
    renewal: ClientRenewal
    router: Any  # relays heartbeats: .heartbeat(key)
    heartbeats_sent: int

    @property
    def live_clients(self) -> int: ...

    def client_exited(self) -> None: ...

    def send_turn(self, conv: Conversation, index: int, lineage: Lineage | None, on_done: Callable[[], None],
                  key: tuple[str, str] | None = None) -> Any: ...


class ConversationClient:
    __slots__ = ("cluster", "conv", "key", "lease", "lineage", "index", "release", "renew_until", "on_exit",
                 "beats_stop", "after_beats")

    def __init__(self, cluster: ClientHost, conv: Conversation, lease: Any, on_exit: Callable[[], None] | None) -> None:
        self.cluster, self.conv, self.lease, self.on_exit = cluster, conv, lease, on_exit
        self.key = (conv.tenant, conv.conversation_id)
        self.lineage: Lineage | None = None
        self.index = 0
        self.release = self.renew_until = 0.0
        # the heartbeats in progress (one run at a time: between a turn's end and the next's release, or
        # after the last turn): when they stop, and what the client does then
        self.beats_stop = 0.0
        self.after_beats: Callable[[], None] = _nothing

    def start(self) -> None:
        env = self.cluster.env
        if self.conv.start_s > env._now:
            after(env, self.conv.start_s - env._now, self._first_turn)
        else:
            self._first_turn()

    def _first_turn(self, _event: simpy.Event | None = None) -> None:
        self.renew_until = self.release = self.cluster.env._now
        self.lineage = Lineage(self.conv.turns)  # what each prompt shares with what earlier turns left on P and D
        self._send()

    def _send(self, _event: simpy.Event | None = None) -> None:
        self.cluster.send_turn(self.conv, self.index, self.lineage, self._turn_done, self.key)

    def _turn_done(self) -> None:
        cluster, conv, index = self.cluster, self.conv, self.index
        now = cluster.env._now
        nxt = conv.turns[index + 1] if index + 1 < len(conv.turns) else None
        if nxt is not None:
            self.release = now + nxt.gap_before_s if nxt.arrival_s is None else max(nxt.arrival_s, now)
        if self.lease is not None:
            self.renew_until = cluster.renewal.renew_until(conv, index, now, self.release if nxt is not None else None)
        if nxt is None:
            self._exit()
            return
        self.index = index + 1
        if self.lease is not None:
            self._heartbeats(self.renew_until, self.release, self._wait_release)
        else:
            self._wait_release()

    def _wait_release(self) -> None:
        env = self.cluster.env
        now = env._now
        if self.release > now:
            after(env, self.release - now, self._send)
        else:
            self._send()

    def _exit(self) -> None:
        cluster = self.cluster
        cluster.client_exited()
        if self.lease is not None and self.renew_until > cluster.env._now:
            # after the last turn a lingering client keeps renewing on its own (from where a process
            # started now would start); a pooled client moves on
            until = self.renew_until
            call_soon(cluster.env, lambda _event: self._heartbeats(until, math.inf, _nothing))
        if self.on_exit is not None:
            self.on_exit()

    def _heartbeats(self, until: float, release: float, then: Callable[[], None]) -> None:
        """Heartbeat every interval from now (the turn's finish) while before ``until`` and ``release``,
        then ``then()``.

        The next turn retains its blocks afresh, so beats stop before it; beyond the lease's
        ``max_hold_s`` the router answers ``renewed: false`` and a client stops. Beats also stop once
        every client is done: the measurement window ends with the last turn for every policy (a fixed
        TTL's tail after it is not counted either).
        """
        lease = self.lease
        self.beats_stop = min(until, release - 1e-9, self.cluster.env._now + lease.max_hold_s)
        self.after_beats = then
        self._next_beat()

    def _next_beat(self) -> None:
        cluster, interval = self.cluster, self.lease.heartbeat_interval_s
        if cluster.env._now + interval <= self.beats_stop and cluster.live_clients > 0:
            after(cluster.env, interval, self._beat)
        else:
            self.after_beats()

    def _beat(self, _timer: object) -> None:
        cluster = self.cluster
        cluster.heartbeats_sent += 1
        cluster.router.heartbeat(self.key)
        self._next_beat()


def _nothing() -> None:
    pass


class _Arrival(Timer):
    """A client's first-turn timer, carrying its client."""

    __slots__ = ("client",)
    client: ConversationClient


class Arrivals:
    """Start one client per conversation: each first-turn timer's queue entry (time, priority, sequence
    number) is drawn where ``ConversationClient.start`` draws it, but goes on simpy's queue only when the
    entry before it in key order is popped. The queue pops entries in key order and none waiting here
    comes before the one queued, so everything happens in the same order, on a queue of the
    conversations in flight instead of all of them (every push and pop costs log n comparisons)."""

    def __init__(self, cluster: ClientHost, conversations: Sequence[Conversation], lease: Any) -> None:
        env = self.env = cluster.env
        entries = []
        callbacks = (self._arrive,)
        for conv in conversations:
            client = ConversationClient(cluster, conv, lease, None)
            if conv.start_s > env._now:
                timer = _Arrival()
                timer.client, timer.callbacks = client, callbacks
                entries.append((env._now + (conv.start_s - env._now), NORMAL, next(env._eid), timer))
            else:
                client._first_turn()  # as start() does
        entries.sort(reverse=True)  # the next to queue last (keys are unique: timers are never compared)
        self._pending = entries
        if entries:
            heapq.heappush(env._queue, entries.pop())  # type: ignore[misc]

    def _arrive(self, timer: _Arrival) -> None:
        if self._pending:
            heapq.heappush(self.env._queue, self._pending.pop())  # type: ignore[misc]
        timer.client._first_turn()
