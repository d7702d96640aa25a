"""The smaller leaks. Internal URLs stay internal, kv_transfer_params is refused at
any depth, NaN/Infinity are not JSON, and a max_tokens beyond the model's context never reaches P or D."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.router.harness import Deployment

DEADLINE_S = 10.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_turn_headers_name_instances_not_urls_unless_the_debug_flag_is_set():
    async def body():
        async with Deployment(n_prefill=2) as dep:
            for stream in (True, False):
                r = await dep.chat([{"role": "user", "content": "hi"}], stream=stream)
                assert r.status == 200
                assert r.headers["X-Bidikv-Prefill"] in ("prefill-0", "prefill-1")
                assert r.headers["X-Bidikv-Decode"] == "decode-0"
                for fake in dep.prefills + dep.decodes:
                    assert f":{fake.port}" not in json.dumps(r.headers)
        async with Deployment(expose_upstream_urls=True) as dep:
            r = await dep.chat([{"role": "user", "content": "hi"}])
            assert r.headers["X-Bidikv-Decode"] == dep.d.url
    run(body())


@pytest.mark.parametrize("extra, field", [
    ({"vllm_xargs": {"kv_transfer_params": {"remote_block_ids": [[1]]}}}, "vllm_xargs.kv_transfer_params"),
    ({"extra_args": {"kv_transfer_params": {}}}, "extra_args.kv_transfer_params"),
    ({"messages": [{"role": "user", "content": "hi", "kv_transfer_params": {"remote_host": "x"}}]},
     "messages[0].kv_transfer_params"),
])
def test_kv_transfer_params_is_refused_at_any_depth(extra, field):
    async def body():
        async with Deployment() as dep:
            request = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
            raw = json.dumps(request).encode()
            for payload in (raw, raw.replace(b"kv_transfer_params", b"kv_transfer_param\\u0073")):
                r = await dep.post("/v1/chat/completions", None, raw=payload)
                assert r.status == 400, r.raw
                assert r.body["error"]["param"] == field
            assert not dep.p.received and not dep.d.received
    run(body())


def test_a_mention_of_the_name_inside_text_is_not_refused():
    async def body():
        async with Deployment() as dep:
            r = await dep.chat([{"role": "user", "content": 'what does "kv_transfer_params" do?'}])
            assert r.status == 200 and r.done
    run(body())


@pytest.mark.parametrize("raw", [b'{"prompt": "a", "temperature": NaN}', b'{"prompt": "a", "top_p": Infinity}',
                                 b'{"prompt": "a", "temperature": -Infinity}', b'{"prompt": "a", "temperature": 1e400}'])
def test_non_finite_numbers_are_refused(raw):
    async def body():
        async with Deployment() as dep:
            r = await dep.post("/v1/completions", None, raw=raw)
            assert r.status == 400 and r.body["error"]["param"] == "body", r.raw
            assert not dep.p.received
    run(body())


def test_max_tokens_beyond_the_context_is_refused_before_any_upstream():
    async def body():
        dep = Deployment()
        for fake in dep.prefills + dep.decodes:
            fake.max_model_len = 1000
        async with dep:
            end = time.monotonic() + DEADLINE_S  # the router learns the limit from /v1/models at start
            while not dep.router.model_limits:
                assert time.monotonic() < end
                await asyncio.sleep(0.02)
            r = await dep.chat([{"role": "user", "content": "hi"}], max_tokens=5000)
            assert r.status == 400 and r.body["error"]["param"] == "max_tokens" and "1000" in r.body["error"]["message"]
            r = await dep.completion(list(range(990)), max_tokens=20)
            assert r.status == 400 and r.body["error"]["param"] == "max_tokens"
            r = await dep.chat([{"role": "user", "content": "hi"}], max_completion_tokens=1001)
            assert r.status == 400 and r.body["error"]["param"] == "max_completion_tokens"
            assert not dep.p.received and not dep.d.received
            r = await dep.chat([{"role": "user", "content": "hi"}], max_tokens=999)
            assert r.status == 200
        async with Deployment(max_model_len=64) as dep:  # or configured
            r = await dep.chat([{"role": "user", "content": "hi"}], max_tokens=65)
            assert r.status == 400 and r.body["error"]["param"] == "max_tokens"
    run(body())
