"""Fault injection on scripted upstreams: each fault's outcome for the client and for the store.

Every test first completes a healthy turn 1 so the store holds an entry, then injects the fault on
turn 2 and checks that the failed turn stored nothing and that turn 1's entry was offered once (P may
have read it, and D frees blocks once read): the retried turn 2 recomputes and is stored.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.router.harness import Deployment


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


async def first_turn(dep: Deployment, cid: str = "c") -> tuple[list[dict], str]:
    r1 = await dep.chat([user(f"{cid} q1")], conversation_id=cid)
    assert r1.status == 200 and r1.done and r1.error is None
    await dep.settle()
    entry = dep.router.store.get("default", cid)
    assert entry is not None
    return [user(f"{cid} q1"), assistant(r1.answer), user(f"{cid} q2")], entry.kv_params["remote_request_id"]


async def assert_turn1_offered_once(dep: Deployment, history: list[dict], turn1_rid: str, cid: str = "c") -> None:
    """The failed turn stored nothing, and turn 1's entry left the store when it was offered: P may have
    read those blocks, and a real D frees blocks once read, so the retry must recompute, not be offered
    them again (as vLLM, the retry's P gets fresh-turn params)."""
    await dep.settle()
    assert dep.router.store.get("default", cid) is None
    for fake in dep.decodes:
        fake.fault = None
    n = sum(len(p.prefill_requests()) for p in dep.prefills)
    r = await dep.chat(history, conversation_id=cid)
    assert r.status == 200 and r.done and r.error is None
    sent = [p.prefill_requests() for p in dep.prefills]
    last = [req for reqs in sent for req in reqs][n:]
    assert last[-1]["kv_transfer_params"].get("remote_request_id") != turn1_rid
    assert last[-1]["kv_transfer_params"].get("remote_block_ids") is None  # fresh-turn params
    assert r.headers["X-Bidikv-Reuse-Offered-Tokens"] == "0"
    # and the retry, complete, is stored: the conversation's next turn reuses again
    await dep.settle()
    assert dep.router.store.get("default", cid) is not None


@pytest.mark.parametrize("fault,cause", [("kill_mid_stream", "cut"), ("no_done", "no_done"), ("stall", "timeout")])
async def test_decode_failing_mid_stream_sends_an_sse_error_and_stores_nothing(fault, cause):
    async with Deployment(decode_idle_timeout_s=0.3) as dep:
        history, rid = await first_turn(dep)
        dep.d.fault, dep.d.fault_after, dep.d.slow_s = fault, 2, 3.0
        r = await dep.chat(history, conversation_id="c")
        assert r.status == 200  # headers were already sent when D failed
        assert r.error is not None and r.error["code"] == 502
        assert r.done  # error event, then [DONE], and every event the client got is whole JSON
        assert all(isinstance(ev, (dict, str)) for ev in r.events)
        assert "<" in r.answer  # the chunks before the fault did reach the client
        assert dep.router.metrics.stream_errors.get(cause) == 1
        assert dep.router.metrics.upstream_errors.get(dep.d.url, "decode", cause) == 1
        await assert_turn1_offered_once(dep, history, rid)


async def test_decode_error_event_is_passed_on_and_nothing_stored():
    async with Deployment() as dep:
        history, rid = await first_turn(dep)
        dep.d.fault = "error_event"
        r = await dep.chat(history, conversation_id="c")
        assert r.error["message"] == "engine died" and r.done
        assert dep.router.metrics.turns_not_stored.get("upstream_error") == 1
        await assert_turn1_offered_once(dep, history, rid)


async def test_malformed_final_chunk_stores_nothing():
    async with Deployment() as dep:
        history, rid = await first_turn(dep)
        dep.d.fault = "malformed_final"
        r = await dep.chat(history, conversation_id="c")
        assert r.status == 200 and r.done
        assert dep.router.metrics.turns_not_stored.get("incomplete") == 1
        await assert_turn1_offered_once(dep, history, rid)


async def test_missing_params_on_032_stream_without_notification_stores_nothing():
    async with Deployment(style="none", notify_wait_s=0.2) as dep:
        dep.d.style = "final_chunk"
        history, rid = await first_turn(dep)
        dep.d.style = "none"  # D answers but neither chunk nor notification carries params
        r = await dep.chat(history, conversation_id="c")
        assert r.done and r.error is None
        await dep.settle()
        assert dep.router.metrics.turns_not_stored.get("no_params") == 1
        dep.d.style = "final_chunk"  # the retry's D sends its params again
        await assert_turn1_offered_once(dep, history, rid)


async def test_decode_unreachable_fails_over_to_another_decode():
    async with Deployment(n_decode=1, dead_decode=1) as dep:
        for i in range(3):
            r = await dep.chat([user(f"q{i}")], conversation_id=f"c{i}")
            assert r.status == 200 and r.done
        assert dep.router.decode.healthy_count == 1  # the dead one was marked down on first contact
        assert len(dep.d.decode_requests()) == 3


@pytest.mark.parametrize("stream", [True, False])
async def test_no_decode_reachable_is_a_clear_503(stream):
    async with Deployment(n_decode=0, dead_decode=2) as dep:
        r = await dep.chat([user("q")], conversation_id="c", stream=stream)
        assert r.status == 503
        assert r.body["error"]["message"] == "no decode instance is reachable"
        assert "Traceback" not in r.raw.decode()
        assert dep.router.store.get("default", "c") is None


async def test_decode_500_before_answering_tries_the_next_decode():
    async with Deployment(n_decode=2) as dep:
        dep.decodes[0].fault = "http_500"
        dep.decodes[1].fault = "http_500"
        r = await dep.chat([user("q")], conversation_id="c")
        assert r.status == 502 and "HTTP 500" in r.body["error"]["message"]
        dep.decodes[0].fault = None
        for _ in range(2):
            r = await dep.chat([user("q")], conversation_id="c")
            assert r.status == 200 and r.done


async def test_prefill_down_fails_over_then_503_when_none_left():
    async with Deployment(n_prefill=1, dead_prefill=1) as dep:
        for i in range(4):
            r = await dep.chat([user(f"q{i}")], conversation_id=f"c{i}")
            assert r.status == 200 and r.done
        dead = dep.dead_prefill_urls[0]
        assert dep.router.metrics.upstream_errors.get(dead, "prefill", "unreachable") == 1  # once, then marked down
        assert len(dep.p.prefill_requests()) == 4
        await dep.p.stop()
        r = await dep.chat([user("q")], conversation_id="z")
        assert r.status == 503 and r.body["error"]["type"] == "service_unavailable"
        status, body = await dep.get("/health")
        assert status == 503


async def test_slow_prefill_times_out_and_fails_over():
    async with Deployment(n_prefill=2, prefill_timeout_s=0.3, placement="round_robin") as dep:
        dep.prefills[0].fault, dep.prefills[0].slow_s = "slow", 2.0
        r = await dep.chat([user("q")], conversation_id="c")
        assert r.status == 200 and r.done
        dep.prefills[1].fault, dep.prefills[1].slow_s = "slow", 2.0
        r = await dep.chat([user("q")], conversation_id="c2")
        assert r.status == 504 and r.body["error"]["message"] == "prefill timed out"


async def test_slow_decode_chunks_within_the_idle_timeout_are_fine():
    async with Deployment(decode_idle_timeout_s=1.0) as dep:
        dep.d.chunk_delay_s = 0.05
        r = await dep.chat([user("q")], conversation_id="c")
        assert r.done and r.error is None
        assert dep.router.store.get("default", "c") is not None


async def test_prefill_500_on_a_pull_is_retried_without_reuse():
    async with Deployment() as dep:
        history, rid = await first_turn(dep)
        dep.p.fault = "http_500_on_pull"
        r = await dep.chat(history, conversation_id="c")
        assert r.status == 200 and r.done
        sent = dep.p.received[-2:]
        assert sent[0].body["kv_transfer_params"]["remote_request_id"] == rid
        assert not sent[1].body["kv_transfer_params"].get("remote_block_ids")
        assert dep.router.metrics.reuse_misses.get("prefill_error") == 1


async def test_prefill_4xx_is_the_clients_error_passed_on():
    async with Deployment() as dep:
        dep.p.fault = "http_400"
        r = await dep.chat([user("q")], conversation_id="c")
        assert r.status == 400 and r.body["error"]["message"] == "bad prompt"
        assert not dep.d.received


async def test_expired_entry_sends_no_params():
    async with Deployment(decoder_kv_blocks_ttl=5.3, expiry_margin_s=5.0) as dep:  # usable for 0.3 s
        history, rid = await first_turn(dep)
        await asyncio.sleep(0.4)
        await dep.chat(history, conversation_id="c")
        assert not dep.p.prefill_requests()[-1]["kv_transfer_params"].get("remote_block_ids")
        assert dep.router.metrics.reuse_misses.get("expired") == 1


async def test_client_leaving_mid_stream_aborts_decode_and_stores_nothing():
    async with Deployment(chunks=20) as dep:
        dep.d.chunk_delay_s = 0.05
        async with aiohttp.ClientSession() as s:
            async with s.post(dep.url + "/v1/chat/completions",
                              json={"messages": [user("q")], "stream": True, "conversation_id": "gone"}) as resp:
                await resp.content.readline()  # first bytes, then hang up
        await asyncio.sleep(0.3)
        await dep.settle()
        assert dep.router.store.get("default", "gone") is None
        assert dep.router.metrics.stream_errors.get("client_gone") == 1


async def test_health_probe_removes_and_readds_an_instance():
    async with Deployment(n_decode=2, health_interval_s=0.05, health_failures_to_down=2) as dep:
        dep.decodes[0].healthy = False
        await asyncio.sleep(0.3)
        assert dep.router.decode.instances[0].failed_probes >= 2
        assert [u.healthy for u in dep.router.decode.instances] == [False, True]
        for i in range(3):
            assert (await dep.chat([user(f"q{i}")], conversation_id=f"c{i}")).status == 200
        assert not dep.decodes[0].decode_requests()
        dep.decodes[0].healthy = True
        await asyncio.sleep(0.3)
        assert [u.healthy for u in dep.router.decode.instances] == [True, True]


async def test_instance_marked_down_comes_back_after_restart():
    async with Deployment(n_prefill=2, health_interval_s=0.05) as dep:
        port = dep.prefills[0].port
        await dep.prefills[0].stop()
        await asyncio.sleep(0.3)
        assert [u.healthy for u in dep.router.prefill.instances] == [False, True]
        await dep.prefills[0].start(port)
        await asyncio.sleep(0.3)
        assert [u.healthy for u in dep.router.prefill.instances] == [True, True]


async def test_upstream_closing_a_reused_keepalive_connection_is_retried_not_marked_down():
    async with Deployment(upstream_keepalive_s=30.0) as dep:
        await first_turn(dep, "warm")  # opens the pooled connections
        dep.p.drop_reused, dep.d.drop_reused = 1, 1
        r = await dep.chat([user("q")], conversation_id="k")
        assert r.status == 200 and r.done and r.error is None
        m = dep.router.metrics
        assert m.upstream_errors.get(dep.p.url, "prefill", "disconnected") == 1
        assert m.upstream_errors.get(dep.d.url, "decode", "disconnected") == 1
        assert dep.router.prefill.healthy_count == 1 and dep.router.decode.healthy_count == 1
