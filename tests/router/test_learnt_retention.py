"""``--learnt-retention-budget-tokens``: what the router asks D to hold per turn, and what it tells about it.

On scripted upstreams (their requests can be read back); the real D applying the hold is
tests/e2e/test_learnt_retention.py.
"""

from __future__ import annotations

import pytest

from impl.policy.return_time import RETENTION_KEY
from impl.router.config import RouterConfig
from tests.e2e.deployment import parse_prometheus
from tests.router.harness import Deployment


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


async def _conversations(dep: Deployment, n: int, turns: int) -> None:
    for c in range(n):
        history = [user(f"conversation {c}")]
        for k in range(turns):
            r = await dep.chat(history)
            assert r.status == 200
            await dep.settle()
            history += [assistant(r.answer), user(f"and then {k}")]


def _metric(text: str, name: str, **labels: str) -> float | None:
    values = [v for n, lab, v in parse_prometheus(text) if n == name and all(lab.get(k) == w for k, w in labels.items())]
    return sum(values) if values else None


async def test_off_by_default_d_gets_no_hold():
    async with Deployment() as dep:
        await _conversations(dep, 2, 2)
        assert all(RETENTION_KEY not in (b.get("kv_transfer_params") or {}) for b in dep.d.decode_requests())
        metrics = (await dep.get("/metrics"))[1].decode()
    assert _metric(metrics, "bidikv_router_learnt_retention_holds_total") is None


async def test_fallback_until_enough_returns_then_learnt_holds():
    async with Deployment(learnt_retention_budget_tokens=float("inf"), learnt_retention_min_returns=3) as dep:
        await _conversations(dep, 4, 3)
        holds = [b["kv_transfer_params"][RETENTION_KEY] for b in dep.d.decode_requests()]
        metrics = (await dep.get("/metrics"))[1].decode()
    # returns seen at each arrival (its own included): 0,1,2 | 2,3,4 | ...: four turns on D's TTL, then learnt
    assert holds[:4] == [480.0] * 4  # --learnt-retention-fallback-s
    assert all(0 < h < 480.0 for h in holds[4:]) and len(holds) == 12
    assert _metric(metrics, "bidikv_router_learnt_retention_holds_total", kind="fallback") == 4
    assert _metric(metrics, "bidikv_router_learnt_retention_holds_total", kind="learnt") == 8
    assert _metric(metrics, "bidikv_router_learnt_retention_hold_seconds_total") == pytest.approx(sum(holds))
    assert 0 < _metric(metrics, "bidikv_router_learnt_retention_expected_returns_total") <= 8
    assert _metric(metrics, "bidikv_router_learnt_retention", figure="price_per_token_s") == 0.0
    assert _metric(metrics, "bidikv_router_learnt_retention", figure="held_tokens") > 0


async def test_a_budget_too_small_for_any_hold_asks_d_to_keep_nothing():
    async with Deployment(learnt_retention_budget_tokens=1, learnt_retention_min_returns=1) as dep:
        await _conversations(dep, 3, 2)
        holds = [b["kv_transfer_params"][RETENTION_KEY] for b in dep.d.decode_requests()]
    # fallback holds count against the budget: only the very first turn, before any rate is known, gets D's
    # TTL; the second is held as long as 1 token of budget allows its ~100-token turns (impl.policy.tenant_shares)
    assert holds[0] == 480.0 and 0 < holds[1] < 1.0 and holds[2:] == [0.0] * 4


@pytest.mark.parametrize("field, value", [("learnt_retention_budget_tokens", -1.0),
                                          ("learnt_retention_budget_tokens", float("nan")),
                                          ("learnt_retention_min_returns", 0), ("learnt_retention_fallback_s", -1.0)])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        RouterConfig(**{field: value})


async def test_a_tenants_flood_of_turns_that_never_return_is_held_within_its_share_not_on_ds_ttl():
    """Tenant B's first turns that never return used to keep the fallback hold (D's TTL) outside the
    budget; now they count against B's share (impl.policy.tenant_shares) and A's first turn is untouched."""
    keys = {"tenantA": "key-a", "tenantB": "key-b"}
    async with Deployment(keys=keys, learnt_retention_budget_tokens=400, learnt_retention_min_returns=5,
                          decoder_kv_blocks_ttl=3605) as dep:
        for i in range(30):
            r = await dep.chat([user(f"B flood {i}")], key="key-b")
            assert r.status == 200
        await dep.settle()
        a = await dep.chat([user("A first")], key="key-a")
        assert a.status == 200
        holds = [b["kv_transfer_params"][RETENTION_KEY] for b in dep.d.decode_requests()]
    b_holds, a_hold = holds[:30], holds[30]
    assert b_holds[0] == 480.0 and max(b_holds[1:]) < 480.0 / 4  # B's rate is known from its second turn on
    assert a_hold == 480.0  # A's fallback, whatever B sent
    # what B's holds keep on average (tokens x seconds over the flood's rate) is its share, not 30 TTLs
    assert sum(b_holds[1:]) < 0.05 * 29 * 480.0
