"""Retention learnt from what the router sees: how likely and how soon a conversation's next turn comes.

A fixed ``decoder_kv_blocks_ttl`` spends the same decode memory on every finished turn. On the public
Mooncake conversation trace two thirds of the turns never return, and whether one does depends on what
it looks like: a conversation's first turn returns 25 % of the time, its fourth 55 %, its seventh or later
78 %; a turn that came soon after the previous one returns sooner (``benchmarks/learnt_retention.py``
prints the table). Spending the memory where it is likely to be read keeps more reuse for the same
memory.

The router is where this can be learnt. It sees every turn of every conversation, including the
conversations that never return and those that return after their blocks expired; D sees only the
returns it served (a sample censored by its own retention, which is what :class:`GapQuantileTTL`
learns from). So:

* :class:`ReturnEstimator` -- the gap from a turn's finish to its conversation's next arrival, per group
  (tenant x feature bucket), as a return rate per bin of gaps: returns over the seconds turns spent in
  the bin, a turn still waiting (or dropped from tracking) counted for exactly as long as it was
  watched -- right-censoring handled as the maximum-likelihood estimate of a piecewise-constant rate
  does, so conversations still open never bias the estimate towards "they all come back" or "none
  do". Sparse groups borrow strength from their tenant's pooled rates (shrinkage with
  ``prior_weight`` turns' worth of exposure); gaps longer than any seen are extrapolated with a rate
  falling as 1/gap.
* :class:`LearntRetention` -- the decision. For a turn of group ``g`` keeping ``T`` seconds is worth the
  chance it is read within ``T`` and costs its blocks for the expected ``E[min(gap, T)]``; with one price
  ``lam`` per block-second the best ``T`` is the bin edge that maximises
  ``P(gap <= T) - lam * E[min(gap, T)]`` (value and memory both scale with the turn's blocks, so the
  choice is per group). ``lam`` is set, not tuned: the smallest price whose expected retained blocks
  (the recent turn rate x each recent turn's blocks x its expected hold) stay within ``budget_size``.
  Until a tenant has ``min_returns`` observed returns the answer is ``fallback_s`` (vLLM's TTL); while the
  price is above 0 no hold is longer than the gaps the tenant's turns have been watched through.

Both are pure (``now`` passed in, no I/O, no randomness) and bounded: the open table holds at most
``max_open`` turns, the mix window ``window_turns``; the simulator runs them verbatim.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import math
from dataclasses import dataclass, field
from typing import Callable, Hashable

from impl.policy.retention import VLLM_TTL_S

# Bin edges of the gap (seconds from a turn's finish to its conversation's next arrival): finer where
# most returns fall (Mooncake: p10 42 s, p50 126 s, p90 480 s), and the last edge is the longest hold
# the learnt retention ever answers.
DEFAULT_EDGES_S = (15.0, 30.0, 60.0, 90.0, 120.0, 180.0, 240.0, 360.0, 480.0, 720.0, 1200.0, 1800.0, 3600.0)

# Previous-gap buckets (seconds): where the next-turn chance changes on the Mooncake trace
PREVIOUS_GAP_EDGES_S = (60.0, 180.0, 480.0)
TURN_INDEX_BUCKETS = 4  # 0, 1, 2, and 3 or later

# The ledger's correction of the model (LearntRetention): each price setting weighs the latest
# realized/planned ratio this much (a few settings of memory), and never trusts one beyond this factor
CORRECTION_WEIGHT = 0.3
CORRECTION_BOUND = 4.0


# In the kv_transfer_params the router sends D with a turn: the seconds D should keep the turn's blocks
# after it finishes (the learnt hold). D's own retention policy stays the longest it keeps them.
RETENTION_KEY = "bidikv_retention_s"


def asked_retention_s(params: object) -> tuple[float | None, str | None]:
    """The hold asked for in D's kv_transfer_params: ``(seconds, None)``; ``(None, None)`` when absent;
    ``(None, why)`` when present but not a finite number of seconds >= 0 (D then applies its own)."""
    if not isinstance(params, dict) or RETENTION_KEY not in params:
        return None, None
    value = params[RETENTION_KEY]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, f"{RETENTION_KEY} must be a number of seconds, got {type(value).__name__}"
    if not (value >= 0 and math.isfinite(value)):
        return None, f"{RETENTION_KEY} must be finite and >= 0, got {value!r}"
    return float(value), None


@dataclass(frozen=True, slots=True)
class TurnShape:
    """What the router knows of a turn when it arrives: the features the estimate is grouped by.

    ``turn_index`` counts the conversation's earlier turns (for a chat request: its assistant
    messages); ``previous_gap_s`` is the time from the previous turn's finish to this arrival (None
    for a first turn, or when the router did not see the previous one)."""

    turn_index: int
    previous_gap_s: float | None = None

    def bucket(self) -> tuple[int, int]:
        turn = self.turn_index if 0 <= self.turn_index < TURN_INDEX_BUCKETS else TURN_INDEX_BUCKETS - 1
        gap = self.previous_gap_s
        if gap is None or not gap >= 0:  # a first turn, or a gap the router could not measure
            return (turn, -1)
        return (turn, bisect.bisect_right(PREVIOUS_GAP_EDGES_S, gap))


@dataclass(slots=True)
class _Counts:
    """Per bin: returns, the seconds closed turns spent in it, and the open turns in it now (how many,
    and the sum of the times they entered it: their exposure so far is ``open_n * now - open_entered``)."""

    returned: list[float]
    exposure: list[float]
    open_n: list[float]
    open_entered: list[float]

    @classmethod
    def empty(cls, bins: int) -> "_Counts":
        return cls([0.0] * bins, [0.0] * bins, [0.0] * bins, [0.0] * bins)

    def exposure_at(self, j: int, now: float) -> float:
        return self.exposure[j] + max(self.open_n[j] * now - self.open_entered[j], 0.0)


@dataclass(slots=True)
class _Open:
    key: Hashable
    group: Hashable
    tenant: Hashable
    finished_at: float
    next_bin: int  # the bin it is in now: edges below it have been crossed (and counted)
    live: bool = True


class ReturnEstimator:
    """Per-group survival of the finish-to-next-arrival gap, with right-censoring: a piecewise-constant
    return rate per bin, estimated as returns over exposure.

    ``finished(key, tenant, group, now)`` opens a turn; ``returned(key, now)`` closes it with an observed
    gap; a turn dropped from tracking (the bounded table is full, or its key finishes again) is closed
    as censored. Every turn adds to a bin's exposure the seconds it spent in it -- a whole bin's width
    once it has crossed it, the part up to its return or censoring in the bin where that happens, and,
    while still open, the part so far -- so a turn still waiting counts as "not back yet" for exactly as
    long as it has waited: the maximum-likelihood estimate of the rate under censoring. (Counting a bin
    only for turns watched through its end, as a product-limit table does, reads the wide late bins of a
    young deployment as mostly returns: returns are counted as they happen, survivors only once the
    whole bin has passed.) ``advance(now)`` moves open turns across the edges they passed (called by the
    other methods, so callers need not)."""

    __slots__ = ("edges", "_starts", "widths", "max_open", "prior_weight", "_open", "_queues", "_counts",
                 "_tenant_counts", "returns_by_tenant", "censored", "_clock")

    def __init__(self, edges_s: tuple[float, ...] = DEFAULT_EDGES_S, *, max_open: int = 200_000,
                 prior_weight: float = 20.0) -> None:
        if not edges_s or any(not (e > 0 and math.isfinite(e)) for e in edges_s) or list(edges_s) != sorted(set(edges_s)):
            raise ValueError(f"edges_s must be finite, positive and increasing, got {edges_s!r}")
        if max_open < 1:
            raise ValueError(f"max_open must be >= 1, got {max_open}")
        if not (prior_weight >= 0 and math.isfinite(prior_weight)):
            raise ValueError(f"prior_weight must be a finite number >= 0, got {prior_weight!r}")
        self.edges = tuple(float(e) for e in edges_s)
        self._starts = (0.0,) + self.edges[:-1]
        self.widths = [e - s for s, e in zip(self._starts, self.edges)]  # each bin's width, seconds
        self.max_open = max_open
        self.prior_weight = float(prior_weight)
        self._open: collections.OrderedDict[Hashable, _Open] = collections.OrderedDict()  # oldest finish first
        # one queue per bin of the open turns waiting to cross its end edge, in finish order (finishes
        # come in time order, so each queue is sorted and a crossing is found at its head)
        self._queues: list[collections.deque[_Open]] = [collections.deque() for _ in self.edges]
        self._counts: dict[Hashable, _Counts] = {}
        self._tenant_counts: dict[Hashable, _Counts] = {}
        self.returns_by_tenant: collections.Counter[Hashable] = collections.Counter()
        self.censored = 0  # open turns dropped before they returned or passed the last edge
        self._clock = -math.inf

    def __len__(self) -> int:
        return len(self._open)

    def _check_time(self, now: float) -> None:
        if math.isnan(now):
            raise ValueError("now must be a number")
        # a clock that steps back is not a reason to count a bin twice or a gap as negative: hold the clock
        if now > self._clock:
            self._clock = now

    def _tables(self, entry: _Open) -> tuple[_Counts, _Counts]:
        out = []
        for table, key in ((self._counts, entry.group), (self._tenant_counts, entry.tenant)):
            counts = table.get(key)
            if counts is None:
                table[key] = counts = _Counts.empty(len(self.edges))
            out.append(counts)
        return out[0], out[1]

    def _enter(self, entry: _Open, j: int) -> None:
        entered = entry.finished_at + self._starts[j]
        for counts in self._tables(entry):
            counts.open_n[j] += 1.0
            counts.open_entered[j] += entered

    def _leave(self, entry: _Open, j: int, at: float, returned: bool) -> None:
        """``entry`` leaves bin ``j`` at ``at``: across its end edge, by its return, or censored."""
        entered = entry.finished_at + self._starts[j]
        for counts in self._tables(entry):
            counts.open_n[j] -= 1.0
            counts.open_entered[j] -= entered
            counts.exposure[j] += at - entered
            if returned:
                counts.returned[j] += 1.0

    def advance(self, now: float) -> None:
        self._check_time(now)
        now = self._clock
        last = len(self.edges) - 1
        for j, queue in enumerate(self._queues):
            edge = self.edges[j]
            while queue and queue[0].finished_at + edge <= now:
                entry = queue.popleft()
                if not entry.live:
                    continue
                self._leave(entry, j, entry.finished_at + edge, returned=False)
                if j == last:  # survived the longest hold there is: no more to learn from it
                    entry.live = False
                    del self._open[entry.key]
                else:
                    entry.next_bin = j + 1
                    self._enter(entry, j + 1)
                    self._queues[j + 1].append(entry)

    def _censor(self, entry: _Open) -> None:
        entry.live = False
        self._leave(entry, entry.next_bin, self._clock, returned=False)
        self.censored += 1

    def finished(self, key: Hashable, tenant: Hashable, group: Hashable, now: float) -> None:
        """A turn finished: its conversation may come back as ``key``."""
        self.advance(now)
        old = self._open.pop(key, None)
        if old is not None:  # a second finish for one key before a return: the first is censored
            self._censor(old)
        if len(self._open) >= self.max_open:
            _, oldest = self._open.popitem(last=False)
            self._censor(oldest)
        entry = _Open(key, group, tenant, self._clock, 0)
        self._open[key] = entry
        self._enter(entry, 0)
        self._queues[0].append(entry)

    def returned(self, key: Hashable, now: float) -> float | None:
        """The conversation behind ``key`` sent its next turn at ``now``: the gap observed, or None when
        ``key`` is not open (never seen, already returned, passed the last edge, or dropped)."""
        self.advance(now)
        entry = self._open.pop(key, None)
        if entry is None:
            return None
        entry.live = False
        self._leave(entry, entry.next_bin, self._clock, returned=True)
        self.returns_by_tenant[entry.tenant] += 1
        return self._clock - entry.finished_at

    def rates(self, table: str, key: Hashable) -> tuple[list[float], list[float]] | None:
        """(returns, exposure seconds) per bin of a group (``table`` "group") or a tenant ("tenant"), now."""
        counts = (self._counts if table == "group" else self._tenant_counts).get(key)
        if counts is None:
            return None
        return list(counts.returned), [counts.exposure_at(j, self._clock) for j in range(len(self.edges))]

    def hazards(self, tenant: Hashable, group: Hashable) -> list[float]:
        """Per bin, the chance of returning in it given no return before it, from the bin's return rate.
        The group's rate is shrunk towards its tenant's, and that towards a prior rate, each by
        ``prior_weight`` turns' worth of exposure (that many bin widths): the prior is the tenant's own
        rate in the latest bin with that much exposure, carried into the bins beyond. So a bin no turn has
        been through yet (a young deployment has seen no long gaps) is extrapolated from the longest gaps
        seen -- not read as "nobody returns then", nor as "as often as in the first minute" (rates fall
        with the gap)."""
        m = self.prior_weight
        widths = self.widths
        now = self._clock
        pooled = self._tenant_counts.get(tenant)
        own = self._counts.get(group)
        out = []
        prior = 0.0  # until a bin has enough exposure of its own: the tenant's rate over all bins
        if pooled is not None:
            exposure = sum(pooled.exposure_at(j, now) for j in range(len(widths)))
            prior = sum(pooled.returned) / exposure if exposure > 0 else 0.0
        seen_mid = 0.0
        for j, w in enumerate(widths):
            r_t = pooled.returned[j] if pooled else 0.0
            e_t = pooled.exposure_at(j, now) if pooled else 0.0
            mid = self._starts[j] + w / 2.0
            if e_t > 0 and e_t >= m * w:
                prior, seen_mid = r_t / e_t, mid  # this bin's own rate: the prior of the bins beyond
            elif seen_mid > 0:
                # beyond the gaps seen, the rate falls as 1/gap from the last seen: a young deployment has
                # seen only its quick returns, and their rate carried to long gaps would hold memory for
                # returns nobody has observed (on the Mooncake trace it filled D and made turns wait)
                prior = prior * seen_mid / mid
                seen_mid = mid
            pseudo = m * w
            rate_t = (r_t + pseudo * prior) / (e_t + pseudo) if e_t + pseudo > 0 else prior
            r_g = own.returned[j] if own else 0.0
            e_g = own.exposure_at(j, now) if own else 0.0
            rate = (r_g + pseudo * rate_t) / (e_g + pseudo) if e_g + pseudo > 0 else rate_t
            out.append(-math.expm1(-rate * w))
        return out

    def seen_bins(self, tenant: Hashable) -> int:
        """How many bins, from the first, end at or before the latest one the tenant's turns have spent
        ``prior_weight`` turns' worth of time in: beyond it the estimate is extrapolation."""
        pooled = self._tenant_counts.get(tenant)
        if pooled is None:
            return 0
        m, now = max(self.prior_weight, 1.0), self._clock
        seen = 0
        for j, w in enumerate(self.widths):
            if pooled.exposure_at(j, now) >= m * w:
                seen = j + 1
        return seen

    def survival(self, tenant: Hashable, group: Hashable) -> list[float]:
        """P(no return by each edge)."""
        s, out = 1.0, []
        for h in self.hazards(tenant, group):
            s *= 1.0 - h
            out.append(s)
        return out


@dataclass(frozen=True, slots=True)
class LearntRetentionSettings:
    """How the learnt retention spends decode memory; every field has its reason in the module docstring."""

    # the retained KV the fleet may hold on average, in the unit the caller sizes turns in (the simulator:
    # blocks; the router: tokens); inf: only what a hold is worth limits it
    budget_size: float = math.inf
    fallback_s: float = VLLM_TTL_S  # until a tenant has min_returns returns: vLLM's decoder_kv_blocks_ttl
    min_returns: int = 20
    margin_s: float = 5.0  # P declines reads this close to expiry: a hold of T covers returns before T
    window_turns: int = 1024  # the recent turns whose rate, mix and sizes the price is set from
    refresh_every: int = 256  # turns between two settings of the price...
    refresh_interval_s: float = 60.0  # ...or seconds, whichever comes first (a quiet fleet still re-prices)
    edges_s: tuple[float, ...] = DEFAULT_EDGES_S
    max_open: int = 200_000
    prior_weight: float = 20.0

    @property
    def longest_hold_s(self) -> float:
        """The longest hold it ever asks for: D's TTL should be at least this, or D cuts the long ones short."""
        return self.edges_s[-1] + self.margin_s

    def __post_init__(self) -> None:
        if not (self.budget_size > 0):
            raise ValueError(f"budget_size must be > 0 (inf for no budget), got {self.budget_size!r}")
        if not (self.refresh_interval_s > 0 and math.isfinite(self.refresh_interval_s)):
            raise ValueError(f"refresh_interval_s must be a finite number of seconds > 0, got {self.refresh_interval_s!r}")
        for name in ("fallback_s", "margin_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        for name in ("min_returns", "window_turns", "refresh_every"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")


@dataclass(frozen=True, slots=True)
class Hold:
    """The learnt answer for one turn: keep its blocks ``retention_s`` after it finishes (0: free at
    once), expecting its conversation back within that with probability ``return_chance``."""

    retention_s: float
    return_chance: float
    learnt: bool  # False: the tenant has too few returns yet, this is the fallback TTL

    @property
    def kind(self) -> str:
        """"fallback" (too few returns yet), "none" (not worth its memory: freed at once) or "learnt"."""
        return "fallback" if not self.learnt else "none" if self.retention_s == 0.0 else "learnt"

    def capped(self, d_ttl_s: float) -> "Hold":
        """The hold D applies: D keeps no turn longer than its own TTL, whatever it is asked."""
        return self if self.retention_s <= d_ttl_s else Hold(d_ttl_s, self.return_chance, self.learnt)


@dataclass(slots=True)
class _Plan:
    """Per group, for the current price: the chosen last bin (-1: none) and its figures."""

    last_bin: int
    return_chance: float
    expected_hold_s: float


class LearntRetention:
    """Per-turn retention from :class:`ReturnEstimator`, within a decode-memory budget.

    The router calls :meth:`arrived` when a turn arrives (with the key its previous turn finished
    under, if any) and :meth:`finished` when it ends, with the KV it left and the hold it was given;
    :meth:`arrived`'s answer is the retention to ask D for. The price of a block-second is re-set every
    ``refresh_every`` arrivals or ``refresh_interval_s``, whichever comes first.

    The price is set from a model (the estimated gaps, the recent rate and sizes), and a model is off:
    holds decided at older prices are still held, gaps drift, a young estimate is wrong (on the Mooncake
    trace the ratio moves between 0.87 and 1.11 over the hour). So the policy also keeps its own ledger of what it has asked D to hold
    (each turn's KV from its finish until its conversation returns or its hold ends) and scales the
    model by how far the ledger's time average ran above or below the plan (an exponentially weighted
    ratio, ``correction``): feedback from what was held, not from a second model."""

    __slots__ = ("settings", "estimator", "price", "correction", "_planned", "_window", "_since_refresh", "_plans",
                 "_held_now", "_held_integral", "_held_clock", "_held_open", "_held_expiries", "_held_seq",
                 "_refreshed_at", "_integral_at_refresh", "_mix", "budget_for", "free_held", "_window_size")

    def __init__(self, settings: LearntRetentionSettings | None = None) -> None:
        self.settings = settings = settings or LearntRetentionSettings()
        self.estimator = ReturnEstimator(settings.edges_s, max_open=settings.max_open,
                                         prior_weight=settings.prior_weight)
        self._planned = math.nan
        self.price = math.nan  # per block-second, in units of one turn's reuse per block; nan: not set yet
        self.correction = math.nan  # realized / planned retained KV, smoothed; nan: not measured yet
        self._window: collections.deque[tuple[Hashable, Hashable, float, float]] = collections.deque(
            maxlen=settings.window_turns)  # (tenant, group, size, finished at)
        self._since_refresh = 0
        self._plans: dict[tuple[Hashable, Hashable], _Plan] = {}
        # groups whose turns take the longer of two plans in a share of cases: [longer plan, share, carried]
        self._mix: dict[tuple[Hashable, Hashable], list] = {}
        # the ledger: what is held now by this policy's own account, its time integral, and the holds
        # open (key -> (size, sequence number)) with their ends in a heap (stale entries skipped)
        self._held_now = 0.0
        self._held_integral = 0.0
        self._held_clock = -math.inf
        self._held_open: dict[Hashable, tuple[float, int]] = {}
        self._held_expiries: list[tuple[float, int, Hashable]] = []
        self._held_seq = 0
        self._refreshed_at = math.nan
        self._integral_at_refresh = 0.0
        # the budget to price against, given the retained KV the plans would keep at price 0 and the time
        # (None: settings.budget_size); impl.policy.tenant_shares gives each tenant its share through it
        self.budget_for: Callable[[float, float], float] | None = None
        self.free_held = math.nan  # the retained KV the plans would keep at price 0, at the last price setting
        self._window_size = 0.0  # the sizes in _window, summed

    def arrived(self, tenant: Hashable, returning_key: Hashable | None, turn_index: int,
                now: float) -> tuple[Hold, Hashable]:
        """A turn arrived: its hold and its group (pass both to :meth:`finished`). ``returning_key``: the
        key the conversation's previous turn finished under (None for a first turn)."""
        self._ledger_advance(now)
        gap = None
        if returning_key is not None:
            gap = self.estimator.returned(returning_key, now)
            open_hold = self._held_open.pop(returning_key, None)
            if open_hold is not None:  # P reads it now and D frees it: the hold ends
                self._held_now -= open_hold[0]
        group = (tenant, TurnShape(turn_index, gap).bucket())
        self._since_refresh += 1
        if (self._since_refresh >= self.settings.refresh_every or math.isnan(self.price)
                or not now - self._refreshed_at < self.settings.refresh_interval_s):
            self._since_refresh = 0
            self._refresh(now)
        return self.hold(tenant, group), group

    def finished(self, key: Hashable, tenant: Hashable, group: Hashable, size: float, retention_s: float,
                 now: float) -> None:
        """The turn ended: its conversation may come back as ``key``; it left ``size`` KV (in the budget's
        unit) on D, held ``retention_s`` (the :class:`Hold` it was given)."""
        self._ledger_advance(now)
        self.estimator.finished(key, tenant, group, now)
        size = float(size) if size > 0 else 0.0
        window = self._window
        if len(window) == window.maxlen:
            self._window_size -= window[0][2]
        window.append((tenant, group, size, now))
        self._window_size += size
        old = self._held_open.pop(key, None)
        if old is not None:  # a later turn under the same key replaces the earlier one's blocks on D
            self._held_now -= old[0]
        if size > 0 and retention_s > 0:  # an infinite hold stays in the ledger for good, as on D
            self._held_seq += 1
            self._held_open[key] = (size, self._held_seq)
            self._held_now += size
            heapq.heappush(self._held_expiries, (self._held_clock + retention_s, self._held_seq, key))

    def _ledger_advance(self, now: float) -> None:
        if math.isnan(now):
            raise ValueError("now must be a number")
        if now <= self._held_clock:
            return
        if self._held_clock == -math.inf:
            self._held_clock = now
            return
        heap, open_holds = self._held_expiries, self._held_open
        while heap and heap[0][0] <= now:
            ends, seq, key = heapq.heappop(heap)
            held = open_holds.get(key)
            if held is None or held[1] != seq:
                continue  # returned or replaced before it ended
            self._held_integral += self._held_now * (ends - self._held_clock)
            self._held_clock = max(self._held_clock, ends)
            self._held_now -= held[0]
            del open_holds[key]
        self._held_integral += self._held_now * (now - self._held_clock)
        self._held_clock = now

    def held_now(self) -> float:
        """What the policy has asked D to hold and is, by its own account, still held."""
        return max(self._held_now, 0.0)

    def token_rate(self, now: float, min_span_s: float) -> float:
        """The KV its recent turns left, per second: their sizes over the time since the oldest of them
        finished (at least ``min_span_s``, so two turns in one instant are not an infinite rate)."""
        window = self._window
        if not window:
            return 0.0
        return max(self._window_size, 0.0) / max(now - window[0][3], min_span_s)

    def hold(self, tenant: Hashable, group: Hashable) -> Hold:
        s = self.settings
        if self.estimator.returns_by_tenant[tenant] < s.min_returns or math.isnan(self.price):
            return Hold(s.fallback_s, math.nan, False)
        plan = self._plans.get((tenant, group))
        if plan is None:
            plan = self._plans[(tenant, group)] = self._plan(self._estimate(tenant, group), self.price)
        mix = self._mix.get((tenant, group))
        if mix is not None:  # error diffusion: exactly the share, deterministically spread over its turns
            mix[2] += mix[1]
            if mix[2] >= 1.0:
                mix[2] -= 1.0
                plan = mix[0]
        if plan.last_bin < 0:
            return Hold(0.0, 0.0, True)
        return Hold(s.edges_s[plan.last_bin] + s.margin_s, plan.return_chance, True)

    def _estimate(self, tenant: Hashable, group: Hashable) -> tuple[list[float], int]:
        """What a plan is made from: the group's hazards now and how many bins the tenant has seen."""
        return self.estimator.hazards(tenant, group), self.estimator.seen_bins(tenant)

    def _plan(self, estimate: tuple[list[float], int], price: float) -> _Plan:
        """The bin edge that maximises P(return by it) - price * E[hold up to it]; the earliest on ties
        (no block-second is spent where nothing more is expected)."""
        best = _Plan(-1, 0.0, 0.0)
        best_value = 0.0
        survive, hold, margin = 1.0, 0.0, self.settings.margin_s
        widths = self.estimator.widths
        hazards, seen = estimate
        if price > 0:
            # memory is scarce: none of it on gaps longer than those seen, which a young deployment knows
            # only by extrapolation (free memory may go there: its price is 0)
            hazards = hazards[:seen]
        for j, h in enumerate(hazards):
            hold += survive * widths[j] * (1.0 - h / 2.0)  # returns in a bin come, on average, halfway
            survive *= 1.0 - h
            held = hold + survive * margin  # the margin P needs is held too, by every turn not back by then
            value = (1.0 - survive) - price * held
            if value > best_value + 1e-12:
                best_value, best = value, _Plan(j, 1.0 - survive, held)
        return best

    def _measure(self, now: float) -> None:
        """Fold the ledger's average since the last price setting, against that setting's plan, into
        ``correction``."""
        span = now - self._refreshed_at
        if span > 0 and self._planned > 0:
            realized = (self._held_integral - self._integral_at_refresh) / span
            ratio = min(max(realized / self._planned, 1.0 / CORRECTION_BOUND), CORRECTION_BOUND)
            self.correction = ratio if math.isnan(self.correction) else (
                (1.0 - CORRECTION_WEIGHT) * self.correction + CORRECTION_WEIGHT * ratio)
        self._refreshed_at = now
        self._integral_at_refresh = self._held_integral

    def _refresh(self, now: float) -> None:
        """Set the price: the smallest whose expected retained KV, scaled by ``correction``, fits the budget."""
        self._measure(now)
        self._plans.clear()
        self._mix.clear()
        window = self._window
        span = now - window[0][3] if window else 0.0
        if len(window) < 2 or not span > 0:
            return  # no rate to speak of yet: keep the price (nan: the fallback answers)
        blocks_by_group: dict[tuple[Hashable, Hashable], float] = collections.defaultdict(float)
        for tenant, group, blocks, _ in window:
            blocks_by_group[(tenant, group)] += blocks
        estimates = {tg: self._estimate(*tg) for tg in blocks_by_group}  # the same at every price tried

        def held(price: float) -> float:
            return sum(b * self._plan(estimates[tg], price).expected_hold_s for tg, b in blocks_by_group.items()) / span

        free = self.free_held = held(0.0)
        size = self.settings.budget_size if self.budget_for is None else self.budget_for(free, now)
        budget = size / (self.correction if self.correction > 0 else 1.0)
        if free <= budget:
            self.price, self._planned = 0.0, free
            return
        lo, hi = -12.0, 1.0  # log10 of the price per second: from "keep anything" to "keep nothing"
        for _ in range(40):
            mid = (lo + hi) / 2.0
            if held(10.0 ** mid) > budget:
                lo = mid
            else:
                hi = mid
        self.price = 10.0 ** hi
        self._planned = held_hi = held(self.price)
        # The choice per group is one of a few bin edges, so the held memory is a step function of the
        # price: at the price found a whole group may have dropped from a long hold to none and left much
        # of the budget unspent. As a knapsack's relaxation does, the groups whose plan changes across the
        # step take the longer plan for the share of their turns that spends the budget exactly.
        held_lo = held(10.0 ** lo)
        if held_lo > held_hi:
            share = (budget - held_hi) / (held_lo - held_hi)
            for tg, estimate in estimates.items():
                longer = self._plan(estimate, 10.0 ** lo)
                if longer.last_bin != self._plan(estimate, self.price).last_bin:
                    self._mix[tg] = [longer, share, 0.0]
            self._planned = held_hi + share * (held_lo - held_hi)

    def expected_held(self) -> float:
        """What the plans of the last price setting hold on average, by the estimate before ``correction``
        (nan: not set yet): the figure the price was set against, from that setting's window."""
        return self._planned
