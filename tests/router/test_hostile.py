"""Hypothesis-generated hostile requests: every one gets a 4xx (or a normal answer if it happens to be
valid), never a 5xx or a stack trace, and the router keeps serving afterwards."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.router.harness import Deployment, LoopThread

json_scalars = st.none() | st.booleans() | st.integers(min_value=-(10**30), max_value=10**30) | \
    st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                           max_leaves=12)
FIELDS = ["messages", "prompt", "conversation_id", "stream", "max_tokens", "n", "kv_transfer_params", "model",
          "stream_options", "echo", "best_of", "continue_final_message", "max_completion_tokens"]
message = st.fixed_dictionaries({}, optional={"role": json_values | st.sampled_from(["user", "assistant", "system"]),
                                              "content": json_values | st.text(max_size=40), "name": json_values})
shaped = st.fixed_dictionaries({}, optional={
    "messages": st.lists(message | json_values, max_size=4) | json_values,
    "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 2**40), max_size=6) | json_values,
    "conversation_id": st.text(min_size=0, max_size=400) | json_values,
    "stream": st.booleans() | json_values,
    "max_tokens": st.integers(-3, 64) | json_values,
    "n": st.integers(-1, 3) | json_values,
    "kv_transfer_params": json_values,
    "model": json_values,
})
VALID = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "stream": True,
         "max_tokens": 8, "conversation_id": "c1"}


@st.composite
def near_valid(draw):
    """A valid request with one or two fields replaced by anything: reaches the upstream path often."""
    body = dict(VALID)
    for _ in range(draw(st.integers(1, 2))):
        body[draw(st.sampled_from(FIELDS))] = draw(json_values | st.text(max_size=20) | st.integers(-2, 5))
    if draw(st.booleans()):
        body.pop(draw(st.sampled_from(sorted(body))))
    return body


raw_bodies = st.sampled_from([
    b"", b"null", b"[]", b"\xff\xfe\x00", b"{", b"[" * 50_000, b'{"messages": "' + b"\xc3" + b'"}',
    b'{"messages": [{"role": "user", "content": "\\ud800"}], "conversation_id": "c"}',
    b'{"prompt": "a", "conversation_id": "\\udfff"}',
    b'{"prompt": [' + b"9" * 5000 + b"]}",
    b'{"prompt": "x", "max_tokens": 1e400}',
]) | st.binary(max_size=200)


def check(status: int, raw: bytes) -> None:
    assert status < 500, (status, raw[:300])
    assert b"Traceback" not in raw and b'File "' not in raw


@pytest.fixture(scope="module")
def deployment():
    """One router (and its fakes) for every example: it has to survive all of them."""
    lt = LoopThread()
    dep = Deployment(max_body_bytes=64 * 1024, notify_wait_s=0.05)
    lt.run(dep.__aenter__())
    yield lt, dep
    lt.run(dep.__aexit__(None, None, None))
    lt.close()


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=near_valid() | shaped | json_values, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_hostile_json_bodies_get_4xx(deployment, body, path):
    lt, dep = deployment
    r = lt.run(dep.post(path, body))
    check(r.status, r.raw)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=raw_bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/internal/kv_params"]))
def test_hostile_raw_bodies_get_4xx(deployment, raw, path):
    lt, dep = deployment
    r = lt.run(dep.post(path, None, raw=raw))
    assert 400 <= r.status < 500, (r.status, raw[:100])
    check(r.status, r.raw)


def test_after_the_hostile_bodies_the_router_still_serves(deployment):
    lt, dep = deployment

    async def normal_turns():
        status, _ = await dep.get("/health")
        assert status == 200
        r = await dep.chat([{"role": "user", "content": "still here?"}], conversation_id="alive")
        assert r.status == 200 and r.done
        big = await dep.post("/v1/completions", {"prompt": "x" * (dep.router.config.max_body_bytes + 10)})
        assert big.status == 413 and big.body["error"]["param"] == "body"
        status, text = await dep.get("/metrics")
        assert b'status="500"' not in text

    lt.run(normal_turns())
