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
    assert holds[:2] == [480.0, 480.0] and holds[2:] == [0.0] * 4


@pytest.mark.parametrize("field, value", [("learnt_retention_budget_tokens", -1.0),
                                          ("learnt_retention_budget_tokens", float("nan")),
                                          ("learnt_retention_min_returns", 0), ("learnt_retention_fallback_s", -1.0)])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        RouterConfig(**{field: value})
