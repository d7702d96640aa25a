"""The router directs P to D's host tier when D no longer holds a turn in HBM (impl/router/host_tier.py),
on scripted upstreams: what P receives is parsed by vLLM's own P2P tier (``_parse_source``,
vllm/v1/kv_offload/tiering/p2p/manager.py); when the router does not ask (HBM still holds the turn, D
restarted, the span was evicted or is too short, the host tier is off); and what the client's headers,
the trace and /metrics say. The pull itself runs on real vLLM schedulers in
tests/connector/test_host_tier.py."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from vllm.v1.kv_offload.tiering.p2p.manager import P2PSourceInfo, _parse_dest, _parse_source

from impl.router.host_tier import REMOTE_KV_SOURCE
from impl.trace.format import TraceTurn, parse_turn
from tests.router.fakes import FakeVllmUpstream, Received
from tests.router.harness import Deployment

P2P_PORT = 7777
# a turn is P's 100 prompt tokens (the fake's usage) plus D's 4 answer chunks, less the last token: 103
HOST_TIER = {"host_tier_capacity_tokens": 10_000, "host_tier_p2p_port": P2P_PORT,
             "min_cached_token_delta": 64, "decoder_kv_blocks_ttl": 0.5, "expiry_margin_s": 0.0}


@dataclass
class FakeHostTierPrefill(FakeVllmUpstream):
    """A P whose P2P tier found D's blocks: it reports them as cached (the real pull is scheduler-level,
    tests/connector/test_host_tier.py); ``fail_with_source``: answers 500 to a request carrying the stamp."""

    found_tokens: int = 96
    fail_with_source: bool = False

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        if self.fail_with_source:
            body = await request.json()
            if REMOTE_KV_SOURCE in (body.get("kv_transfer_params") or {}):
                self.received.append(Received(request.path, body, dict(request.headers)))
                return web.json_response({"error": {"message": "pull failed", "code": 500}}, status=500)
        return await super()._completion(request)

    def _prefill_response(self, request: web.Request, body: dict[str, Any]) -> web.Response:
        response = super()._prefill_response(request, body)
        if REMOTE_KV_SOURCE in (body.get("kv_transfer_params") or {}):
            obj = json.loads(response.body)
            obj["usage"]["prompt_tokens_details"]["cached_tokens"] = self.found_tokens
            return web.json_response(obj)
        return response


FIRST = [{"role": "user", "content": "hello host tier"}]


def _next(first: list[dict[str, str]], answer: str) -> list[dict[str, str]]:
    """The conversation's next prompt: what D answered, resent, and a new question."""
    return first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]


async def _two_turns(dep: Deployment, gap_s: float = 0.7, conversation: str = "c1"):
    first = await dep.chat(FIRST, conversation_id=conversation)
    await dep.settle()
    await asyncio.sleep(gap_s)  # the HBM entry expires (decoder_kv_blocks_ttl 0.5 s, no margin)
    second = await dep.chat(_next(FIRST, first.answer), conversation_id=conversation)
    await dep.settle()
    return first, second


def _metric(dep: Deployment, name: str, label: str) -> float:
    counter = {"asks": dep.router.proxy.host_tier.asks, "tiers": dep.router.proxy.host_tier.tiers}[name]
    return counter.get(label)


async def test_a_turn_d_no_longer_holds_in_hbm_is_sent_to_ds_host_tier_as_vllm_parses_it():
    async with Deployment(**HOST_TIER) as dep:
        first, second = await _two_turns(dep)
        assert first.status == second.status == 200 and second.done
        params = dep.p.prefill_requests()[-1]["kv_transfer_params"]
        source = params[REMOTE_KV_SOURCE]
        # vLLM's P2P tier, as installed: a symmetric-P2P consumer that probes D at D's host and P2P port
        info = _parse_source(params)
        assert info == P2PSourceInfo(kv_request_id=source["kv_request_id"], peer_id=f"127.0.0.1:{P2P_PORT}",
                                     do_probe=True)
        assert dep.router.metrics.reuse_misses.get("expired") == 1  # HBM: D's hold had passed
        assert _parse_dest(params) is None  # P is no P2P producer: D reads P's prompt over NIXL as before
        headers = {k.lower(): v for k, v in dep.p.received[-1].headers.items()}
        assert source["kv_request_id"] == headers["x-request-id"] + "-1"  # the turn's id, its first P attempt
        # the rest is a fresh turn's params: P prefills and hands D its blocks
        assert params["do_remote_decode"] is True and params["remote_block_ids"] is None
        # the fake P computed everything: the router says the host tier was asked and nothing landed
        assert second.headers["X-Bidikv-Reuse-Tier"] == "host_miss"
        assert first.headers["X-Bidikv-Reuse-Tier"] == "none"
        assert _metric(dep, "asks", "asked") == 1 and _metric(dep, "tiers", "host_miss") == 1
        status, text = await dep.get("/metrics")
        assert b'bidikv_router_host_tier_asks_total{decision="asked"} 1' in text
        assert b'bidikv_router_turns_by_tier_total{tier="host_miss"} 1' in text


async def test_what_p_pulled_from_the_host_tier_is_told_as_the_host_tier():
    async with _with_prefill(FakeHostTierPrefill("p0", role="prefill"), **HOST_TIER) as dep:
        first, second = await _two_turns(dep)
        assert second.headers["X-Bidikv-Reuse-Tier"] == "host"
        assert second.headers["X-Bidikv-Prefill-Cached-Tokens"] == "96"
        assert _metric(dep, "tiers", "host") == 1


class _with_prefill(Deployment):
    """A Deployment whose one P is ``prefill`` (a fake with its own behaviour)."""

    def __init__(self, prefill: FakeVllmUpstream, **config: Any) -> None:
        super().__init__(**config)
        self.prefills = [prefill]


async def test_a_live_hbm_entry_is_offered_and_the_host_tier_is_not_asked():
    async with Deployment(**{**HOST_TIER, "decoder_kv_blocks_ttl": 60.0}) as dep:
        first, second = await _two_turns(dep, gap_s=0.0)
        params = dep.p.prefill_requests()[-1]["kv_transfer_params"]
        assert REMOTE_KV_SOURCE not in params and params["remote_block_ids"]
        assert second.headers["X-Bidikv-Reuse-Tier"] == "hbm" and _metric(dep, "tiers", "hbm") == 1
        assert _metric(dep, "asks", "asked") == 0


async def test_without_a_host_tier_nothing_changes():
    config = {k: v for k, v in HOST_TIER.items() if not k.startswith("host_tier")}
    async with Deployment(**config) as dep:
        first, second = await _two_turns(dep)
        assert REMOTE_KV_SOURCE not in dep.p.prefill_requests()[-1]["kv_transfer_params"]
        assert "X-Bidikv-Reuse-Tier" not in second.headers and dep.router.proxy.host_tier is None
        status, text = await dep.get("/metrics")
        assert b"host_tier" not in text


async def test_a_d_that_left_rotation_since_the_turn_is_not_asked():
    async with Deployment(**HOST_TIER) as dep:
        first = await dep.chat(FIRST, conversation_id="c1")
        await dep.settle()
        d = dep.router.decode.instances[0]
        dep.router.decode.mark_down(d, "test: refused")  # it may have restarted: a new process has an empty tier
        d.healthy = True  # ... and came back (what the health prober does)
        await asyncio.sleep(0.7)
        second = await dep.chat(_next(FIRST, first.answer), conversation_id="c1")
        assert REMOTE_KV_SOURCE not in dep.p.prefill_requests()[-1]["kv_transfer_params"]
        assert second.headers["X-Bidikv-Reuse-Tier"] == "none" and _metric(dep, "asks", "restarted") == 1


async def test_a_span_estimated_evicted_or_too_short_is_not_asked():
    # 250 tokens of tier: A's 103 tokens, then B's and C's 103 each through the same D, evict it (LRU)
    async with Deployment(**{**HOST_TIER, "host_tier_capacity_tokens": 250}) as dep:
        first = await dep.chat(FIRST, conversation_id="A")
        for other in ("B", "C"):
            await dep.chat([{"role": "user", "content": f"other {other}"}], conversation_id=other)
        await dep.settle()
        await asyncio.sleep(0.7)
        await dep.chat(_next(FIRST, first.answer), conversation_id="A")
        assert REMOTE_KV_SOURCE not in dep.p.prefill_requests()[-1]["kv_transfer_params"]
        assert _metric(dep, "asks", "evicted") == 1
    async with Deployment(**{**HOST_TIER, "min_cached_token_delta": 2048}) as dep:
        await _two_turns(dep)
        assert REMOTE_KV_SOURCE not in dep.p.prefill_requests()[-1]["kv_transfer_params"]
        assert _metric(dep, "asks", "below_minimum") == 1


async def test_a_prefill_error_with_the_stamp_is_retried_without_it():
    async with _with_prefill(FakeHostTierPrefill("p0", role="prefill", fail_with_source=True), **HOST_TIER) as dep:
        first, second = await _two_turns(dep)
        assert second.status == 200 and second.done
        sent = [r["kv_transfer_params"] for r in dep.p.prefill_requests()]
        assert REMOTE_KV_SOURCE in sent[-2] and REMOTE_KV_SOURCE not in sent[-1]  # the retry, same P
        assert _metric(dep, "asks", "prefill_error") == 1 and second.headers["X-Bidikv-Reuse-Tier"] == "none"


def test_the_trace_carries_the_tier_and_reads_back():
    turn = TraceTurn(t=1.0, conversation="c", tenant="t", turn=1, match="id", miss="expired", status=200, tier="host")
    assert parse_turn(json.loads(turn.line()), "x").tier == "host"
    old = {"t": 1.0, "conversation": "c", "tenant": "t", "turn": 1, "match": "id", "miss": None, "status": 200}
    assert parse_turn(old, "x").tier is None  # traces written before the field still read
