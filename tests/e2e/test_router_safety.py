"""The router's safety properties on the real deployment: what the upstream flow (vLLM's example proxy)
gets wrong, and that the router does not.

- Rewritten history: sent the upstream way (P then D, D's params passed straight back), P reads D's
  blocks although the prompt no longer continues them. Through the router it reads nothing
  (tests/e2e/test_bidirectional.py::test_rewritten_history_does_not_pull).
- Tenants: a second router with two API keys runs in front of the same P and D; another tenant using
  the same conversation id gets no reuse, not even of P's prefix cache, and the owner's next turn
  still pulls.
"""

from __future__ import annotations

import uuid

import pytest

from tests.e2e.client import chat, direct_turn
from tests.e2e.conftest import E2E, router_counters, unique_system
from tests.e2e.deployment import router_process, wait_healthy
from tests.e2e.test_bidirectional import LONG, SHORT, assert_no_pull, assert_pulled_from_d, reference_text, user

KEYS = {"alice": "sk-alice-e2e", "bob": "sk-bob-e2e"}
METRICS_TOKEN = "metrics-e2e"


def test_upstream_flow_with_a_rewritten_history_pulls_only_what_precedes_the_edit(e2e: E2E):
    """The hazard of vLLM #43094/#44838 on the upstream flow (no router: D's params straight back to
    P): upstream P pulls D's blocks although the edit sits inside them. Our P verifies token ids."""
    from tests.e2e.test_token_exact import common_prefix

    messages = [unique_system("stale"), user("Describe how a steam engine works, step by step. " * 3)]
    first_ref = chat(e2e.reference, messages, max_tokens=LONG, stream=False, return_token_ids=True)
    first = direct_turn(e2e.prefill, e2e.decode, messages, LONG, None)
    held = first_ref.prompt_token_ids + first_ref.token_ids[:-1]
    rewritten = first.text[: len(first.text) // 2] + " (edited by the client) " + first.text[len(first.text) // 2:]
    messages = messages + [{"role": "assistant", "content": rewritten}, user("And the condenser? " * 5)]
    second_ref = chat(e2e.reference, messages, max_tokens=SHORT, stream=False, return_token_ids=True)
    before = e2e.counters()
    second = direct_turn(e2e.prefill, e2e.decode, messages, SHORT, first.kv_transfer_params)
    d = e2e.settled_delta(before)
    agree = common_prefix(held, second_ref.prompt_token_ids)
    report = second.prefill_params["bidikv_reuse"]
    assert report["offered"] > agree  # offered beyond the edit ...
    assert d["p"]["external_tokens"] == report["pulled"] <= report["verified"] <= agree, (d, report, agree)
    assert report["pulled"] >= e2e.threshold, report  # ... and the history before it still reused
    assert second.text == second_ref.text


@pytest.fixture(scope="module")
def tenant_router(e2e: E2E):
    dep = e2e.deployment
    router = router_process(e2e.prefill, e2e.decode, dep.spec, e2e.log_dir, name="router-tenants",
                            env={"BIDIKV_API_KEYS": ",".join(f"{t}={k}" for t, k in KEYS.items()),
                                 "BIDIKV_METRICS_TOKEN": METRICS_TOKEN})
    router.start()
    try:
        wait_healthy([router], 60.0)
        yield router.url
    finally:
        router.stop()


def test_another_tenant_with_the_same_conversation_id_pulls_nothing(e2e: E2E, tenant_router: str):
    cid = f"shared-id-{uuid.uuid4().hex}"
    alice = [unique_system("alice"), user("Explain how a refrigerator keeps food cold. " * 3)]
    first = chat(tenant_router, alice, max_tokens=LONG, conversation_id=cid, api_key=KEYS["alice"])
    alice += [{"role": "assistant", "content": first.text}, user("Why does it hum at night? " * 5)]

    def turn(messages, key, max_tokens):
        before, r_before = e2e.counters(), router_counters(tenant_router, METRICS_TOKEN)
        got = chat(tenant_router, messages, max_tokens=max_tokens, conversation_id=cid, api_key=key)
        d, r = e2e.settled_delta(before), router_counters(tenant_router, METRICS_TOKEN)
        d["router"] = {k: r[k] - r_before[k] for k in r}
        assert got.text == reference_text(e2e, messages, max_tokens)
        return got, d

    # bob happens to use alice's conversation id for a conversation of his own
    bob = [unique_system("bob"), user("Explain how a kettle whistles. " * 3)]
    _, d = turn(bob, KEYS["bob"], SHORT)
    assert d["router"]["hits"] == 0 and d["router"]["unknown_misses"] == 1 and d["router"]["tenant_misses"] == 0, d
    assert_no_pull(d, 1)

    # alice's entry survived: her turn 2 reads D's blocks
    second, d = turn(alice, KEYS["alice"], LONG)
    assert_pulled_from_d(d, 2)

    # bob replays alice's exact history under her id: a perfect continuation, still not his to reuse,
    # neither D's blocks through the router nor P's prefix cache (the router salts it per tenant:
    # unsalted, P would serve bob alice's cached prefix, and its timing would tell him she sent it)
    alice += [{"role": "assistant", "content": second.text}, user("Is that normal? " * 5)]
    replay, d = turn(alice, KEYS["bob"], SHORT)
    # the router may offer bob *his own* previous turn under that id (P verifies token ids, so the
    # router no longer compares messages); nothing of it agrees with alice's history, nothing is pulled
    assert d["router"]["hits"] == 0 or replay.headers.get("X-Bidikv-Reuse-Verified-Tokens") == "0", (d, replay.headers)
    assert_no_pull(d, 3)
    # D has a prefix cache holding alice's history (P runs without one): not for bob
    assert d["d"]["local_cache_tokens"] == 0, f"bob hit alice's blocks in D's prefix cache: {d}"


def test_a_request_without_a_key_is_refused(e2e: E2E, tenant_router: str):
    import urllib.error

    with pytest.raises(urllib.error.HTTPError) as err:
        chat(tenant_router, [user("hello")], max_tokens=2, conversation_id="no-key")
    assert err.value.code == 401
