"""Bodies in other encodings than UTF-8 are refused before any check reads them (RFC 8259: JSON between
systems is UTF-8): json.loads takes UTF-16 and UTF-32 too, and the byte-level search for
``kv_transfer_params`` at any depth would not see it there, so such a body reached P and D."""

from __future__ import annotations

import json

import pytest

from tests.router.harness import Deployment

SMUGGLED = {"model": "m", "max_tokens": 4, "messages": [
    {"role": "user", "content": "hi", "kv_transfer_params": {"remote_block_ids": [1], "remote_host": "10.0.0.9"}}]}


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"])
async def test_a_body_in_another_encoding_is_refused_and_reaches_no_upstream(encoding):
    async with Deployment() as dep:
        r = await dep.post("/v1/chat/completions", None, raw=json.dumps(SMUGGLED).encode(encoding))
        assert r.status == 400, r.raw
        assert r.body["error"]["param"] == "body" and "must be UTF-8 JSON" in r.body["error"]["message"]
        assert dep.p.received == [] and dep.d.received == []


async def test_the_same_body_in_utf8_is_refused_for_what_it_carries_and_plain_utf8_with_a_bom_is_served():
    async with Deployment() as dep:
        r = await dep.post("/v1/chat/completions", None, raw=json.dumps(SMUGGLED).encode())
        assert r.status == 400 and "at any depth" in r.body["error"]["message"]
        plain = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        r = await dep.post("/v1/chat/completions", None, raw=json.dumps(plain).encode("utf-8-sig"))
        assert r.status == 200, r.raw
