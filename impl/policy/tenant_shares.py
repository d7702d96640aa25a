"""The learnt-retention budget shared between tenants: one tenant's flood never takes another's holds.

One :class:`~impl.policy.return_time.LearntRetention` over every tenant prices them all against one
budget, and a tenant whose conversations never return stays on the fallback hold for good (it never
reaches ``min_returns``): those holds sat outside the budget, and the ledger's correction then squeezed
everyone else. On the router, tenant B's 1,283 first turns that never returned held 15,508 tokens against
a budget of 400 while tenant A's holds fell from a mean of 107.8 s to 14.4 s. So here:

* every tenant has its own :class:`LearntRetention` -- estimator, window, price and ledger -- so nothing of
  one tenant's traffic enters another's figures;
* the budget is shared max-min fairly by demand (water-filling). A tenant's demand is the retained KV its
  holds would keep if memory were free: a learnt tenant's plans at price 0
  (:attr:`LearntRetention.free_held`), a tenant on the fallback its token rate times ``fallback_s``. The
  *level* a tenant faces is what the others leave it: the others whose demand is below an equal split keep
  their demand, the rest is split equally. A tenant's share is ``min(demand, level)``, never less than
  ``min(demand, budget / n)`` for ``n`` tenants with a demand, never all of it while another wants some;
* a learnt tenant is priced against its level at each of its price settings (with its fresh demand); a
  tenant on the fallback is held ``min(fallback_s, level / token rate)`` -- what it keeps on average is its
  token rate times its hold (Little's law), so fallback holds count against the budget too.

Hence whatever another tenant sends, a tenant whose demand (times its ledger correction) stays within
``budget / n`` is priced and held exactly as if it were alone, and a flood shortens only the flooding
tenant's holds (``tests/policy/test_tenant_shares.py`` checks both as properties). Pure, like the rest of
impl/policy: ``now`` passed in, no I/O, no randomness. The tenants kept are bounded (``max_tenants``, least
recently active dropped); a demand older than the longest hold is no longer counted.
"""

from __future__ import annotations

import collections
import math
from typing import Hashable, Iterable

from impl.policy.return_time import Hold, LearntRetention, LearntRetentionSettings

# a token rate is measured over at least this long: two turns finishing in one instant are a burst, not
# an infinite rate that would cut a light tenant's fallback holds to nothing
RATE_MIN_SPAN_S = 1.0
MAX_TENANTS = 4096


def water_level(budget: float, others: Iterable[float]) -> float:
    """What ``budget`` leaves one tenant beside ``others`` (their demands) under max-min fairness: each
    other tenant whose demand is below an equal split of what is left keeps it, the rest is split equally
    between the tenant and the others that want more."""
    if math.isinf(budget):
        return budget
    demands = sorted(d for d in others if d > 0)
    left, n = budget, len(demands) + 1
    for d in demands:
        if d * n > left:
            break
        left -= d
        n -= 1
    return left / n


def fair_shares(budget: float, demands: dict[Hashable, float]) -> dict[Hashable, float]:
    """Each tenant's max-min fair share of ``budget``: ``min(demand, level it faces)``."""
    return {t: min(d, water_level(budget, (e for u, e in demands.items() if u != t))) for t, d in demands.items()}


class TenantShares:
    """:class:`LearntRetention` per tenant within a fair share of one budget (see the module docstring);
    the same calls as :class:`LearntRetention` (``arrived``, ``finished``) and its fleet-wide figures."""

    __slots__ = ("settings", "max_tenants", "_policies", "_demand")

    def __init__(self, settings: LearntRetentionSettings | None = None, max_tenants: int = MAX_TENANTS) -> None:
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be >= 1, got {max_tenants}")
        self.settings = settings or LearntRetentionSettings()
        self.max_tenants = max_tenants
        self._policies: collections.OrderedDict[Hashable, LearntRetention] = collections.OrderedDict()
        self._demand: dict[Hashable, tuple[float, float]] = {}  # tenant -> (demand, when it was measured)

    def policy(self, tenant: Hashable) -> LearntRetention:
        """The tenant's own policy (made on first sight; the least recently active beyond the bound go)."""
        policy = self._policies.get(tenant)
        if policy is None:
            policy = self._policies[tenant] = LearntRetention(self.settings)
            policy.budget_for = lambda free, now, tenant=tenant: self._priced(tenant, free, now)
            while len(self._policies) > self.max_tenants:
                old, _ = self._policies.popitem(last=False)
                self._demand.pop(old, None)
        else:
            self._policies.move_to_end(tenant)
        return policy

    def level(self, tenant: Hashable, now: float) -> float:
        """The most of the budget the other tenants leave ``tenant`` now."""
        budget = self.settings.budget_size
        if math.isinf(budget):
            return budget
        horizon = self.settings.longest_hold_s
        return water_level(budget, (d for t, (d, at) in self._demand.items() if t != tenant and now - at <= horizon))

    def _priced(self, tenant: Hashable, free: float, now: float) -> float:
        self._demand[tenant] = (free, now)
        return self.level(tenant, now)

    def arrived(self, tenant: Hashable, returning_key: Hashable | None, turn_index: int,
                now: float) -> tuple[Hold, Hashable]:
        policy = self.policy(tenant)
        hold, group = policy.arrived(tenant, returning_key, turn_index, now)
        if not hold.learnt:
            rate = policy.token_rate(now, RATE_MIN_SPAN_S)
            self._demand[tenant] = (rate * self.settings.fallback_s, now)
            if rate > 0:
                cap = self.level(tenant, now) / rate
                if cap < hold.retention_s:
                    hold = Hold(cap, hold.return_chance, False)
        return hold, group

    def finished(self, key: Hashable, tenant: Hashable, group: Hashable, size: float, retention_s: float,
                 now: float) -> None:
        self.policy(tenant).finished(key, tenant, group, size, retention_s, now)

    # -- fleet-wide figures (never per tenant: they would tell one tenant of another's traffic) --------
    def held_now(self) -> float:
        return sum(p.held_now() for p in self._policies.values())

    def expected_held(self) -> float:
        planned = [p.expected_held() for p in self._policies.values() if not math.isnan(p.expected_held())]
        return sum(planned) if planned else math.nan

    @property
    def price(self) -> float:
        """The highest tenant's price (nan: none set yet)."""
        prices = [p.price for p in self._policies.values() if not math.isnan(p.price)]
        return max(prices) if prices else math.nan

    @property
    def correction(self) -> float:
        """The largest tenant's ledger correction (nan: none measured yet)."""
        values = [p.correction for p in self._policies.values() if not math.isnan(p.correction)]
        return max(values) if values else math.nan

    def __len__(self) -> int:
        return len(self._policies)
