"""The clairvoyant reference the tuner measures every configuration against: a reference, not a bound.

It is not a deployable policy (it reads the future), so it lives in the simulator, not in
impl/policy. It retains a finished turn's blocks exactly until the conversation's next turn arrives
(plus the expiry margin P needs to accept the read), and not at all when no continuing turn follows
(the conversation ended, or the client rewrites its history). Paired with
``BreakEvenThreshold(profile)``, whose costs are the simulator's own, it decides pull-vs-recompute
with perfect costs.

What it optimises, exactly: each retention is the shortest hold that still lets the next continuing
turn pull (no retained block-second is spent on a turn nobody continues), and each pull decision
minimises that turn's own prefill time. That is all. It is therefore not an upper bound on what the
tuner reports as "% of the oracle's saving":

* compute saved (prompt tokens not recomputed): break-even declines pulls that save tokens but not
  time (short prefixes, a busy NIC), which a fixed threshold (e.g. 0) takes;
* holds beyond the next arrival are never counted: a longer hold (a lease or TTL tail) leaves blocks
  on D that a later turn can still use (D's local hit, a turn that does not continue the history
  but shares its prefix), which the oracle has freed;
* under memory pressure, holding through a long gap can push out other conversations' blocks that a
  shorter hold would have kept; and TTFT depends on queueing, which no per-turn choice bounds.

So a configuration can reach more than 100 % of the oracle's saving (the README's 101.4 % for a lease
renewed until the next turn is one); read the percentage as "relative to perfect-foresight retention
with time-optimal pulls", not as a fraction of the best achievable.

For compute the tuner also reports a true bound (``bound%``, ``compute_saving_pct_of_bound``):
every turn reuses all that P could verify of what D holds after the previous turn, or its own
prefix-cache hit if larger (sim/tune/screen.py, ``TurnTable.compute_bound_tokens``); no configuration
that completes every turn recomputes less (tests/tune/test_screen.py). For TTFT no bound is reported:
per-turn queueing has none short of simulating, so the oracle stays a reference there.
"""

from __future__ import annotations

from typing import Any, Callable


class OracleRetention:
    def __init__(self, next_reuse: Callable[[Any, float], float | None], margin_s: float) -> None:
        self._next_reuse = next_reuse  # (conversation key, now) -> arrival of the next continuing turn
        self._margin_s = margin_s

    def expiry_for(self, key: Any, now: float) -> float:
        arrival = self._next_reuse(key, now)
        if arrival is None:
            return now  # nothing will reuse it: free at once
        return arrival + self._margin_s + 1e-6

    def expiry_on_finish(self, now: float) -> float:  # the key-less protocol cannot know the future
        raise TypeError("OracleRetention needs the conversation: use expiry_for(key, now)")

    def renew(self, current_expiry: float, finished_at: float, now: float) -> float:
        return current_expiry

    def observe_gap(self, gap_s: float) -> None:
        return None
