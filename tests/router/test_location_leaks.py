"""No encoding of KV locations reaches a client, from D's stream, D's JSON answer
or P's and D's error bodies. The oracle is a client's own reading (json.loads, \\u escapes decoded,
keys compared without case), independent of impl.router.scrub."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from impl.router.capture import TurnCapture
from impl.router.sse import SSESplitter, format_event
from tests.router.harness import Deployment, LoopThread, parse_sse

SECRET = "S3CR3T-10.9.8.7"
NAMES = ["kv_transfer_params", "remote_block_ids", "remote_engine_id", "remote_host", "remote_port",
         "remote_request_id", "do_remote_prefill", "bidikv_notify"]
_ESCAPE = re.compile(r"\\u([0-9a-fA-F]{4})")


def client_view_leaks(forwarded: bytes) -> list[str]:
    """What a client could learn: the secret anywhere once escapes are decoded, or a sensitive key."""
    problems = []
    text = _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), forwarded.decode("utf-8", "replace"))
    if SECRET in text or SECRET.casefold() in text.casefold():
        problems.append("secret in bytes")
    stack = [ev for ev in parse_sse(forwarded)] if b"data:" in forwarded else []
    try:
        stack.append(json.loads(forwarded))
    except ValueError:
        pass
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                folded = k.casefold()
                if "kv_transfer" in folded or folded.startswith(("remote_", "do_remote", "bidikv")):
                    problems.append(f"key {k!r}")
                stack.append(v)
        elif isinstance(node, list):
            stack.extend(node)
    return problems


@st.composite
def spelt(draw, name: str) -> str:
    """``name`` as JSON string content, each character literal or a \\u escape in either hex case."""
    out = []
    for ch in name:
        how = draw(st.sampled_from(["lit", "lit", "lower", "upper"]))
        code = f"{ord(ch):04x}"
        out.append(ch if how == "lit" else "\\u" + (code if how == "lower" else code.upper()))
    return "".join(out)


@st.composite
def leaky_payload(draw) -> bytes:
    """A chunk with a KV location somewhere, its key and value spelt any way; sometimes cut short
    (not JSON any more) or with the key's letter case changed."""
    name = draw(st.sampled_from(NAMES))
    if draw(st.booleans()):
        name = draw(st.sampled_from([name.upper(), name.title(), name]))
    key = draw(spelt(name))
    inner_key = draw(spelt(draw(st.sampled_from(NAMES[1:]))))
    secret = draw(spelt(SECRET))
    value = draw(st.sampled_from([f'"{secret}"', f'{{"{inner_key}": "{secret}"}}', f'[[7, 8], "{secret}"]',
                                  f'{{"{inner_key}": [[1]], "x": "{secret}"}}']))
    base = {"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
    if draw(st.booleans()):  # D's own params as well, spelt plainly (vLLM 0.33's final chunk)
        base["kv_transfer_params"] = {"remote_block_ids": [[1, 2]], "remote_engine_id": "D", "remote_host": "h"}
    where = draw(st.sampled_from(["top", "choice", "delta", "list"]))
    slot = {"top": base, "choice": base["choices"][0], "delta": base["choices"][0]["delta"]}.get(where)
    if slot is None:
        base["extra"] = [1, {"@@": 0}]
    else:
        slot["@@"] = 0
    text = json.dumps(base).replace('"@@": 0', f'"{key}": {value}')
    if draw(st.booleans()):  # not JSON any more: cut after the secret, or garbage in front
        if draw(st.booleans()):
            text = text[:text.index(secret) + len(secret) + draw(st.integers(0, 3))]
        else:
            text = "x" + text
    return text.encode()


def forward(stream: bytes, points: list[int]) -> tuple[bytes, TurnCapture]:
    """What proxy.py sends the client for D's ``stream`` (cut at ``points``): splitter, then capture."""
    splitter, capture, out = SSESplitter(), TurnCapture(chat=True), b""
    points = sorted({p % (len(stream) + 1) for p in points})
    pieces = [stream[a:b] for a, b in zip([0] + points, points + [len(stream)])]
    for piece in pieces:
        for ev in splitter.feed(piece):
            replacement = capture.on_event(ev.data) if ev.data is not None else None
            out += ev.raw if replacement is None else format_event(replacement)
    for ev in splitter.flush():
        replacement = capture.on_event(ev.data) if ev.data is not None else None
        out += ev.raw if replacement is None else format_event(replacement)
    capture.finish()
    return out, capture


def event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


@settings(max_examples=400, deadline=None)
@given(payload=leaky_payload(), points=st.lists(st.integers(0, 2000), max_size=4))
def test_no_spelling_of_a_kv_location_survives_the_stream(payload, points):
    stream = event(b'{"choices":[{"index":0,"delta":{"content":"a"}}]}') + event(payload) + b"data: [DONE]\n\n"
    out, capture = forward(stream, points)
    assert client_view_leaks(out) == [], (payload, out)
    assert b"[DONE]" in out


def test_a_comment_that_could_carry_locations_is_dropped_and_a_clean_stream_is_untouched():
    leaky = b": kv_transfer_params " + SECRET.encode() + b"\n\n"
    clean = event(b'{"choices":[{"index":0,"delta":{"content":"remote control \\\\u00e9"}}]}') + b": ping\n\n"
    out, _ = forward(leaky + clean + b"data: [DONE]\n\n", [])
    assert client_view_leaks(out) == []
    assert parse_sse(out) == parse_sse(clean + b"data: [DONE]\n\n")  # a mention inside a text is no location


@pytest.mark.parametrize("payload", [
    b'{"choices": [], "x": {"remote_host": "' + SECRET.encode() + b'"}, "x": 1}',
    b'{"choices": [], "kv_transfer_params": {"remote_host": "' + SECRET.encode() + b'"}, "kv_transfer_params": null}',
    b'{"choices": [], "kv_transfer_params": {"remote_host": "' + SECRET.encode() + b'"}, "kv_transfer_params": {}}',
])
def test_a_key_given_twice_cannot_smuggle_the_first_value(payload):
    """Python keeps a repeated key's last value, some client parsers the first: what leaves the router
    is re-encoded from what it parsed, never the upstream's bytes."""
    out, _ = forward(event(payload) + b"data: [DONE]\n\n", [])
    assert SECRET.encode() not in out, out


def test_an_unparseable_event_that_mentions_params_becomes_an_error_and_the_turn_is_not_stored():
    stream = event(b'{"choices":[{"index":0,"text":"a"}]}') + event(b'{"kv_transfer_params": {"remote_host": "'
                                                                     + SECRET.encode() + b'"') + b"data: [DONE]\n\n"
    out, capture = forward(stream, [])
    assert client_view_leaks(out) == []
    assert any(isinstance(e, dict) and "error" in e for e in parse_sse(out))
    assert not capture.complete


def test_params_spelt_with_escapes_are_still_captured_for_the_next_turn():
    params = {"remote_block_ids": [[1, 2]], "remote_engine_id": "D", "remote_host": "h"}
    payload = json.dumps({"choices": [{"index": 0, "text": "a"}], "kv_transfer_params": params}).replace(
        "kv_transfer_params", "kv_transfer_param\\u0073").encode()
    out, capture = forward(event(payload) + b"data: [DONE]\n\n", [])
    assert client_view_leaks(out) == []
    assert capture.kv_params == params and capture.complete


# -- end to end, through the router --------------------------------------------------------------
@pytest.fixture(scope="module")
def deployment():
    lt = LoopThread()
    dep = Deployment(notify_wait_s=0.05)
    lt.run(dep.__aenter__())
    yield lt, dep
    dep.d.fault = dep.p.fault = None
    lt.run(dep.__aexit__(None, None, None))
    lt.close()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=leaky_payload(), stream=st.booleans())
def test_no_leak_from_d_through_the_router(deployment, payload, stream):
    lt, dep = deployment
    dep.p.fault = None
    if stream:
        dep.d.fault, dep.d.inject = "inject_events", [payload]
    else:
        try:
            fields = json.loads(payload)
        except ValueError:
            fields = {"raw": payload.decode()}
        dep.d.fault, dep.d.inject = "inject_json", fields
    try:
        r = lt.run(dep.chat([{"role": "user", "content": "hi"}], stream=stream))
    finally:
        dep.d.fault = None
    assert r.status == 200
    assert client_view_leaks(r.raw) == [], r.raw


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("raw", [
    json.dumps({"error": {"message": "bad", "code": 400}, "kv_transfer_params": {"remote_host": SECRET}}).encode(),
    json.dumps({"error": {"message": "bad", "detail": {"kv_transfer_params": {"remote_block_ids": SECRET}}}}).encode(),
    b'{"error": {"message": "bad"}, "kv_transfer_param\\u0073": {"remote_host": "' + SECRET.encode() + b'"}}',
    b'{"error": {"message": "bad"}, "remote_engine_id": "' + SECRET.encode() + b'"}',
])
def test_no_leak_from_upstream_error_bodies(deployment, role, raw):
    lt, dep = deployment
    fake = dep.p if role == "prefill" else dep.d
    fake.fault, fake.inject = "http_4xx_body", (400, raw)
    try:
        r = lt.run(dep.chat([{"role": "user", "content": "hi"}], stream=False))
    finally:
        fake.fault = None
    assert r.status == 400
    assert client_view_leaks(r.raw) == [], r.raw
    assert r.body["error"]["message"]  # the client still learns why
