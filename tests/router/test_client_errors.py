"""What is the client's fault is counted as the client's, never as a 500 with a
traceback: a client that leaves mid-body, JSON nested deeper than the bound (refused at parse)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from impl.router.request import RequestError, parse_json_body
from tests.router.harness import Deployment

DEADLINE_S = 10.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def nested_in_a_content_part(depth: int) -> bytes:
    deep = "[" * depth + "]" * depth
    return ('{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "x": %s}]}], '
            '"max_tokens": 4}' % deep).encode()


def test_a_client_leaving_mid_body_is_a_client_error_logged_without_traceback(caplog):
    caplog.set_level(logging.DEBUG, logger="bidikv.router")

    async def body():
        async with Deployment() as dep:
            host, port = dep.url.removeprefix("http://").split(":")
            for _ in range(3):
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"mess")
                await writer.drain()
                writer.close()
            requests = dep.router.metrics.requests
            end = time.monotonic() + DEADLINE_S
            while sum(v for (route, _), v in requests.values.items() if route == "/v1/chat/completions") < 3:
                assert time.monotonic() < end, requests.values
                await asyncio.sleep(0.02)
            assert requests.get("/v1/chat/completions", "500") == 0
            assert requests.get("/v1/chat/completions", "499") == 3  # nginx's "client closed request"
            r = await dep.chat([{"role": "user", "content": "still fine"}])
            assert r.status == 200 and r.done
    run(body())
    router_records = [r for r in caplog.records if r.name == "bidikv.router"]
    assert not [r for r in router_records if r.levelno >= logging.WARNING or r.exc_info], router_records


@pytest.mark.parametrize("depth", [120, 500, 975, 990, 100_000])
def test_deep_json_is_refused_at_parse_as_a_400(depth):
    async def body():
        async with Deployment() as dep:
            r = await dep.post("/v1/chat/completions", None, raw=nested_in_a_content_part(depth))
            assert r.status == 400, (r.status, r.raw[:200])
            assert r.body["error"]["param"] == "body" and "nested" in r.body["error"]["message"]
            assert not dep.p.received and not dep.d.received  # refused before any upstream saw it
            assert dep.router.metrics.requests.get("/v1/chat/completions", "500") == 0
    run(body())


def test_the_nesting_bound_counts_structure_not_brackets_inside_strings():
    limit = 100
    ok = b'{"a": ' + b"[" * 99 + b"]" * 99 + b', "s": "' + b"[" * 5000 + b'\\"[{"}'
    assert parse_json_body(ok, max_depth=limit)["s"].startswith("[[[")
    with pytest.raises(RequestError) as e:
        parse_json_body(b'{"a": ' + b"[" * 100 + b"]" * 100 + b"}", max_depth=limit)
    assert e.value.field == "body" and "100" in e.value.message
    wide = b'{"a": [' + b"[[]]," * 10_000 + b"[]]}"  # many brackets, depth 4
    assert len(parse_json_body(wide, max_depth=limit)["a"]) == 10_001
