"""The clairvoyant bound the tuner measures every configuration against.

It is not a deployable policy (it reads the future), so it lives in the simulator, not in
impl/policy. It retains a finished turn's blocks exactly until the conversation's next turn arrives
(plus the expiry margin P needs to accept the read), and not at all when no continuing turn follows
(the conversation ended, or the client rewrites its history). Paired with
``BreakEvenThreshold(profile)``, whose costs are the simulator's own, it decides pull-vs-recompute
with perfect costs.
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
