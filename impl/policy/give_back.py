"""Giving retained KV back under pressure without ever freeing a block a prefill node may still read.

Stock vLLM pins a finished turn's blocks on D until P reads them or ``decoder_kv_blocks_ttl`` passes
(``delay_free_blocks`` in the NIXL connector's ``request_finished``): a D that runs short of blocks
makes new work wait behind them for up to the TTL. D cannot simply free them sooner: P reads them
with a one-sided NIXL READ that D neither sees nor can refuse, at any time before the expiry D
published (``remote_blocks_expiry_time``, which P checks, declining within a margin of it). A block
freed and reused while some P still holds its address would be read as another request's KV.

The protocol here makes that impossible by construction, and gives idle memory back at once:

1. **Short published expiries, renewed on use.** With a finished turn D publishes
   ``min(intended, finish + publish_window_s)``, where ``intended`` is what the retention policy
   wants (finish + TTL, a lease). The router stores the entry until ``intended`` (it is told both),
   and before it sends a turn's params to P it asks D (the heartbeat listener) to renew: D answers
   ``min(intended, now + publish_window_s)`` and records it. Published expiries only ever grow.
2. **Give back by not renewing, never by freeing early.** When free blocks (plus blocks already
   coming free) fall below the headroom watermark, or a request waits for blocks, D marks the entries
   :mod:`impl.policy.pressure` orders first as *lapsing*, until enough are coming free. A lapsing entry
   is not renewed again and is freed at its last published expiry (:meth:`GiveBackLedger.free_at`):
   at once if that is past, which it is for any entry no turn asked for within the window -- most
   retained turns are idle, waiting for a user who may not come back.

Why no read can overlap a free: P starts a read only while ``now_P + clock_error < published_seen -
margin`` (vLLM's rule, with the handshake's clock offset), where ``published_seen`` is a value D
published (the router forwards D's values, perhaps an older one: published expiries only grow, so
an older one is smaller). A read takes less than the margin minus the clock error, so it ends before
``published_seen <= last published <= free time``. Lost, late or reordered answers cost reuse (P
declines sooner than it had to), never correctness. ``tests/policy/test_give_back.py`` checks this
under arbitrary orders of finishes, renewals, pressure, propagation, reads and clock offsets.

Costs: memory asked for at ``t`` is back by ``t + publish_window_s`` at the latest (an entry renewed
just before), at ``t`` for every entry not renewed within the window. A lapsing conversation that
returns before its free time is still read; after it, it is recomputed: that is the reuse given up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Container, Hashable

from impl.policy.pressure import RetainedPool

# In D's kv_transfer_params: the router asks D to renew this turn (its heartbeat listener) before it sends
# the params to P, and forwards the expiry D answers as remote_blocks_expiry_time
RENEW_BEFORE_READ_KEY = "bidikv_renew_before_read"


@dataclass(frozen=True, slots=True)
class GiveBack:
    """The give-back protocol's settings and rules (pure: every time is passed in, on D's clock)."""

    publish_window_s: float = 15.0
    headroom_fraction: float = 0.05
    expiry_margin_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("publish_window_s", "expiry_margin_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        if self.publish_window_s <= self.expiry_margin_s:
            # what is left of the window beyond the margin is the time the router's ask, P's queue and
            # P's check may take before P declines what D just renewed for it
            raise ValueError(f"publish_window_s must exceed the expiry margin, or P declines what D just renewed "
                             f"for it (got window {self.publish_window_s}, margin {self.expiry_margin_s})")
        if not (isinstance(self.headroom_fraction, (int, float)) and 0 <= self.headroom_fraction < 1):
            raise ValueError(f"headroom_fraction must be in [0, 1), got {self.headroom_fraction!r}")

    def published_expiry(self, intended_expiry: float, now: float) -> float:
        """What D publishes when it finishes a turn or renews one at ``now``: the window, never beyond
        what the retention policy intends."""
        end = now + self.publish_window_s
        return intended_expiry if intended_expiry < end else end

    def free_at(self, last_published: float, withheld_at: float) -> float:
        """When an entry whose renewals stop at ``withheld_at`` may be freed: its last published expiry,
        or at once if that has passed."""
        return last_published if last_published > withheld_at else withheld_at

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


class GiveBackLedger:
    """What D has published for each retained entry, and when each may be freed: the bookkeeping of
    :class:`GiveBack` that the connector and the simulator's decode node both run.

    The one rule it enforces: a lapsing entry is freed at the latest expiry D ever published for it,
    never sooner, and nothing is published for an entry once it lapses. An entry that keeps being
    renewed lives to its intended expiry (D never publishes beyond it).

    ``pool`` holds every entry at the time it may be freed: its intended expiry while it is renewed,
    its free time once it lapses (lapsing entries are never chosen again, so the pressure order of
    the renewed ones is unchanged). A holder of the pool may pop expired entries itself (the
    simulator's decode node, whose pool also serves the modes without give-back) and tell the ledger
    with :meth:`expired`.
    """

    __slots__ = ("rules", "pool", "_published", "lapsing", "lapsing_blocks")

    def __init__(self, rules: GiveBack, pool: RetainedPool | None = None) -> None:
        self.rules = rules
        self.pool = pool if pool is not None else RetainedPool()
        self._published: dict[Hashable, float] = {}  # every entry: the latest expiry D published (only grows)
        self.lapsing: dict[Hashable, float] = {}  # the lapsing entries -> when their renewals stopped
        self.lapsing_blocks = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._published

    def __len__(self) -> int:
        return len(self._published)

    def add(self, key: Hashable, blocks: int, finished_at: float, intended_expiry: float) -> float:
        """A finished turn is retained: the expiry to publish with it."""
        if key in self._published:
            raise ValueError(f"entry {key!r} is already retained")
        published = self.rules.published_expiry(intended_expiry, finished_at)
        self._published[key] = published
        self.pool.add(key, blocks, intended_expiry)
        return published

    def renew(self, key: Hashable, now: float) -> float | None:
        """The router asks before it sends a turn to P (or a client's heartbeat reaches D): the expiry to
        publish now, or None when the entry is lapsing or gone (then the router forwards nothing newer:
        P reads only before the expiry it already has, if that is still ahead)."""
        last = self._published.get(key)
        if last is None or key in self.lapsing:
            return None
        new = self.rules.published_expiry(self.pool.expiry(key), now)  # type: ignore[arg-type]
        if new > last:
            self._published[key] = last = new
        return last

    def extend(self, key: Hashable, intended_expiry: float) -> None:
        """The retention policy moved the intended expiry (a lease's heartbeat): later only."""
        if key in self._published and key not in self.lapsing:
            pool = self.pool
            if intended_expiry > pool.expiry(key):  # type: ignore[operator]
                pool.add(key, pool.discard(key), intended_expiry)

    def withhold_for(self, shortfall_blocks: int, now: float) -> list[Hashable]:
        """Stop renewing the entries :func:`releases` names for ``shortfall_blocks``: they lapse at their
        last published expiry (their place in ``pool`` moves there). Returns them."""
        pool, lapsing, free_at = self.pool, self.lapsing, self.rules.free_at
        keys = releases(pool, shortfall_blocks, lapsing)
        for key in keys:
            blocks = pool.discard(key)
            pool.add(key, blocks, free_at(self._published[key], now))
            lapsing[key] = now
            self.lapsing_blocks += blocks
        return keys

    def withheld_at(self, key: Hashable) -> float | None:
        """When the entry's renewals stopped (None: still renewed, or unknown)."""
        return self.lapsing.get(key)

    def is_lapsing(self, key: Hashable) -> bool:
        return key in self.lapsing

    def published(self, key: Hashable) -> float | None:
        return self._published.get(key)

    def free_at(self, key: Hashable) -> float:
        """When the entry may be freed: once lapsing, its last published expiry (or when it lapsed, if
        that was later); else its intended expiry."""
        free_at = self.pool.expiry(key)
        if free_at is None:
            raise KeyError(key)
        return free_at

    def due(self, now: float) -> list[Hashable]:
        """Entries that may be freed at ``now``."""
        return [k for k in self._published if now >= self.free_at(k)]

    def remove(self, key: Hashable) -> int:
        """The entry is gone (freed when due, or read and released by its reader): the blocks it held."""
        blocks = self.pool.discard(key)
        self.expired(key, blocks)
        return blocks

    def expired(self, key: Hashable, blocks: int) -> float | None:
        """The entry of ``blocks`` left ``pool`` at its free time (its holder popped it): forgotten.
        Returns when it was withheld if it lapsed (None if it was renewed to the end, or unknown)."""
        if self._published.pop(key, None) is None:
            return None
        withheld_at = self.lapsing.pop(key, None)
        if withheld_at is not None:
            self.lapsing_blocks -= blocks
        return withheld_at
