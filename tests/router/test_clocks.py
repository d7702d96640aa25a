"""D's clock is not the router's.

``remote_blocks_expiry_time`` is D's ``time.perf_counter()``: on another host, or a D started at
another time, it has nothing to do with the router's ``time.monotonic()``. Every other fake D in the
suite shares the router's host clock, so a router reading D's absolute time as its own would pass
them all. :class:`OffsetClockDecode` is a fake D (tests.router.fakes) whose clock is offset (ahead or
behind by a day, or by ten minutes) and runs fast by a part in a thousand; it publishes its expiry on
that clock, tells the router how long it holds the blocks (``expires_in_s``, in the notification and
in its heartbeat answers) and runs a heartbeat listener speaking impl.connector.heartbeat's protocol.

What must hold whatever the offset: the router's entry expires ``expires_in_s`` after it heard from
D, on the router's clock (bracketed by the router's clock read before and after, not timed); P gets
D's ``remote_blocks_expiry_time`` verbatim, on D's clock; and the next turn reuses the KV.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.router.fakes import D_TTL_S, FakeHeartbeatDecode
from tests.router.harness import Deployment

LEASE_S = 30.0  # D's lease: far below the router's assumed decoder_kv_blocks_ttl (480 s)
RENEW_TO_S = 200.0
RATE = 1.001  # D's clock runs a part in a thousand fast
OFFSETS = [-86_400.0, 86_400.0, 600.0]  # D's clock a day behind, a day ahead, ten minutes ahead


@dataclass
class OffsetClockDecode(FakeHeartbeatDecode):
    """Fake D on its own clock (see the module docstring)."""

    offset_s: float = 0.0
    hold_s: float = D_TTL_S  # how long D holds a finished turn's blocks, in D's seconds

    def d_clock(self) -> float:
        return self.offset_s + RATE * time.monotonic()

    def _d_params(self, body: dict[str, Any]) -> dict[str, Any]:
        params = super()._d_params(body)
        params["remote_blocks_expiry_time"] = self.d_clock() + self.hold_s
        self.held[params["remote_request_id"]] = params["remote_blocks_expiry_time"]
        return params

    async def _notify(self, body: dict[str, Any], params: dict[str, Any]) -> None:
        spec = (body.get("kv_transfer_params") or {}).get("bidikv_notify")
        if not spec:
            return
        payload = {"turn": spec["turn"], "token": spec["token"], "kv_transfer_params": params,
                   "expires_in_s": params["remote_blocks_expiry_time"] - self.d_clock(),
                   "heartbeat_url": f"http://127.0.0.1:{self.hb_port}/bidikv/heartbeat"}
        async with self._session.post(spec["url"], json=payload, timeout=aiohttp.ClientTimeout(total=2)) as r:
            self.notify_replies.append(r.status)

    async def _heartbeat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.heartbeats.append(body)
        now = self.d_clock()
        expiry = self.held.get(body.get("request_id"))
        if expiry is None or now > expiry:
            return web.json_response({"status": "not_held", "reason": "unknown"})
        self.held[body["request_id"]] = expiry = max(expiry, now + RENEW_TO_S)
        return web.json_response({"status": "held", "renewed": True, "retention": "lease", "expiry_time": expiry,
                                  "expires_in_s": expiry - now, "heartbeat_interval_s": 10.0})


def deployment(style: str, offset_s: float, hold_s: float) -> Deployment:
    dep = Deployment(style=style)
    dep.decodes = [OffsetClockDecode("d0", role="decode", style=style, offset_s=offset_s, hold_s=hold_s)]
    return dep


async def stored_entry(dep: Deployment, cid: str):
    """The router's stored entry for ``cid`` (the store's ``get`` may be awaited and versioned)."""
    got = dep.router.store.get("default", cid)
    if inspect.isawaitable(got):
        got = await got
    return getattr(got, "entry", got)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


async def stored_turn(dep: Deployment, cid: str):
    """One turn; returns (its result, the stored entry, router clock before, router clock after)."""
    before = time.monotonic()
    r = await dep.chat([user(f"{cid} q1")], conversation_id=cid)
    await dep.settle()
    after = time.monotonic()
    assert r.status == 200 and r.done and r.error is None
    entry = await stored_entry(dep, cid)
    assert entry is not None, "the turn was not stored (born expired on the router's clock?)"
    return r, entry, before, after


async def next_turn_reuses(dep: Deployment, cid: str, first, expected_expiry_on_d_clock: float) -> None:
    r = await dep.chat([user(f"{cid} q1"), {"role": "assistant", "content": first.answer}, user(f"{cid} q2")],
                       conversation_id=cid)
    assert r.status == 200 and r.done
    assert int(r.headers["X-Bidikv-Reuse-Offered-Tokens"]) > 0  # a hit: the entry was live on the router's clock
    sent = dep.p.prefill_requests()[-1]["kv_transfer_params"]
    assert sent["remote_blocks_expiry_time"] == expected_expiry_on_d_clock  # verbatim, on D's clock


@pytest.mark.parametrize("offset_s", OFFSETS)
async def test_final_chunk_expiry_is_kept_on_the_routers_clock(offset_s):
    """vLLM 0.33: the params come on the final chunk, without a duration; the router assumes its own
    decoder_kv_blocks_ttl from the end of D's stream and never reads D's absolute expiry."""
    async with deployment("final_chunk", offset_s, hold_s=D_TTL_S) as dep:
        ttl = dep.router.config.decoder_kv_blocks_ttl
        first, entry, before, after = await stored_turn(dep, "c")
        assert before + ttl <= entry.expires_at <= after + ttl
        await next_turn_reuses(dep, "c", first, dep.d.held[entry.kv_params["remote_request_id"]])


@pytest.mark.parametrize("offset_s", OFFSETS)
async def test_notified_expiry_is_d_s_duration_on_the_routers_clock(offset_s):
    """vLLM 0.32 + our connector: D's notification says how long it holds the blocks (a 30 s lease,
    shorter than the 480 s the router would assume); the router counts that from when it heard."""
    async with deployment("notify", offset_s, hold_s=LEASE_S) as dep:
        first, entry, before, after = await stored_turn(dep, "c")
        assert before + LEASE_S * 0.99 <= entry.expires_at <= after + LEASE_S
        issued = dep.d.held[entry.kv_params["remote_request_id"]]
        assert entry.kv_params["remote_blocks_expiry_time"] == issued
        await next_turn_reuses(dep, "c", first, issued)


@pytest.mark.parametrize("offset_s", OFFSETS)
async def test_heartbeat_renewal_is_d_s_duration_on_the_routers_clock(offset_s):
    async with deployment("notify", offset_s, hold_s=LEASE_S) as dep:
        first, entry, _, _ = await stored_turn(dep, "c")
        before = time.monotonic()
        r = await dep.post("/v1/conversations/c/heartbeat", {})
        after = time.monotonic()
        assert r.status == 200 and r.body["renewed"] is True, r.body
        assert dep.d.heartbeats == [{"request_id": entry.kv_params["remote_request_id"], "engine_id": "D-d0"}]
        renewed = await stored_entry(dep, "c")
        # D renewed to RENEW_TO_S of its seconds from when it answered, i.e. after the router sent
        assert before + RENEW_TO_S * 0.99 <= renewed.expires_at <= after + RENEW_TO_S
        assert r.body["expires_in_s"] <= RENEW_TO_S
        issued = dep.d.held[entry.kv_params["remote_request_id"]]
        assert renewed.kv_params["remote_blocks_expiry_time"] == issued  # what P checks: D's clock
        await next_turn_reuses(dep, "c", first, issued)
