"""/metrics is no cross-tenant oracle. With API keys, metrics need their own token
by default, and nothing an observer can read tells "another tenant holds this id" from "unknown id"."""

from __future__ import annotations

import asyncio

from tests.router.harness import Deployment

KEYS = {"alice": "key-a", "bob": "key-b"}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_with_keys_metrics_are_closed_without_their_token():
    async def body():
        async with Deployment(keys=KEYS) as dep:
            for key in (None, KEYS["alice"], "wrong"):
                status, text = await dep.get("/metrics", key=key)
                assert status in (401, 403), (key, status)
                assert b"bidikv_router_" not in text
            # a tenant's key on /health learns nothing about other tenants' conversations either
            await dep.chat([{"role": "user", "content": "a"}], conversation_id="c1", key=KEYS["alice"])
            await dep.settle()
            status, text = await dep.get("/health")
            assert status == 200 and b"conversations" not in text
    run(body())


def test_metrics_token_opens_them_and_open_metrics_is_an_explicit_choice():
    async def body():
        async with Deployment(keys=KEYS) as dep:
            dep.router.metrics_token = "m-token"
            status, _ = await dep.get("/metrics", key="m-token")
            assert status == 200
            status, _ = await dep.get("/metrics", key=KEYS["bob"])
            assert status == 401
        async with Deployment(keys=KEYS, open_metrics=True) as dep:
            status, _ = await dep.get("/metrics")
            assert status == 200
        async with Deployment() as dep:  # no keys: one tenant, nobody to hide anything from
            status, _ = await dep.get("/metrics")
            assert status == 200
    run(body())


def test_guessing_another_tenants_id_looks_like_an_unknown_id_in_metrics():
    async def body():
        async with Deployment(keys=KEYS) as dep:
            dep.router.metrics_token = "m-token"
            r = await dep.chat([{"role": "user", "content": "secret plan"}], conversation_id="alice-1", key=KEYS["alice"])
            assert r.status == 200
            await dep.settle()
            _, before = await dep.get("/metrics", key="m-token")
            # bob guesses alice's id, then an id nobody holds: each must move the same counters
            await dep.chat([{"role": "user", "content": "guess"}], conversation_id="alice-1", key=KEYS["bob"])
            _, after_right = await dep.get("/metrics", key="m-token")
            await dep.chat([{"role": "user", "content": "guess"}], conversation_id="nobody-1", key=KEYS["bob"])
            _, after_wrong = await dep.get("/metrics", key="m-token")

        def misses(text: bytes) -> dict[str, float]:
            out = {}
            for line in text.decode().splitlines():
                if line.startswith("bidikv_router_reuse_misses_total"):
                    name, value = line.rsplit(" ", 1)
                    out[name] = float(value)
            return out

        def delta(a: dict, b: dict) -> dict:
            return {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b) if b.get(k, 0) != a.get(k, 0)}

        assert delta(misses(before), misses(after_right)) == delta(misses(after_right), misses(after_wrong))
        assert b'reason="tenant"' not in after_wrong
    run(body())
