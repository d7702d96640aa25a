"""Decode-side retention: how long D keeps a finished turn's blocks (prompt + output) for the next turn.

vLLM today (``decoder_kv_blocks_ttl``, default 480 s): expiry = finish time + TTL, fixed, never
renewed; D publishes it as ``remote_blocks_expiry_time`` and P declines reads within 5 s of it.
The alternatives here are the published "natural next step" (a heartbeat-renewed lease) and a TTL
learnt from the workload's own inter-turn gaps. Every policy answers in absolute seconds on the
caller's clock (``now`` is always passed in).
"""

from __future__ import annotations

import bisect
import collections
import math
from dataclasses import dataclass, field
from typing import Protocol


class RetentionPolicy(Protocol):
    def expiry_on_finish(self, now: float) -> float:
        """Absolute expiry for blocks of a request that finished at ``now``."""
        ...

    def renew(self, current_expiry: float, finished_at: float, now: float) -> float:
        """Expiry after a heartbeat at ``now`` for blocks retained since ``finished_at``."""
        ...

    def observe_gap(self, gap_s: float) -> None:
        """Feed one observed inter-turn gap (finish of a turn to arrival of the next)."""
        ...


# vLLM's decoder_kv_blocks_ttl default (vllm/config/kv_transfer.py): every policy that starts from it reads it here
VLLM_TTL_S = 480.0


def _check_seconds(name: str, value: float, *, allow_inf: bool = True) -> None:
    # "a duration", not "seconds": FixedTTL's argument is called seconds, and the catalogue names it
    if math.isnan(value) or value < 0 or (not allow_inf and math.isinf(value)):
        raise ValueError(f"{name} must be a non-negative duration in s{'' if allow_inf else ', finite'}, got {value!r}")


@dataclass(frozen=True, slots=True)
class FixedTTL:
    """vLLM's ``decoder_kv_blocks_ttl``: finish + TTL, never renewed. ``inf`` keeps blocks until pressure."""

    seconds: float = VLLM_TTL_S

    def __post_init__(self) -> None:
        _check_seconds("seconds", self.seconds)

    def expiry_on_finish(self, now: float) -> float:
        return now + self.seconds

    def renew(self, current_expiry: float, finished_at: float, now: float) -> float:
        return current_expiry

    def observe_gap(self, gap_s: float) -> None:
        return None


@dataclass(frozen=True, slots=True)
class HeartbeatLease:
    """A lease the client (through the router) renews while the conversation is live.

    Blocks are reclaimed ``lease_s`` after the last heartbeat, so an abandoned or finished
    conversation frees its KV within one lease instead of a whole TTL. ``max_hold_s`` caps how long
    heartbeats can pin blocks after the turn finished (a client that never stops heartbeating must
    not pin memory forever).
    """

    lease_s: float = 30.0
    heartbeat_interval_s: float = 10.0
    max_hold_s: float = 3600.0

    def __post_init__(self) -> None:
        _check_seconds("lease_s", self.lease_s, allow_inf=False)
        _check_seconds("heartbeat_interval_s", self.heartbeat_interval_s, allow_inf=False)
        _check_seconds("max_hold_s", self.max_hold_s)
        if self.heartbeat_interval_s <= 0 or self.heartbeat_interval_s >= self.lease_s:
            raise ValueError(
                "heartbeat_interval_s must be > 0 and shorter than lease_s, or one late heartbeat "
                f"drops a live conversation (got interval {self.heartbeat_interval_s}, lease {self.lease_s})"
            )

    def expiry_on_finish(self, now: float) -> float:
        return now + self.lease_s

    def renew(self, current_expiry: float, finished_at: float, now: float) -> float:
        if now > current_expiry:  # a lapsed lease stays lapsed: its blocks may already be gone
            return current_expiry
        return max(current_expiry, min(now + self.lease_s, finished_at + self.max_hold_s))

    def observe_gap(self, gap_s: float) -> None:
        return None

    def last_heartbeat_before(self, finished_at: float, until: float) -> float:
        """Time of the last heartbeat a client sending one every interval since ``finished_at`` sends before ``until``."""
        if until <= finished_at:
            return finished_at
        beats = math.floor((until - finished_at) / self.heartbeat_interval_s)
        return finished_at + beats * self.heartbeat_interval_s


@dataclass(slots=True)
class GapQuantileTTL:
    """TTL = a quantile of recently observed inter-turn gaps, clamped to [floor_s, cap_s].

    Until ``min_samples`` gaps are seen it answers ``initial_s`` (vLLM's 480 s by default). The
    window is a bounded FIFO kept sorted alongside, so a query is O(1) and an update O(window).
    """

    quantile: float = 0.9
    cap_s: float = 900.0
    floor_s: float = 10.0
    initial_s: float = VLLM_TTL_S
    min_samples: int = 20
    window: int = 2048
    margin_s: float = 5.0  # P declines reads within 5 s of expiry: keep that much beyond the gap
    _fifo: collections.deque[float] = field(default_factory=collections.deque, repr=False)
    _sorted: list[float] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {self.quantile}")
        for name in ("cap_s", "floor_s", "initial_s", "margin_s"):
            _check_seconds(name, getattr(self, name))
        if self.floor_s > self.cap_s:
            raise ValueError(f"floor_s ({self.floor_s}) must not exceed cap_s ({self.cap_s})")
        if self.min_samples < 1 or self.window < self.min_samples:
            raise ValueError(f"need 1 <= min_samples <= window, got {self.min_samples}, {self.window}")

    def observe_gap(self, gap_s: float) -> None:
        if math.isnan(gap_s) or gap_s < 0:
            return  # a clock step backwards or a bad sample must not poison the estimate
        if len(self._fifo) == self.window:
            oldest = self._fifo.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        self._fifo.append(gap_s)
        bisect.insort(self._sorted, gap_s)

    @property
    def ttl_s(self) -> float:
        n = len(self._sorted)
        if n < self.min_samples:
            return min(max(self.initial_s, self.floor_s), self.cap_s)
        # nearest-rank quantile: the smallest sample with at least q of the window at or below it
        rank = max(1, math.ceil(self.quantile * n))
        return min(max(self._sorted[rank - 1] + self.margin_s, self.floor_s), self.cap_s)

    def expiry_on_finish(self, now: float) -> float:
        return now + self.ttl_s

    def renew(self, current_expiry: float, finished_at: float, now: float) -> float:
        return current_expiry
