"""How simulated clients renew a heartbeat lease: the client's behaviour, separate from D's lease.

D's :class:`impl.policy.HeartbeatLease` frees a finished turn's blocks ``lease_s`` after the last
heartbeat. Whether a conversation's KV survives a gap therefore depends on when *clients* heartbeat,
which D does not choose, and no real client knows whether its user will come back. The behaviours
(``[clients] client_renewal``, ``--client-renewal``):

* ``while_open`` -- a chat UI renews while the page is open, an API client while its session object
  lives: after every turn it renews for a *linger* time, whether or not a next turn comes (the user
  reads the answer, leaves the tab open, walks away). A next turn that arrives after the linger ended
  finds no renewal since then. The linger is lognormal between ``client_linger_p50_s`` and
  ``client_linger_p90_s`` (an assumption, see :class:`sim.engine.config.ClientConfig`).
* ``tool_calls`` -- an agent knows it will return while a tool call it made runs (it sends the next
  turn itself when the tool answers), and not after a turn that answers the user: it renews through a
  gap only after a turn whose output is a tool call (:attr:`sim.workload.model.Turn.tool_call`). On a
  workload without tool calls (a chat trace) this is ``never``.
* ``never`` -- no heartbeats: the lease is a fixed TTL of ``lease_s``.
* ``until_next_turn`` -- renews through every gap exactly until the next turn and stops exactly after
  the last one. That reads the future (the oracle's knowledge), so it is only a labelled upper bound.

Each behaviour answers one question after a turn finishes: until when does the client renew? The
cluster (:mod:`sim.engine.cluster`) then heartbeats every ``heartbeat_interval_s`` from the finish while before
that time, before the next turn (which retains the blocks afresh) and within the lease's
``max_hold_s`` (the router answers ``renewed: false`` beyond it, so a client stops).

Randomness: a turn's linger comes from its own stream ``client-linger:<tenant>:<conversation>:<turn>``
(:func:`sim.engine.rng.stream`), so every configuration of a sweep sees the same lingers whatever the timing
(common random numbers), and no existing stream is drawn from.
"""

from __future__ import annotations

import math
from typing import Protocol

from sim.engine.rng import stream
from sim.workload.distributions import Constant, Distribution, LogNormal
from sim.workload.model import Conversation


class ClientSettings(Protocol):
    """What this module reads of :class:`sim.engine.config.ClientConfig` (which validates through
    :func:`linger_distribution`, so the config imports this module, never the other way)."""

    client_renewal: str
    client_linger_p50_s: float
    client_linger_p90_s: float


def linger_distribution(config: ClientSettings) -> Distribution:
    """The while_open linger: lognormal through (p50, p90), a constant when they are equal."""
    p50, p90 = config.client_linger_p50_s, config.client_linger_p90_s
    for name, value in (("client_linger_p50_s", p50), ("client_linger_p90_s", p90)):
        if math.isnan(value) or value < 0 or math.isinf(value):
            raise ValueError(f"config field clients.{name} must be a finite number of seconds >= 0, got {value!r}")
    if p90 < p50:
        raise ValueError(f"config field clients.client_linger_p90_s ({p90:g}) must be >= client_linger_p50_s ({p50:g})")
    if p90 == p50 or p50 == 0:
        # a zero median makes the lognormal degenerate at 0 whatever p90 says: say so instead of guessing
        if p50 == 0 and p90 != 0:
            raise ValueError("config field clients.client_linger_p50_s is 0: a lognormal with a zero median is 0 "
                             "everywhere; set client_linger_p90_s to 0 too (no linger) or give a positive median")
        return Constant(p50)
    return LogNormal.from_quantiles(p50=p50, p90=p90)


class ClientRenewal:
    """One behaviour of :data:`sim.engine.config.RENEWAL_BEHAVIOURS`, answering :meth:`renew_until`."""

    def __init__(self, config: ClientSettings, seed: int) -> None:
        self.behaviour = config.client_renewal
        self._linger = linger_distribution(config)
        self._seed = seed

    def linger_s(self, conv: Conversation, index: int) -> float:
        """How long the user keeps the session open after turn ``index`` (while_open)."""
        rng = stream(self._seed, f"client-linger:{conv.tenant}:{conv.conversation_id}:{index}")
        return self._linger.sample(rng)

    def renew_until(self, conv: Conversation, index: int, finished_at: float, next_release: float | None) -> float:
        """Until when the client renews after turn ``index`` finished at ``finished_at``.

        ``next_release`` is when the next turn will be sent (None after the last turn): only
        ``until_next_turn`` (the clairvoyant bound) and ``tool_calls`` (the agent sends it itself when
        its tool answers) may read it. A value at or before ``finished_at`` means no heartbeat.
        """
        if self.behaviour == "never":
            return finished_at
        if self.behaviour == "while_open":
            return finished_at + self.linger_s(conv, index)
        if self.behaviour == "tool_calls":
            if conv.turns[index].tool_call and next_release is not None:
                return next_release
            return finished_at
        if self.behaviour == "until_next_turn":
            return finished_at if next_release is None else next_release
        raise ValueError(f"unknown client renewal behaviour {self.behaviour!r}")
