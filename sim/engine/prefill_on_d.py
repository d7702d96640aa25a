"""Prefill on D in the simulator: the router's per-turn choice (impl.policy.prefill_on_d, run verbatim) and
what D's steps cost while they carry a suffix.

The router sends a later turn to the D that holds its conversation when the policy says so; D then takes
the prompt's leading blocks from what it still holds (retained, or in its prefix cache after a give-back
or an expiry, as vLLM's hash-keyed cache would: only up to the first token that differs, nothing across a
rewritten history) and computes the rest in its own steps (sim.engine.decode). What the router knows is what a
real one knows: its store's entry (D, tokens held, expiry), the expiry of the entry it last stored for the
conversation (how long ago the hold lapsed), D's running sequences and blocks, the suffix work it already
sent D, P's queued prefill tokens. It never reads D's pool or cache.

A step that carries a chunk of suffix: vLLM's chunked prefill runs the running sequences' decode tokens
and the chunk in one forward pass (decode requests are scheduled first, the chunk takes what is left of
``max_num_batched_tokens``: ``vllm/v1/core/sched/scheduler.py``, running requests before waiting ones).
Modelled as D's decode step plus the chunk's marginal prefill work as P would price it (the profile's
linear and attention terms, without P's per-forward fixed cost, which D's decode step already pays:
:func:`sim.engine.decode.chunk_work_s`): an assumption, not a measurement; nothing about mixed steps is published
for these models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from impl.policy.prefill_on_d import HoldState, PrefillOnD, TurnPath, TurnSignals
from impl.policy.store import usable_until

if TYPE_CHECKING:
    from sim.engine.decode import DecodeNode
    from sim.engine.prefill import PrefillNode
    from sim.engine.records import TurnRecord

PREFILL_ON_D = TurnPath.PREFILL_ON_D.value  # what a record's ``decision`` says of a turn served on D


class PrefillOnDRouting:
    """The router's side: which later turns go to the D that holds them, and what it remembers to know."""

    def __init__(self, policy: PrefillOnD, decode_by_name: dict[str, "DecodeNode"], prefill: list["PrefillNode"],
                 margin_s: float) -> None:
        self.policy = policy
        self._decode_by_name = decode_by_name
        self._prefill = prefill
        self.margin_s = margin_s
        # the last entry the router stored per conversation: (D, tokens it holds, expiry): what it knows of a
        # hold after its store stops offering it (expired, or evicted by the store's bound)
        self._last: dict[Any, tuple[str, int, float]] = {}

    def choose(self, rec: "TurnRecord", key: Any, remote: "tuple[DecodeNode, int, int, int] | None",
               now: float) -> "DecodeNode | None":
        """The D to serve ``rec`` on, or None for P. ``remote``: what the store's entry offers (D, tokens
        held, ...), None on a miss."""
        if remote is not None:
            d, held, hold, lapsed_for = remote[0], remote[1], HoldState.RETAINED, 0.0
        else:
            last = self._last.get(key)
            if last is None:
                return None
            d_name, held, expires_at = last
            d = self._decode_by_name[d_name]
            hold = HoldState.LAPSED
            lapsed_for = max(0.0, now - usable_until(expires_at, self.margin_s))
        p_queued = min(p.queued_tokens for p in self._prefill)
        signals = TurnSignals(rec.prompt_tokens, min(held, rec.prompt_tokens), hold, lapsed_for, len(d.running),
                              d.max_num_seqs, d.running_blocks + d.arriving_blocks, d.capacity,
                              d.prefill_pending_tokens, p_queued)
        decision = self.policy.decide(signals)
        if decision.path is not TurnPath.PREFILL_ON_D:
            return None
        rec.decision, rec.decision_reason = PREFILL_ON_D, decision.reason.value
        return d

    def finished(self, key: Any, d_name: str, tokens: int, expires_at: float | None, now: float) -> None:
        """A turn of ``key`` finished on ``d_name`` holding ``tokens``: retained until ``expires_at`` (the
        entry the router stores), or, without retention (None), straight into D's prefix cache."""
        self._last[key] = (d_name, tokens, now + self.margin_s if expires_at is None else expires_at)
