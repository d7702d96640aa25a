"""D's heartbeat answers are checked, not trusted: only an explicit, well-formed ``held`` keeps blocks on
offer, a not_held reason is one of a closed set, the expiry D answers is bounded by what it published,
and a listener that hangs is skipped for ``--heartbeat-retry-s`` instead of costing every turn its timeout.

The D here is :class:`FakeGiveBackDecode` / :class:`FakeLeaseDecode` (fakes: scripted answers a real
connector never gives, which is the point)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tests.router.test_give_back_renewal import FakeGiveBackDecode, two_turns
from tests.router.harness import Deployment
from tests.router.test_heartbeat import FakeLeaseDecode, assistant, first_turn, heartbeat, lease_deployment, user


@dataclass
class ScriptedAnswerDecode(FakeGiveBackDecode):
    """A give-back D whose listener answers ``answer`` (a dict sent as JSON) or hangs ``hang_s``."""

    answer: Any = None
    hang_s: float = 0.0

    async def _heartbeat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.heartbeats.append(body)
        if self.hang_s:
            await asyncio.sleep(self.hang_s)
        if self.answer is not None:
            return web.json_response(self.answer)
        return await super()._heartbeat(request)


def scripted(answer: Any = None, **config: Any) -> Deployment:
    dep = Deployment(style="notify", **config)
    dep.decodes = [ScriptedAnswerDecode("d0", role="decode", style="notify", answer=answer)]
    return dep


async def test_a_not_held_answer_with_a_reason_the_router_does_not_know_is_not_held_and_its_label_is_closed():
    reason = "\x1b[31mDROP TABLE " + "x" * 500
    async with scripted({"status": "not_held", "reason": reason}) as dep:
        _, _, second = await two_turns(dep, "gb-odd")
        sent = dep.p.prefill_requests()[-1]["kv_transfer_params"]
        assert sent.get("remote_block_ids") is None and sent.get("remote_request_id") is None  # not offered
        assert second.headers["X-Bidikv-Reuse-Offered-Tokens"] == "0"
        metrics = dep.router.metrics.registry.render()
        assert 'bidikv_router_give_back_renewals_total{outcome="other"} 1' in metrics
        assert "DROP TABLE" not in metrics and "\x1b" not in metrics
        assert 'bidikv_router_reuse_misses_total{reason="not_held"} 1' in metrics


async def test_a_renewal_answer_that_is_not_well_formed_held_is_not_held():
    for answer in ({"status": "held"}, {"status": "maybe", "renewed": True, "expiry_time": 1.0, "expires_in_s": 1.0},
                   ["held"]):
        async with scripted(answer) as dep:
            await two_turns(dep, "gb-bad")
            sent = dep.p.prefill_requests()[-1]["kv_transfer_params"]
            assert sent.get("remote_block_ids") is None, answer  # never offered on a malformed answer


async def test_a_renewal_expiry_beyond_what_d_published_is_clamped():
    for far in (1e9, 1.7e308):
        async with scripted() as dep:
            d = dep.decodes[0]
            d.answer = None
            first = await dep.chat([user("gb-far q1")], conversation_id="gb-far")
            await dep.settle()
            stored = dep.router.store.get("default", "gb-far")
            published = stored.kv_params["remote_blocks_expiry_time"]
            d.answer = {"status": "held", "renewed": True, "expiry_time": time.perf_counter() + far,
                        "expires_in_s": far}
            second = await dep.chat([user("gb-far q1"), assistant(first.answer), user("gb-far q2")],
                                    conversation_id="gb-far")
            elapsed = time.monotonic() - stored.stored_at
            assert second.status == 200
            sent = dep.p.prefill_requests()[-1]["kv_transfer_params"]
            assert sent["remote_request_id"] == stored.kv_params["remote_request_id"]  # held: offered
            # at most the published expiry moved on by the time that passed (plus the slack for D's clock)
            assert published < sent["remote_blocks_expiry_time"] <= published + elapsed + 2.0 + 1e-6, far


@dataclass
class AbsurdLeaseDecode(FakeLeaseDecode):
    """A lease D whose listener renews by a billion seconds."""

    async def _heartbeat(self, request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"status": "held", "renewed": True, "retention": "lease",
                                  "expiry_time": time.perf_counter() + 1e9, "expires_in_s": 1e9})


async def test_a_heartbeat_expiry_beyond_ds_retention_is_clamped():
    dep = lease_deployment()
    dep.decodes = [AbsurdLeaseDecode("d0", role="decode", style="notify")]
    async with dep:
        _, entry = await first_turn(dep, "c")
        t0 = time.monotonic()
        r = await heartbeat(dep, "c")
        assert r.status == 200 and r.body["renewed"] is True
        ttl = dep.router.config.decoder_kv_blocks_ttl
        assert r.body["expires_in_s"] <= ttl + 1e-3
        renewed = dep.router.store.get("default", "c")
        assert renewed.expires_at <= t0 + ttl + 1.0
        published = entry.kv_params["remote_blocks_expiry_time"]
        assert renewed.kv_params["remote_blocks_expiry_time"] <= published + (time.monotonic() - entry.stored_at) + ttl + 2.0


async def test_a_hung_listener_is_skipped_so_reuse_turns_do_not_each_wait_the_heartbeat_timeout():
    async with scripted(heartbeat_timeout_s=0.5) as dep:
        d = dep.decodes[0]
        durations = []
        for i in range(4):
            cid = f"gb-hang-{i}"
            first = await dep.chat([user(f"{cid} q1")], conversation_id=cid)
            await dep.settle()
            d.hang_s = 5.0
            t0 = time.monotonic()
            second = await dep.chat([user(f"{cid} q1"), assistant(first.answer), user(f"{cid} q2")], conversation_id=cid)
            durations.append(time.monotonic() - t0)
            d.hang_s = 0.0
            assert second.status == 200 and second.error is None
        assert durations[0] >= 0.5  # the first one waits out the timeout...
        assert all(t < 0.4 for t in durations[1:]), durations  # ...the others skip the hung listener
        metrics = dep.router.metrics.registry.render()
        assert 'bidikv_router_give_back_renewals_total{outcome="timeout"} 1' in metrics
        assert 'bidikv_router_give_back_renewals_total{outcome="skipped"} 3' in metrics
        # skipped is "said nothing": the turns are still offered, with the expiry D published
        assert all(r["kv_transfer_params"].get("remote_request_id") for r in dep.p.prefill_requests()[1::2])


async def test_a_skipped_listener_is_asked_again_after_the_retry_time():
    async with scripted(heartbeat_timeout_s=0.3, heartbeat_retry_s=0.5) as dep:
        d = dep.decodes[0]
        _, entry = await first_turn(dep, "c")
        d.hang_s = 2.0
        assert (await heartbeat(dep, "c")).status == 504
        assert (await heartbeat(dep, "c")).status == 503  # skipped, at once
        d.hang_s = 0.0
        await asyncio.sleep(0.6)
        r = await heartbeat(dep, "c")
        assert r.status == 200, r.body
        assert dep.router.heartbeats.outcomes.get("skipped") == 1
