"""Client heartbeats through the router, on scripted upstreams: the relay to the D holding the
conversation, the store update, tenant isolation, and every way D can fail to answer.

:class:`FakeLeaseDecode` is a fake: a scripted D (tests.router.fakes) that also runs a fake of the
connector's heartbeat listener (impl.connector.heartbeat's protocol, not its code) and advertises it
in its notifications the way the connector does.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings, strategies as st

from impl.router.heartbeat import HeartbeatDirectory, _parse_answer
from impl.router.notify import NotifyError, parse_notification
from tests.router.fakes import FakeHeartbeatDecode
from tests.router.harness import Deployment

LEASE_S = 30.0
RENEW_TO_S = 120.0  # what the fake D's lease extends to: far from LEASE_S, so a renewal is visible


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


@dataclass
class FakeLeaseDecode(FakeHeartbeatDecode):
    """Fake D with a lease and a fake heartbeat listener (see the module docstring)."""

    # None | "down" (listener gone) | "slow" | "busy" (503) | "garbage" | "huge" | "not_held" | "ttl" (held, never renewed)
    hb_fault: str | None = None
    advertise: bool = True  # put heartbeat_url in the notification (the connector does when it listens)

    def _d_params(self, body: dict[str, Any]) -> dict[str, Any]:
        params = super()._d_params(body)
        params["remote_blocks_expiry_time"] = time.perf_counter() + LEASE_S
        self.held[params["remote_request_id"]] = params["remote_blocks_expiry_time"]
        return params

    async def _notify(self, body: dict[str, Any], params: dict[str, Any]) -> None:
        spec = (body.get("kv_transfer_params") or {}).get("bidikv_notify")
        if not spec:
            return
        payload = {"turn": spec["turn"], "token": spec["token"], "kv_transfer_params": params, "expires_in_s": LEASE_S}
        if self.advertise:
            # D advertises VLLM_NIXL_SIDE_CHANNEL_HOST; a name the router cannot resolve proves it rewrites it
            payload["heartbeat_url"] = f"http://d-side-channel.invalid:{self.hb_port}/bidikv/heartbeat"
        async with self._session.post(spec["url"], json=payload, timeout=aiohttp.ClientTimeout(total=2)) as r:
            self.notify_replies.append(r.status)

    async def _heartbeat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.heartbeats.append(body)
        now = time.perf_counter()
        if self.hb_fault == "slow":
            await asyncio.sleep(2.0)
        if self.hb_fault == "busy":
            return web.json_response({"status": "busy"}, status=503)
        if self.hb_fault == "garbage":
            return web.Response(text="<html>proxy error</html>")
        rid = body["request_id"]
        if self.hb_fault == "not_held" or rid not in self.held or body.get("engine_id") != f"D-{self.name}":
            return web.json_response({"status": "not_held", "reason": "unknown"})
        expiry = self.held[rid]
        if self.hb_fault == "ttl":
            return web.json_response({"status": "held", "renewed": False, "retention": "ttl", "expiry_time": expiry,
                                      "expires_in_s": expiry - now})
        self.held[rid] = expiry = max(expiry, now + RENEW_TO_S)
        if self.hb_fault == "huge":  # a well-formed answer padded past any sane size
            return web.Response(body=json.dumps({"status": "held", "renewed": True, "expiry_time": expiry,
                                                 "expires_in_s": expiry - now}).encode() + b" " * 100_000,
                                content_type="application/json")
        return web.json_response({"status": "held", "renewed": True, "retention": "lease", "expiry_time": expiry,
                                  "expires_in_s": expiry - now, "heartbeat_interval_s": 10.0})


def lease_deployment(n_decode: int = 1, **kwargs: Any) -> Deployment:
    dep = Deployment(n_decode=n_decode, style="notify", **kwargs)
    dep.decodes = [FakeLeaseDecode(f"d{i}", role="decode", style="notify") for i in range(n_decode)]
    return dep


async def heartbeat(dep: Deployment, cid: str, key: str | None = None, raw: bytes | None = None):
    return await dep.post(f"/v1/conversations/{cid}/heartbeat", {}, key, raw=raw)


async def first_turn(dep: Deployment, cid: str, key: str | None = None):
    r = await dep.chat([user(f"{cid} q1")], conversation_id=cid, key=key)
    assert r.status == 200 and r.done and r.error is None
    await dep.settle()
    tenant = "default" if key is None else {v: k for k, v in dep.keys.items()}[key]
    entry = dep.router.store.get(tenant, cid)
    assert entry is not None
    return r, entry


def fake_holding(dep: Deployment, entry) -> FakeLeaseDecode:
    return next(d for d in dep.decodes if d.url == entry.decode_instance)


async def test_heartbeat_is_relayed_to_the_d_holding_the_conversation_and_updates_the_entry():
    async with lease_deployment(n_decode=2) as dep:
        # expiries are bracketed by the router's clock read before and after (no window around "now")
        t0 = time.monotonic()
        ra, a = await first_turn(dep, "conv-a")
        t1 = time.monotonic()
        _, b = await first_turn(dep, "conv-b")
        assert a.decode_instance != b.decode_instance  # round robin: one conversation per D
        holder, other = fake_holding(dep, a), fake_holding(dep, b)
        assert t0 + LEASE_S <= a.expires_at <= t1 + LEASE_S  # D's expires_in_s from when its notification came

        t0, w0 = time.monotonic(), time.time()
        r = await heartbeat(dep, "conv-a")
        t1, w1 = time.monotonic(), time.time()
        assert r.status == 200, r.body
        assert r.body["renewed"] is True and r.body["conversation_id"] == "conv-a"
        assert RENEW_TO_S - (t1 - t0) - 1e-3 <= r.body["expires_in_s"] <= RENEW_TO_S + 1e-3  # rounded to ms
        assert w0 + RENEW_TO_S - (t1 - t0) - 1e-3 <= r.body["expires_at"] <= w1 + RENEW_TO_S + 1e-3
        assert r.body["heartbeat_interval_s"] == 10.0 and r.body["retention"] == "lease"
        # the right D got it, naming its own request and engine; the other D got nothing
        assert holder.heartbeats == [{"request_id": a.kv_params["remote_request_id"], "engine_id": f"D-{holder.name}"}]
        assert other.heartbeats == []
        # the stored entry: expiry on the router's clock and the params P will check, both from D's answer
        renewed = dep.router.store.get("default", "conv-a")
        assert t0 + RENEW_TO_S <= renewed.expires_at <= t1 + RENEW_TO_S  # from when the router sent it
        assert renewed.kv_params["remote_blocks_expiry_time"] == holder.held[a.kv_params["remote_request_id"]]
        assert renewed.kv_params["remote_blocks_expiry_time"] > a.kv_params["remote_blocks_expiry_time"]
        assert {k: v for k, v in renewed.kv_params.items() if k != "remote_blocks_expiry_time"} == \
            {k: v for k, v in a.kv_params.items() if k != "remote_blocks_expiry_time"}
        assert dep.router.store.get("default", "conv-b") is b  # untouched

        # the next turn offers P the renewed expiry, so P does not decline the read
        r2 = await dep.chat([user("conv-a q1"), assistant(ra.answer), user("conv-a q2")], conversation_id="conv-a")
        assert r2.status == 200 and r2.done
        sent = dep.p.prefill_requests()[-1]["kv_transfer_params"]
        assert sent["remote_blocks_expiry_time"] == renewed.kv_params["remote_blocks_expiry_time"]
        assert dep.router.metrics.registry.render().count('bidikv_router_heartbeats_total{outcome="renewed"} 1') == 1


async def test_tenants_cannot_heartbeat_or_probe_each_others_conversations():
    async with lease_deployment(keys={"t1": "key-1", "t2": "key-2"}) as dep:
        _, entry = await first_turn(dep, "shared-id", key="key-1")
        foreign = await heartbeat(dep, "shared-id", key="key-2")
        unknown = await heartbeat(dep, "never-used", key="key-2")
        assert foreign.status == unknown.status == 404
        assert foreign.body == unknown.body  # nothing tells t2 that t1 uses this id
        assert foreign.body["error"]["param"] == "conversation_id"
        assert (await heartbeat(dep, "shared-id")).status == 401
        assert (await heartbeat(dep, "shared-id", key="wrong")).status == 401
        assert dep.decodes[0].heartbeats == []
        assert dep.router.store.get("t1", "shared-id") is entry
        ok = await heartbeat(dep, "shared-id", key="key-1")
        assert ok.status == 200 and ok.body["renewed"] is True
        m = dep.router.heartbeats.outcomes
        assert (m.get("not_found"), m.get("unauthenticated"), m.get("renewed")) == (2, 2, 1)


async def test_validation_names_the_field():
    async with lease_deployment(max_conversation_id_len=8) as dep:
        r = await heartbeat(dep, "x" * 9)
        assert r.status == 400 and r.body["error"]["param"] == "conversation_id"
        await first_turn(dep, "c")
        r = await heartbeat(dep, "c", raw=b"{not json")
        assert r.status == 400 and r.body["error"]["param"] == "body"
        r = await heartbeat(dep, "c", raw=b"[1, 2]")
        assert r.status == 400 and r.body["error"]["param"] == "body"
        assert (await heartbeat(dep, "c", raw=b"")).status == 200  # no body at all is fine
        assert dep.router.heartbeats.outcomes.get("invalid") == 3


async def test_an_expired_entry_is_unknown():
    async with lease_deployment() as dep:
        _, entry = await first_turn(dep, "c")
        dep.router.heartbeats.clock = lambda: time.monotonic() + LEASE_S + 1
        r = await heartbeat(dep, "c")
        assert r.status == 404 and dep.decodes[0].heartbeats == []


@pytest.mark.parametrize("fault, status, outcome", [("down", 503, "unreachable"), ("slow", 504, "timeout"),
                                                     ("busy", 503, "busy"), ("garbage", 502, "bad_answer"),
                                                     ("huge", 502, "bad_answer")])
async def test_d_failing_to_answer_is_a_clear_error_and_leaves_the_entry(fault, status, outcome):
    async with lease_deployment(heartbeat_timeout_s=0.5, heartbeat_retry_s=0.2) as dep:
        _, entry = await first_turn(dep, "c")
        d = dep.decodes[0]
        if fault == "down":
            await d.stop_listener()
        d.hb_fault = fault
        r = await heartbeat(dep, "c")
        assert r.status == status, r.body
        assert r.body["error"]["message"].startswith("the decode instance")
        assert dep.router.store.get("default", "c") is entry  # not renewed, not dropped
        assert dep.router.heartbeats.outcomes.get(outcome) == 1
        assert dep.router.metrics.upstream_errors.get(d.url, "decode", f"heartbeat_{outcome}") == 1
        d.hb_fault = None
        if fault != "down":
            await asyncio.sleep(0.25)  # a listener that timed out is skipped for --heartbeat-retry-s
            assert (await heartbeat(dep, "c")).body["renewed"] is True  # D back: renewals resume


async def test_blocks_d_no_longer_holds_end_the_entry():
    async with lease_deployment() as dep:
        _, entry = await first_turn(dep, "c")
        dep.decodes[0].hb_fault = "not_held"
        r = await heartbeat(dep, "c")
        assert r.status == 410 and r.body["error"]["type"] == "not_held"
        assert dep.router.store.get("default", "c") is None  # the next turn is not offered dead blocks
        assert (await heartbeat(dep, "c")).status == 404


async def test_a_fixed_ttl_d_holds_but_does_not_renew():
    async with lease_deployment() as dep:
        t0 = time.monotonic()
        _, entry = await first_turn(dep, "c")
        dep.decodes[0].hb_fault = "ttl"
        r = await heartbeat(dep, "c")
        t1 = time.monotonic()
        assert r.status == 200 and r.body["renewed"] is False and r.body["retention"] == "ttl"
        assert LEASE_S - (t1 - t0) - 1e-3 <= r.body["expires_in_s"] <= LEASE_S + 1e-3  # what was left of it
        assert dep.router.store.get("default", "c") is entry
        assert dep.router.heartbeats.outcomes.get("not_renewed") == 1


async def test_without_a_listener_the_answer_says_so_and_nothing_is_sent():
    async with lease_deployment() as dep:
        dep.decodes[0].advertise = False  # D without bidikv_heartbeat_port
        _, entry = await first_turn(dep, "c")
        r = await heartbeat(dep, "c")
        assert r.status == 200 and r.body["renewed"] is False and r.body["reason"] == "no_heartbeat_listener"
        assert dep.decodes[0].heartbeats == [] and dep.router.store.get("default", "c") is entry


async def test_without_host_rewriting_the_advertised_url_is_used_verbatim():
    async with lease_deployment(rewrite_remote_host=False) as dep:
        await first_turn(dep, "c")
        r = await heartbeat(dep, "c")  # d-side-channel.invalid does not resolve: D is unreachable
        assert r.status == 503 and dep.decodes[0].heartbeats == []


# -- units ------------------------------------------------------------------------------------------

def test_notification_heartbeat_url_is_validated():
    base = {"turn": "t", "token": "s", "kv_transfer_params": {"remote_engine_id": "e"}}
    assert parse_notification(dict(base, heartbeat_url="http://d:9100/bidikv/heartbeat"))[2].heartbeat_url == \
        "http://d:9100/bidikv/heartbeat"
    assert parse_notification(base)[2].heartbeat_url is None
    for bad in ("file:///etc/passwd", "http://d/bidikv/heartbeat", "http://d:99999/x", "http://u:p@d:1/x", 7,
                "http://d:1/x?y=1", "http://" + "d" * 600 + ":1/x"):
        with pytest.raises(NotifyError, match="^heartbeat_url"):
            parse_notification(dict(base, heartbeat_url=bad))


def test_the_directory_is_bounded_and_keyed_by_engine():
    from impl.router.notify import Notification

    directory = HeartbeatDirectory(max_engines=2)
    for i in range(3):
        directory.learn(Notification({"remote_engine_id": f"e{i}"}, None, 0.0, f"http://d{i}:1/h"))
    directory.learn(Notification({"remote_engine_id": "e9"}, None, 0.0, None))  # no listener: nothing learnt
    assert len(directory) == 2 and directory.url_for("e0") is None and directory.url_for("e2") == "http://d2:1/h"
    assert directory.url_for(None) is None and directory.url_for("e9") is None


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=12), c, max_size=4),
                     max_leaves=10)
_answers = st.fixed_dictionaries({}, optional={"status": st.sampled_from(["held", "not_held", "busy"]) | _json,
                                               "renewed": st.booleans() | _json, "expiry_time": _json | st.floats(),
                                               "expires_in_s": _json | st.floats(), "retention": _json,
                                               "heartbeat_interval_s": _json | st.floats()})


@settings(max_examples=400, deadline=None)
@given(st.one_of(_answers, _json))
def test_only_well_formed_answers_of_d_are_believed(obj):
    answer = _parse_answer(json.dumps(obj).encode())
    if answer is None or answer["status"] == "not_held":
        return
    # whatever is believed can be stored: a finite, non-negative lifetime and a finite D-clock expiry
    assert answer["status"] == "held" and isinstance(answer["renewed"], bool)
    for name in ("expires_in_s", "expiry_time"):
        assert isinstance(answer[name], (int, float)) and not isinstance(answer[name], bool)
        assert answer[name] == answer[name] and abs(answer[name]) != float("inf")
    assert answer["expires_in_s"] >= 0
    assert answer.get("heartbeat_interval_s") is None or answer["heartbeat_interval_s"] > 0
