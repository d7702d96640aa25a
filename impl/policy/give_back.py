"""Giving retained KV back under pressure without ever freeing a block a prefill node may still read.

Stock vLLM pins a finished turn's blocks on D until P reads them or ``decoder_kv_blocks_ttl`` passes
(``delay_free_blocks`` in the NIXL connector's ``request_finished``): a D that runs short of blocks
makes new work wait behind them for up to the TTL. D cannot simply free them sooner: P reads them
with a one-sided NIXL READ that D neither sees nor can refuse, at any time before the expiry D
published (``remote_blocks_expiry_time``, which P checks, declining within a margin of it). A block
freed and reused while some P still holds its address would be read as another request's KV.

The protocol here makes that impossible by construction:

1. **Short published expiries.** D publishes for each retained turn
   ``min(intended, last renewal + publish_window_s)``, where ``intended`` is what the retention
   policy wants (finish + TTL, a lease, ...) and renewals happen every ``renew_every_s`` on one
   schedule for the whole node (:meth:`GiveBack.last_renewal`). Published expiries only ever grow.
2. **Renewal while there is headroom.** At each renewal D publishes the new expiry (through the
   router, which forwards it to the next P). While its pool has headroom nothing changes for reuse:
   ``publish_window_s - renew_every_s > expiry margin`` keeps every published expiry further ahead
   than the margin at which P declines.
3. **Give back by withholding renewals, never by freeing early.** When free blocks (plus blocks
   already coming free) fall below the headroom watermark, or a request waits for blocks, D stops
   renewing the entries :func:`impl.policy.pressure` orders first, until enough are coming free; each
   such *lapsing* entry is freed at its last published expiry (:meth:`GiveBack.free_at`), never before.

Why no read can overlap a free: P starts a read only while ``now_P + offset_error <
published_seen - margin_s`` (vLLM's 5 s rule, with the handshake's clock offset), where
``published_seen`` is some value D published (the router forwards D's values, possibly an older
one: published expiries only grow, so an older one is smaller). A read takes less than the margin
minus the clock error, so it ends before ``published_seen <= last published <= free time``.
Lost, late or reordered renewals cost reuse (P declines earlier than it could have), never
correctness. ``tests/policy/test_give_back.py`` checks this invariant under arbitrary orders of
finishes, renewals, pressure, propagation and reads, and clock offsets.

Costs: memory asked for at ``t`` is back by ``t + publish_window_s`` at the latest (the furthest a
published expiry ever reaches), ``publish_window_s - renew_every_s`` at the earliest; the watermark
starts that clock before memory is needed. A lapsing conversation that returns before its free time
is still read; after it, it is recomputed: that is the reuse given up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Container, Hashable

from impl.policy.pressure import RetainedPool


@dataclass(frozen=True, slots=True)
class GiveBack:
    """The give-back protocol's settings and rules (pure: every time is passed in, on D's clock)."""

    publish_window_s: float = 30.0
    renew_every_s: float = 10.0
    headroom_fraction: float = 0.05
    expiry_margin_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("publish_window_s", "renew_every_s", "expiry_margin_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        if self.renew_every_s <= 0:
            raise ValueError(f"renew_every_s must be > 0, got {self.renew_every_s!r}")
        if self.publish_window_s - self.renew_every_s <= self.expiry_margin_s:
            raise ValueError(
                "publish_window_s - renew_every_s must exceed the expiry margin, or P declines entries D still "
                f"renews (got window {self.publish_window_s}, renewal every {self.renew_every_s}, margin "
                f"{self.expiry_margin_s})")
        if not (isinstance(self.headroom_fraction, (int, float)) and 0 <= self.headroom_fraction < 1):
            raise ValueError(f"headroom_fraction must be in [0, 1), got {self.headroom_fraction!r}")

    def last_renewal(self, now: float) -> float:
        """The node's most recent renewal at or before ``now`` (renewals at multiples of renew_every_s)."""
        return math.floor(now / self.renew_every_s) * self.renew_every_s

    def published_expiry(self, finished_at: float, intended_expiry: float, now: float) -> float:
        """What D has published for an entry it kept renewing up to ``now``: its finish, or the last
        renewal since, plus the window, never beyond what the retention policy intends."""
        renewed = self.last_renewal(now)
        base = finished_at if finished_at > renewed else renewed
        end = base + self.publish_window_s
        return intended_expiry if intended_expiry < end else end

    def free_at(self, finished_at: float, intended_expiry: float, withheld_at: float) -> float:
        """When an entry whose renewals stop at ``withheld_at`` may be freed: its last published expiry."""
        return self.published_expiry(finished_at, intended_expiry, withheld_at)

    def headroom_blocks(self, capacity_blocks: int) -> int:
        return math.ceil(self.headroom_fraction * capacity_blocks)

    def shortfall(self, capacity_blocks: int, free_blocks: int, coming_free_blocks: int, waiting_blocks: int) -> int:
        """Blocks to start giving back now: what keeps the watermark plus what waiting requests need,
        beyond what is free or already coming free (lapsing entries)."""
        short = self.headroom_blocks(capacity_blocks) + waiting_blocks - free_blocks - coming_free_blocks
        return short if short > 0 else 0


def releases(pool: RetainedPool, shortfall_blocks: int, lapsing: Container[Hashable] = ()) -> list[Hashable]:
    """The renewing entries to stop renewing for ``shortfall_blocks``, in pressure order
    (:mod:`impl.policy.pressure`: soonest intended expiry first, then the larger), skipping those in
    ``lapsing`` (already given back). All of them if even all fall short: unlike a drop, a give-back
    that covers part of the need still shortens the wait, and it keeps serving reads until it lapses."""
    if shortfall_blocks <= 0:
        return []
    out: list[Hashable] = []
    freed = 0
    for key, blocks in pool.in_order():
        if key in lapsing:  # already coming free: the caller counted it
            continue
        out.append(key)
        freed += blocks
        if freed >= shortfall_blocks:
            break
    return out


@dataclass(slots=True)
class _Entry:
    finished_at: float
    intended: float  # what the retention policy wants (its expiry on finish, or a lease's renewal)
    published: float  # the latest expiry D has published: only ever grows
    withheld_at: float = math.nan  # when its renewals stopped (nan: still renewed)

    @property
    def lapsing(self) -> bool:
        return not math.isnan(self.withheld_at)


class GiveBackLedger:
    """What D has published for each retained entry, and when each may be freed: the connector's
    bookkeeping of :class:`GiveBack` (the simulator keeps the same facts in its block pool).

    The one rule it enforces: an entry is freed at the latest expiry D ever published for it (or its
    intended expiry, whichever D reaches first while renewing), never sooner, and nothing is
    published for an entry after its renewals stop.
    """

    __slots__ = ("rules", "_entries", "pool", "lapsing_blocks")

    def __init__(self, rules: GiveBack) -> None:
        self.rules = rules
        self._entries: dict[Hashable, _Entry] = {}
        self.pool = RetainedPool()  # every held entry by intended expiry: the pressure order
        self.lapsing_blocks = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: Hashable, blocks: int, finished_at: float, intended_expiry: float) -> float:
        """A finished turn is retained: the expiry to publish with it."""
        if key in self._entries:
            raise ValueError(f"entry {key!r} is already retained")
        published = self.rules.published_expiry(finished_at, intended_expiry, finished_at)
        self._entries[key] = _Entry(finished_at, intended_expiry, published)
        self.pool.add(key, blocks, intended_expiry)
        return published

    def renew(self, now: float) -> dict[Hashable, float]:
        """The node's renewal: every entry still renewed gets its window moved up; returns those whose
        published expiry grew (for D to publish: through the router to the next P)."""
        out: dict[Hashable, float] = {}
        rules = self.rules
        for key, entry in self._entries.items():
            if entry.lapsing:  # a lapsing lease stays lapsing
                continue
            new = rules.published_expiry(entry.finished_at, entry.intended, now)
            if new > entry.published:
                entry.published = new
                out[key] = new
        return out

    def withhold_for(self, shortfall_blocks: int, now: float) -> list[Hashable]:
        """Stop renewing the entries :func:`releases` names for ``shortfall_blocks``: they lapse at their
        last published expiry. Returns them."""
        lapsing = {k for k, e in self._entries.items() if e.lapsing}
        keys = releases(self.pool, shortfall_blocks, lapsing)
        for key in keys:
            self._entries[key].withheld_at = now
            self.lapsing_blocks += self.pool.blocks_of(key)
        return keys

    def is_lapsing(self, key: Hashable) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.lapsing

    def published(self, key: Hashable) -> float | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.published

    def free_at(self, key: Hashable) -> float:
        """When the entry may be freed: its last published expiry once withheld, else its intended
        expiry (D keeps renewing up to it and never publishes beyond it)."""
        entry = self._entries[key]
        return entry.published if entry.lapsing else entry.intended

    def due(self, now: float) -> list[Hashable]:
        """Entries that may be freed at ``now``."""
        return [k for k in self._entries if now >= self.free_at(k)]

    def remove(self, key: Hashable) -> None:
        """The entry is gone (freed when due, or read and released by its reader)."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        blocks = self.pool.discard(key)
        if entry.lapsing:
            self.lapsing_blocks -= blocks
