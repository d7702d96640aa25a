"""The turn flow on scripted upstreams: what P and D receive, what the client gets, what is stored."""

from __future__ import annotations

import asyncio

import pytest

from tests.router.fakes import expected_answer
from tests.router.harness import Deployment


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


@pytest.mark.parametrize("style", ["final_chunk", "notify", "both"])
async def test_turn2_sends_turn1_decode_params_to_prefill(style):
    async with Deployment(style=style) as dep:
        history = [user("conv-A first question")]
        r1 = await dep.chat(history, conversation_id="conv-A")
        assert r1.status == 200 and r1.done and r1.error is None
        assert r1.answer == expected_answer({"messages": history}, 4)
        await dep.settle()

        # P got the fresh-turn params, with the vLLM proxy's P-request shape
        p1 = dep.p.prefill_requests()[0]
        assert p1["max_tokens"] == 1 and p1["stream"] is False and "conversation_id" not in p1
        assert p1["kv_transfer_params"]["do_remote_decode"] is True and not p1["kv_transfer_params"].get("remote_block_ids")
        # D got P's params (remote_host rewritten to P's HTTP host) and, with notify on, the notify field
        d1 = dep.d.decode_requests()[0]
        assert d1["kv_transfer_params"]["remote_engine_id"] == "P-p0"
        assert d1["kv_transfer_params"]["remote_host"] == "127.0.0.1"
        assert d1["kv_transfer_params"]["bidikv_notify"]["url"].endswith("/internal/kv_params")
        assert d1["stream"] is True and d1["max_tokens"] == 16
        # D's block locations never reach the client
        assert b"kv_transfer_params" not in r1.raw and b"remote_block_ids" not in r1.raw

        history += [assistant(r1.answer), user("conv-A second question")]
        r2 = await dep.chat(history, conversation_id="conv-A")
        assert r2.status == 200 and r2.done
        p2 = dep.p.prefill_requests()[1]["kv_transfer_params"]
        d_rid = next(iter(dep.d.issued_d_params))  # the D request id issued for turn 1
        assert p2["remote_request_id"] == d_rid
        assert p2["do_remote_decode"] is True and p2["do_remote_prefill"] is False
        assert p2["remote_engine_id"] == "D-d0" and p2["remote_block_ids"] == [[7, 8, 9, 10]]
        assert p2["remote_host"] == "127.0.0.1" and "bidikv_notify" not in p2
        await dep.settle()
        m = dep.router.metrics
        assert m.reuse_hits.get() == 1 and m.reuse_misses.get("unknown") == 1
        assert m.tokens_reused.get() == 68
        # with both sources, whichever is there when D's stream ends wins (they agree here)
        sources = {"final_chunk": ["final_chunk"], "notify": ["notify"], "both": ["final_chunk", "notify"]}[style]
        assert sum(m.turns_stored.get(s) for s in sources) == 2
        assert m.params_conflicts.get() == 0


async def test_plain_vllm_032_stream_without_params_stores_nothing():
    async with Deployment(style="none", notify_wait_s=0.2) as dep:
        r1 = await dep.chat([user("q")], conversation_id="c")
        assert r1.done
        await dep.settle()
        assert dep.router.store.get("default", "c") is None
        assert dep.router.metrics.turns_not_stored.get("no_params") == 1


async def test_non_streamed_turns_use_the_body_params_and_strip_them():
    async with Deployment(style="none") as dep:  # 0.32: the body carries D's params even without our connector
        r1 = await dep.chat([user("q")], conversation_id="c", stream=False)
        assert r1.status == 200 and "kv_transfer_params" not in r1.body
        assert r1.answer == expected_answer({"messages": [user("q")]}, 4)
        await dep.settle()
        assert dep.router.metrics.turns_stored.get("body") == 1
        r2 = await dep.chat([user("q"), assistant(r1.answer), user("q2")], conversation_id="c", stream=False)
        assert r2.status == 200
        assert dep.p.prefill_requests()[1]["kv_transfer_params"]["remote_engine_id"] == "D-d0"


async def test_rewritten_answer_is_refused_by_the_guard():
    async with Deployment() as dep:
        r1 = await dep.chat([user("q1")], conversation_id="c")
        # the client strips part of the answer (e.g. reasoning) before resending
        r2 = await dep.chat([user("q1"), assistant(r1.answer[:-3]), user("q2")], conversation_id="c")
        assert r2.status == 200 and r2.done
        assert not dep.p.prefill_requests()[1]["kv_transfer_params"].get("remote_block_ids")
        assert dep.router.metrics.reuse_misses.get("guard") == 1
        # an edited earlier user message is refused as well
        r3 = await dep.chat([user("q1 edited"), assistant(r1.answer), user("q2")], conversation_id="c")
        assert r3.status == 200
        assert not dep.p.prefill_requests()[2]["kv_transfer_params"].get("remote_block_ids")


async def test_other_tenant_with_the_same_conversation_id_gets_nothing():
    async with Deployment(keys={"acme": "key-a", "globex": "key-g"}) as dep:
        r1 = await dep.chat([user("secret")], conversation_id="shared-id", key="key-a")
        assert r1.status == 200
        r2 = await dep.chat([user("secret"), assistant(r1.answer), user("more")], conversation_id="shared-id", key="key-g")
        assert r2.status == 200
        assert not dep.p.prefill_requests()[1]["kv_transfer_params"].get("remote_block_ids")
        # exported as unknown: metrics never tell another tenant's id from an unknown one (tenant isolation)
        assert dep.router.metrics.reuse_misses.get("unknown") == 2 and dep.router.metrics.reuse_misses.get("tenant") == 0  # r1 and r2
        # the owner still reuses
        await dep.chat([user("secret"), assistant(r1.answer), user("more")], conversation_id="shared-id", key="key-a")
        assert dep.p.prefill_requests()[2]["kv_transfer_params"]["remote_engine_id"] == "D-d0"
        # no key / wrong key: 401, nothing reaches an upstream
        before = len(dep.p.received)
        assert (await dep.chat([user("x")], conversation_id="c")).status == 401
        assert (await dep.chat([user("x")], conversation_id="c", key="nope")).status == 401
        assert len(dep.p.received) == before


async def test_text_prompt_conversation_reuses_and_guards():
    async with Deployment() as dep:
        r1 = await dep.completion("System: be brief.\nUser: hi\nAssistant:", conversation_id="t")
        prompt2 = "System: be brief.\nUser: hi\nAssistant:" + r1.answer + "\nUser: again\nAssistant:"
        await dep.completion(prompt2, conversation_id="t")
        assert dep.p.prefill_requests()[1]["kv_transfer_params"]["remote_engine_id"] == "D-d0"
        await dep.completion(prompt2.replace("brief", "long"), conversation_id="t")
        assert not dep.p.prefill_requests()[2]["kv_transfer_params"].get("remote_block_ids")


async def test_token_prompt_conversation_uses_returned_token_ids():
    async with Deployment() as dep:
        prompt = list(range(10, 50))
        r1 = await dep.completion(prompt, conversation_id="tok")
        assert r1.done
        assert dep.d.decode_requests()[0]["return_token_ids"] is True
        out_ids = [1000 + i for i in range(4)]  # what the fake D generated
        await dep.completion(prompt + out_ids + [7, 7], conversation_id="tok")
        assert dep.p.prefill_requests()[1]["kv_transfer_params"]["remote_engine_id"] == "D-d0"
        await dep.completion(prompt + [1000, 1001, 9, 9, 7], conversation_id="tok")  # answer altered
        assert not dep.p.prefill_requests()[2]["kv_transfer_params"].get("remote_block_ids")


async def test_header_conversation_id_and_no_id():
    async with Deployment() as dep:
        r1 = await dep.post("/v1/chat/completions", {"messages": [user("h")], "stream": True},
                            headers={"X-Conversation-Id": "via-header"})
        assert r1.status == 200
        assert dep.router.store.get("default", "via-header") is not None
        await dep.chat([user("h")])  # no id: a first turn has no history to be found by; stored under its own
        assert dep.router.metrics.reuse_misses.get("no_history") == 1
        assert len(dep.router.store) == 2


async def test_unsupported_shapes_are_served_but_never_reused():
    async with Deployment() as dep:
        r = await dep.chat([user("n2")], conversation_id="n", n=2)
        assert r.status == 200
        assert dep.router.store.get("default", "n") is None
        assert dep.router.metrics.reuse_misses.get("unsupported") == 1


async def test_conflicting_final_chunk_and_notification_prefers_notification():
    async with Deployment(style="conflict") as dep:  # D notifies first, then a final chunk with other blocks
        await dep.chat([user("q")], conversation_id="c")
        await dep.settle()
        entry = dep.router.store.get("default", "c")
        assert entry.kv_params["remote_block_ids"] == [[7, 8, 9, 10]]  # the notification's, not the chunk's [[99]]
        assert dep.router.metrics.params_conflicts.get() == 1
        assert dep.router.metrics.turns_stored.get("notify") == 1


async def test_late_notification_completes_the_store_after_the_client_is_done():
    async with Deployment(style="notify", notify_wait_s=2.0) as dep:
        dep.d.notify_delay_s = 0.3
        r1 = await dep.chat([user("q")], conversation_id="late")
        assert r1.done  # the client was not held back by the wait
        assert dep.router.store.get("default", "late") is None
        # the next turn arrives before the notification: it waits for the pending update, then hits
        await dep.chat([user("q"), assistant(r1.answer), user("q2")], conversation_id="late")
        assert dep.p.prefill_requests()[1]["kv_transfer_params"]["remote_engine_id"] == "D-d0"


async def test_a_d_that_kept_nothing_says_so_and_the_next_turn_does_not_wait():
    """bidirectional OFF: D posts "retained": false; the next turn of the conversation, sent at once, is not
    held for notify_wait_s (30 s here: had it waited, wait_for's 10 s would fail the test)."""
    async with Deployment(style="kept_nothing", notify_wait_s=30.0) as dep:
        r1 = await dep.chat([user("q")], conversation_id="off")
        await asyncio.wait_for(dep.chat([user("q"), assistant(r1.answer), user("q2")], conversation_id="off"), 10.0)
        await dep.settle()
        assert dep.router.store.get("default", "off") is None
        assert dep.d.notify_replies == [204, 204]
        assert dep.router.metrics.turns_not_stored.get("not_retained") == 2
        assert "kv_transfer_params" not in dep.p.prefill_requests()[1] or \
            not dep.p.prefill_requests()[1]["kv_transfer_params"].get("remote_block_ids")  # nothing offered


async def test_notification_with_wrong_token_is_rejected():
    async with Deployment(style="notify", notify_wait_s=0.3) as dep:
        dep.d.notify_token_override = "forged"
        await dep.chat([user("q")], conversation_id="c")
        await dep.settle()
        assert dep.router.store.get("default", "c") is None
        assert dep.d.notify_replies == [403]
        assert dep.router.metrics.notifications.get("bad_token") == 1


async def test_models_health_metrics():
    async with Deployment() as dep:
        status, body = await dep.get("/v1/models")
        assert status == 200 and b"fake-model" in body
        status, body = await dep.get("/health")
        assert status == 200 and b'"ok"' in body
        await dep.chat([user("q")], conversation_id="c")
        status, body = await dep.get("/metrics")
        text = body.decode()
        assert status == 200
        assert 'bidikv_router_requests_total{route="/v1/chat/completions",status="200"} 1' in text
        assert "bidikv_router_ttft_seconds_count 1" in text
        assert 'bidikv_router_reuse_misses_total{reason="unknown"} 1' in text
        assert "bidikv_router_store_entries 1" in text


@pytest.mark.parametrize("stream", [True, False])
async def test_turn_info_headers_say_where_it_ran_and_what_was_reused(stream):
    async with Deployment(style="final_chunk") as dep:
        history = [user("conv-H first")]
        r1 = await dep.chat(history, conversation_id="conv-H", stream=stream)
        assert r1.headers["X-Bidikv-Prefill"] == "prefill-0" and r1.headers["X-Bidikv-Decode"] == "decode-0"  # names, not URLs
        assert r1.headers["X-Bidikv-Reuse-Offered-Tokens"] == "0"
        assert r1.headers["X-Bidikv-Prefill-Cached-Tokens"] == "0"
        await dep.settle()
        answer = r1.answer if stream else r1.body["choices"][0]["message"]["content"]
        history += [assistant(answer), user("conv-H second")]
        r2 = await dep.chat(history, conversation_id="conv-H", stream=stream)
        assert r2.headers["X-Bidikv-Reuse-Offered-Tokens"] == "68"  # what D reported holding after turn 1
        assert r2.headers["X-Bidikv-Prefill-Cached-Tokens"] == "68"  # what P says it did not compute


async def test_tenants_get_their_own_cache_salt_on_p_and_d():
    """Keys configured: P's and D's prefix caches are partitioned by tenant (vLLM's cache_salt)."""
    import hashlib

    async with Deployment(keys={"acme": "key-a", "globex": "key-g"}) as dep:
        for key in ("key-a", "key-a", "key-g"):
            assert (await dep.chat([user("same prompt")], key=key)).status == 200
        assert (await dep.chat([user("same prompt")], key="key-a", cache_salt="mine")).status == 200
        p_salts = [b.get("cache_salt") for b in dep.p.prefill_requests()]
        d_salts = [b.get("cache_salt") for b in dep.d.decode_requests()]
        assert p_salts == d_salts  # P and D of one turn hash blocks alike: D's local hits stay valid
        acme, acme_again, globex, acme_own = p_salts
        assert acme == acme_again and len({acme, globex, acme_own}) == 3
        assert all(isinstance(s, str) and s for s in p_salts)
        # a client salt cannot name another tenant's partition: the tenant is always part of it
        assert globex not in {hashlib.sha256(s.encode()).hexdigest() for s in ("globex", "globex\0")}
        bad = await dep.chat([user("x")], key="key-a", cache_salt=17)
        assert bad.status == 400 and b"cache_salt" in bad.raw, bad.raw


async def test_no_keys_no_salt_added():
    async with Deployment() as dep:
        assert (await dep.chat([user("hello")])).status == 200
        assert (await dep.chat([user("hello")], cache_salt="client")).status == 200
        salts = [b.get("cache_salt") for b in dep.p.prefill_requests()]
        assert salts == [None, "client"]  # open router: the client's own salt passes through untouched


async def test_a_streamed_turn_is_stored_before_its_client_sees_the_end(monkeypatch):
    """A client may send its next turn the moment it reads [DONE]; that turn's lookup must find this one.
    The patched write_eof plays a loaded router that resumes the handler late after the last write."""
    import asyncio

    from aiohttp import web

    original = web.StreamResponse.write_eof

    async def resumed_late(self, data=b""):
        await original(self, data)
        await asyncio.sleep(0.3)

    monkeypatch.setattr(web.StreamResponse, "write_eof", resumed_late)
    async with Deployment() as dep:
        first = await dep.chat([user("q1")], conversation_id="c")
        assert first.status == 200 and first.done
        assert len(dep.router.store) == 1  # already stored when the client had the whole answer
        second = await dep.chat([user("q1"), assistant(first.answer), user("q2")], conversation_id="c")
        assert second.status == 200
        assert dep.p.prefill_requests()[1]["kv_transfer_params"]["remote_engine_id"] == "D-d0"


async def test_with_p_verifying_token_ids_reasoning_and_rewritten_turns_are_offered():
    """D publishes a prefix check (our connector): P verifies token ids itself, so the router stores
    turns it cannot reconstruct (reasoning) and offers re-rendered histories; P's report comes back
    as headers and metrics and never reaches D or the client."""
    dep = Deployment()
    dep.d.publish_check = dep.d.reasoning = True
    async with dep:
        r1 = await dep.chat([user("q1")], conversation_id="c")
        assert r1.status == 200 and r1.done
        await dep.settle()
        assert dep.router.metrics.turns_not_stored.get("unreconstructable") == 0
        # the client resends the answer without its reasoning and shortened: still offered, P verifies
        r2 = await dep.chat([user("q1"), assistant(r1.answer[:-3]), user("q2")], conversation_id="c")
        assert r2.status == 200 and r2.done
        offered = dep.p.prefill_requests()[1]["kv_transfer_params"]
        assert offered["remote_engine_id"] == "D-d0" and "bidikv_prefix_check" in offered
        assert dep.router.metrics.reuse_misses.get("guard") == 0
        assert r2.headers["X-Bidikv-Reuse-Verify"] == "partial"
        assert r2.headers["X-Bidikv-Reuse-Verified-Tokens"] == str(offered["remote_num_tokens"] // 2)
        assert dep.router.metrics.p_verified_tokens.get("verified") == offered["remote_num_tokens"] // 2
        assert dep.router.metrics.p_verify_results.get("partial") == 1
        assert "bidikv_reuse" not in dep.d.decode_requests()[1]["kv_transfer_params"]  # P's report is the router's
        assert b"bidikv_prefix_check" not in r2.raw and b"bidikv_reuse" not in r2.raw
