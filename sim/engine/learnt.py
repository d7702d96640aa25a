"""The router's learnt retention (impl.policy.return_time) wired into the simulated router and decode nodes.

The simulated router sees every turn arrive and end, as the real one does: a turn's hold is decided when
it arrives (the real router sends it to D with the request) and D applies it when the turn finishes, never
longer than its own ``decoder_kv_blocks_ttl`` (the real connector's cap).
"""

from __future__ import annotations

from typing import Any

from impl.policy.return_time import LearntRetention


class LearntHolds:
    __slots__ = ("policy", "cap_s", "_turns", "learnt", "fallback", "freed_at_once", "retention_s_total")

    def __init__(self, policy: LearntRetention, cap_s: float) -> None:
        self.policy = policy
        self.cap_s = cap_s
        self._turns: dict[Any, tuple[float, Any]] = {}  # conversation key -> its turn in flight's hold (capped), group
        self.learnt = self.fallback = self.freed_at_once = 0
        self.retention_s_total = 0.0

    def arrived(self, key: Any, turn: int, now: float) -> None:
        # in the simulator a conversation keeps one key, so a later turn returns under it
        hold, group = self.policy.arrived(key[0], key if turn > 0 else None, turn, now)
        hold = hold.capped(self.cap_s)
        self._turns[key] = (hold.retention_s, group)
        kind = hold.kind
        if kind == "fallback":
            self.fallback += 1
        elif kind == "none":
            self.freed_at_once += 1
        else:
            self.learnt += 1
        self.retention_s_total += hold.retention_s

    def expiry_for(self, key: Any, now: float) -> float:
        return now + self._turns[key][0]

    def finished(self, key: Any, blocks: int, now: float) -> None:
        held = self._turns.pop(key, None)
        if held is not None:
            self.policy.finished(key, key[0], held[1], blocks, held[0], now)

    def summary(self) -> dict:
        turns = self.learnt + self.fallback + self.freed_at_once
        return {"holds_learnt": self.learnt, "holds_fallback": self.fallback, "freed_at_once": self.freed_at_once,
                "mean_retention_s": self.retention_s_total / turns if turns else 0.0,
                "price_per_block_s": self.policy.price, "expected_held": self.policy.expected_held(),
                "correction": self.policy.correction, "censored": self.policy.estimator.censored}
