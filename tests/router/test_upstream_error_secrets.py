"""An upstream 4xx that quotes its request (vLLM's validation errors do) must not hand the client the
turn's KV locations or the notification URL and token: stripping removes KV fields by key, not text."""

from __future__ import annotations

import json

from tests.router.harness import Deployment
from tests.router.test_heartbeat import assistant, user


def _leaks(raw: bytes, sent: dict) -> list[str]:
    text = raw.decode()
    found = [k for k in ("remote_engine_id", "remote_request_id", "remote_host") if str(sent.get(k)) in text]
    notify = sent.get("bidikv_notify") or {}
    found += [k for k in ("url", "token") if notify.get(k) and notify[k] in text]
    if sent.get("remote_block_ids") and json.dumps(sent["remote_block_ids"]) in text:
        found.append("remote_block_ids")
    return found


async def test_ds_error_quoting_ps_block_ids_and_the_notify_token_reaches_the_client_without_them():
    async with Deployment(style="notify") as dep:
        dep.d.fault = "http_400_echo"
        r = await dep.chat([user("leak q1")], conversation_id="leak")
        assert r.status == 400
        sent = dep.d.decode_requests()[-1]["kv_transfer_params"]
        assert sent.get("remote_block_ids") and sent.get("bidikv_notify")  # D was sent secrets, and quoted them
        assert _leaks(r.raw, sent) == [], r.raw
        assert r.body["error"]["type"] == "BadRequestError"  # vLLM's error type is kept


async def test_ps_error_quoting_ds_params_on_a_later_turn_reaches_the_client_without_them():
    async with Deployment(style="notify") as dep:
        first = await dep.chat([user("leak2 q1")], conversation_id="leak2")
        assert first.status == 200
        await dep.settle()
        dep.p.fault = "http_400_echo"
        r = await dep.chat([user("leak2 q1"), assistant(first.answer), user("leak2 q2")], conversation_id="leak2")
        assert r.status == 400
        sent = dep.p.prefill_requests()[-1]["kv_transfer_params"]
        assert sent.get("remote_request_id") and sent.get("remote_block_ids")
        assert _leaks(r.raw, sent) == [], r.raw


async def test_an_error_that_quotes_nothing_of_the_turn_passes_as_it_came():
    async with Deployment() as dep:
        dep.d.fault = "http_400"
        r = await dep.chat([user("plain")])
        assert r.status == 400 and r.body["error"]["message"] == "bad prompt"
