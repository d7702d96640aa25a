"""A give-back D (impl.policy.give_back) on scripted upstreams: before P reads a retained turn the router
asks D to renew it and forwards D's fresh expiry; a turn D gave back is a miss that says so; a renewal
that fails forwards the older expiry D published (P declines it when near), never a later one."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from impl.policy.give_back import RENEW_BEFORE_READ_KEY
from tests.router.harness import Deployment
from tests.router.test_heartbeat import FakeLeaseDecode, assistant, user

WINDOW_S = 15.0


@dataclass
class FakeGiveBackDecode(FakeLeaseDecode):
    """A D that publishes finish + WINDOW_S and asks to be renewed before each read; ``gb_mode``: renew |
    given_back | lapsing | down."""

    gb_mode: str = "renew"

    def _d_params(self, body: dict[str, Any]) -> dict[str, Any]:
        params = super()._d_params(body)
        params["remote_blocks_expiry_time"] = self.held[params["remote_request_id"]] = time.perf_counter() + WINDOW_S
        params[RENEW_BEFORE_READ_KEY] = True
        return params

    async def _heartbeat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.heartbeats.append(body)
        now = time.perf_counter()
        if self.gb_mode == "given_back":
            return web.json_response({"status": "not_held", "reason": "given_back"})
        if self.gb_mode == "lapsing":
            last = self.held[body["request_id"]]
            return web.json_response({"status": "held", "renewed": False, "given_back": True, "expiry_time": last,
                                      "expires_in_s": max(0.0, last - now)})
        self.held[body["request_id"]] = expiry = now + WINDOW_S
        return web.json_response({"status": "held", "renewed": True, "retention": "ttl", "expiry_time": expiry,
                                  "expires_in_s": 480.0})


def give_back_deployment(mode: str) -> Deployment:
    dep = Deployment(style="notify")
    dep.decodes = [FakeGiveBackDecode("d0", role="decode", style="notify", gb_mode=mode)]
    return dep


async def two_turns(dep: Deployment, cid: str):
    first = await dep.chat([user(f"{cid} q1")], conversation_id=cid)
    assert first.status == 200 and first.error is None
    await dep.settle()
    stored = dep.router.store.get("default", cid)
    assert stored is not None and stored.kv_params[RENEW_BEFORE_READ_KEY] is True
    history = [user(f"{cid} q1"), assistant(first.answer), user(f"{cid} q2")]
    before = time.perf_counter()
    second = await dep.chat(history, conversation_id=cid)
    assert second.status == 200 and second.error is None
    return stored, before, second


async def test_the_router_renews_a_give_back_turn_before_p_reads_it_and_forwards_the_fresh_expiry():
    async with give_back_deployment("renew") as dep:
        stored, before, second = await two_turns(dep, "gb-renew")
        d = dep.decodes[0]
        assert d.heartbeats == [{"request_id": stored.kv_params["remote_request_id"], "engine_id": "D-d0"}]
        sent = dep.p.prefill_requests()[-1]["kv_transfer_params"]
        assert sent["remote_request_id"] == stored.kv_params["remote_request_id"]
        # D's answer, not the stored one: renewed from the time the router asked
        assert sent["remote_blocks_expiry_time"] == d.held[stored.kv_params["remote_request_id"]]
        assert sent["remote_blocks_expiry_time"] >= before + WINDOW_S > stored.kv_params["remote_blocks_expiry_time"]
        assert "X-Bidikv-Reuse-Given-Back" not in second.headers
        assert 'bidikv_router_give_back_renewals_total{outcome="renewed"} 1' in dep.router.metrics.registry.render()


async def test_a_turn_d_gave_back_is_a_miss_that_says_so():
    async with give_back_deployment("given_back") as dep:
        _, _, second = await two_turns(dep, "gb-gone")
        sent = dep.p.prefill_requests()[-1]["kv_transfer_params"]
        assert sent.get("remote_block_ids") is None and sent.get("remote_request_id") is None  # a fresh turn
        assert second.headers.get("X-Bidikv-Reuse-Given-Back") == "1"
        assert 'bidikv_router_reuse_misses_total{reason="given_back"} 1' in dep.router.metrics.registry.render()


async def test_a_lapsing_turn_is_offered_only_until_the_expiry_d_published_and_a_failed_renewal_never_extends():
    for mode in ("lapsing", "down"):
        async with give_back_deployment(mode) as dep:
            if mode == "down":
                await dep.decodes[0].stop_listener()
            stored, _, second = await two_turns(dep, f"gb-{mode}")
            sent = dep.p.prefill_requests()[-1]["kv_transfer_params"]
            assert sent["remote_request_id"] == stored.kv_params["remote_request_id"]
            assert sent["remote_blocks_expiry_time"] == stored.kv_params["remote_blocks_expiry_time"], mode
            outcome = "lapsing" if mode == "lapsing" else "unreachable"
            assert f'bidikv_router_give_back_renewals_total{{outcome="{outcome}"}} 1' in \
                dep.router.metrics.registry.render()


def on_d_give_back_deployment(mode: str, lapsed_s: float) -> Deployment:
    dep = Deployment(style="notify", prefill_on_d="isl_bounding", prefill_on_d_lapsed_s=lapsed_s)
    dep.decodes = [FakeGiveBackDecode("d0", role="decode", style="notify", gb_mode=mode)]
    return dep


async def test_with_prefill_on_d_a_given_back_conversation_goes_to_d_within_lapsed_s():
    """D gave the turn back: its blocks may still be in D's prefix cache. Within --prefill-on-d-lapsed-s of
    the entry being stored the turn goes to D (a lapsed hold); beyond it, or with the default 0, P recomputes."""
    async with on_d_give_back_deployment("given_back", lapsed_s=60.0) as dep:
        _, _, second = await two_turns(dep, "gb-on-d")
        assert second.headers["X-Bidikv-Path"] == "prefill_on_d", second.headers
        assert second.headers["X-Bidikv-Reuse-Given-Back"] == "1"
        assert len(dep.p.received) == 1  # the first turn only
        sent = dep.decodes[0].decode_requests()[-1]["kv_transfer_params"]
        assert sent["do_remote_prefill"] is False and "remote_block_ids" not in sent
    async with on_d_give_back_deployment("given_back", lapsed_s=0.0) as dep:
        _, _, second = await two_turns(dep, "gb-on-p")
        assert second.headers["X-Bidikv-Path"] == "recompute_on_p", second.headers
        assert second.headers["X-Bidikv-Path-Reason"] == "lapsed_too_long"
        assert len(dep.p.received) == 2
