"""``--learnt-retention-budget-tokens``: the router asks D for each turn's hold, learnt from what it sees.

The router sees every turn of every conversation it serves, including the conversations that never
come back and those that come back after D let their blocks go; :mod:`impl.policy.return_time` turns
that into a hold per turn within a budget of retained KV (tokens, summed over the fleet's D). The hold
goes to D with the turn, in the kv_transfer_params the router sends it (``bidikv_retention_s``); D's
connector keeps the turn's blocks that long, never longer than its own ``decoder_kv_blocks_ttl``.

What a turn looks like to the estimate: its tenant, its index in the conversation (a chat request: the
assistant messages it resends; otherwise counted here, per key, bounded like the store) and the time
since its conversation's previous turn ended. The returning key is the key the turn was looked up
under: the one its previous turn was stored under when the client resent the history or named the
conversation.

Tenants share the budget fairly (:mod:`impl.policy.tenant_shares`): each is priced against what the
others leave it, and a tenant still on the fallback hold is held only as long as its share allows.

One process's view: replicas behind a load balancer that spreads a conversation's turns over them each
see only the returns that come back to them, so each underestimates the return chance (a longer hold is
never asked for than the fleet's true figures would justify, a shorter one may be). Pin conversations to
a replica (by tenant or conversation) when using it with several.
"""

from __future__ import annotations

import collections
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Hashable

from impl.policy.return_time import Hold, LearntRetentionSettings
from impl.policy.tenant_shares import TenantShares

if TYPE_CHECKING:
    from impl.router.metrics import RouterMetrics
    from impl.router.request import TurnRequest

log = logging.getLogger("bidikv.router")

LOG_EVERY_S = 300.0  # the learnt figures go to the log at most this often (and at the first price)


@dataclass(slots=True)
class LearntTurn:
    """One turn's answer: the hold to ask D for and what :meth:`RouterRetention.finished` needs back."""

    hold: Hold
    group: Hashable
    index: int


class RouterRetention:
    def __init__(self, settings: LearntRetentionSettings, metrics: "RouterMetrics", clock: Callable[[], float],
                 max_entries: int, d_ttl_s: float) -> None:
        # a policy per tenant within its fair share of the budget: one tenant's flood (turns that never
        # return stay on the fallback hold) cannot take another's retention (impl.policy.tenant_shares)
        self.policy = TenantShares(settings)
        self.d_ttl_s = d_ttl_s  # D keeps no turn longer, whatever it is asked
        self.metrics = metrics
        self.clock = clock
        self.max_entries = max_entries
        # (tenant, key) -> the index of the turn that will come back under it (requests with no history to count)
        self._next_index: collections.OrderedDict[tuple[str, str], int] = collections.OrderedDict()
        self._logged_at = -math.inf
        policy = self.policy
        metrics.learnt_retention.read = lambda: {label: value for label, value in (
            (("budget_tokens",), settings.budget_size),
            (("price_per_token_s",), policy.price),
            (("planned_tokens",), policy.expected_held()),
            (("correction",), policy.correction),
            (("held_tokens",), policy.held_now()),
        ) if not math.isnan(value)}  # a figure not set yet is left out

    def arrived(self, turn: "TurnRequest", tenant: str, looked_up: tuple[str, str] | None) -> LearntTurn:
        now = self.clock()
        index = self._index(turn, looked_up)
        price_before = self.policy.price
        hold, group = self.policy.arrived(tenant, looked_up, index, now)
        m = self.metrics
        m.learnt_holds.inc(hold.kind)
        m.learnt_hold_seconds.inc(amount=hold.retention_s)
        if hold.learnt:
            m.learnt_expected_returns.inc(amount=hold.return_chance)
        if self.policy.price != price_before and not (math.isnan(price_before) and math.isnan(self.policy.price)):
            self._log(now)
        return LearntTurn(hold, group, index)

    def finished(self, learnt: LearntTurn, tenant: str, stored: tuple[str, str], tokens: int) -> None:
        """The turn was stored under ``stored`` and left ``tokens`` of KV on D (prompt + answer)."""
        held_s = learnt.hold.capped(self.d_ttl_s).retention_s
        self.policy.finished(stored, tenant, learnt.group, tokens, held_s, self.clock())
        self._next_index[stored] = learnt.index + 1
        self._next_index.move_to_end(stored)
        while len(self._next_index) > self.max_entries:
            self._next_index.popitem(last=False)

    def _index(self, turn: "TurnRequest", looked_up: tuple[str, str] | None) -> int:
        if turn.prompt_kind == "chat":
            return turn.answers_in_history()
        if looked_up is not None:
            return self._next_index.get(looked_up, 0)
        return 0

    def _log(self, now: float) -> None:
        if now - self._logged_at < LOG_EVERY_S:
            return
        self._logged_at = now
        p = self.policy
        log.info("learnt retention: price %.3g per token-second, planned %.0f tokens retained (x %.2f from the "
                 "ledger), held now %.0f of a budget of %.0f", p.price, p.expected_held(),
                 p.correction if p.correction > 0 else 1.0, p.held_now(), p.settings.budget_size)
