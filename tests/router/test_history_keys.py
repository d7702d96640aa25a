"""Reuse without a conversation id: turns found by the history the client resends (impl.policy.history_key),
on scripted upstreams. The same flows on vLLM with the openai SDK: tests/e2e/test_openai_clients.py."""

from __future__ import annotations

import asyncio

from tests.router.harness import Deployment


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def offered(dep: Deployment, i: int) -> bool:
    """Whether P's i-th request was offered a previous turn's KV."""
    return bool(dep.p.prefill_requests()[i]["kv_transfer_params"].get("remote_block_ids"))


async def test_a_client_without_an_id_reuses_by_its_history():
    async with Deployment(style="notify") as dep:
        history = [{"role": "system", "content": "be brief"}, user("first")]
        r1 = await dep.chat(history)
        assert r1.headers["X-Bidikv-Reuse-Match"] == "none"
        await dep.settle()
        history += [assistant(r1.answer), user("second")]
        r2 = await dep.chat(history)
        assert r2.headers["X-Bidikv-Reuse-Match"] == "history" and int(r2.headers["X-Bidikv-Reuse-Offered-Tokens"]) > 0
        assert offered(dep, 1) and dep.p.prefill_requests()[1]["kv_transfer_params"]["remote_engine_id"] == "D-d0"
        await dep.settle()
        history += [assistant(r2.answer), user("third")]
        await dep.chat(history, stream=False)
        assert offered(dep, 2)
        m = dep.router.metrics
        assert m.reuse_misses.get("no_history") == 1 and m.reuse_matches.get("history") == 2
        assert m.reuse_lookups.get("history") == 2 and m.reuse_misses.get("no_conversation_id") == 0


async def test_what_the_sdk_resends_matches_the_plain_answer():
    """``messages.append(completion.choices[0].message.model_dump())`` resends nulls and reasoning. The
    message-level guard would refuse that resend; a D publishing checkpoints lets P verify tokens instead."""
    async with Deployment() as dep:
        dep.d.publish_check = dep.d.reasoning = True
        r1 = await dep.chat([user("q")])
        resent = {"role": "assistant", "content": r1.answer, "refusal": None, "annotations": None, "audio": None,
                  "function_call": None, "tool_calls": [], "reasoning_content": "thinking it over"}
        await dep.chat([user("q"), resent, user("q2")])
        assert offered(dep, 1)


async def test_an_answer_with_tool_calls_is_not_stored_under_a_key_nobody_finds():
    async with Deployment() as dep:
        dep.d.publish_check = True
        dep.d.fault, dep.d.inject = "inject_json", {"message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}
        await dep.chat([user("call a tool")], stream=False)
        assert dep.router.metrics.turns_not_stored.get("unreconstructable") == 1 and len(dep.router.store) == 0


async def test_an_edited_answer_or_an_edited_question_finds_nothing():
    async with Deployment() as dep:
        r1 = await dep.chat([user("q")])
        await dep.chat([user("q"), assistant(r1.answer + " (edited)"), user("q2")])
        await dep.chat([user("q, edited"), assistant(r1.answer), user("q2")])
        assert not offered(dep, 1) and not offered(dep, 2)
        assert dep.router.metrics.reuse_misses.get("unknown") == 2


async def test_an_entry_is_offered_once_regenerating_recomputes():
    """P's read frees D's blocks: the second child of one history must not be offered them again."""
    async with Deployment() as dep:
        r1 = await dep.chat([user("q")])
        follow_up = [user("q"), assistant(r1.answer), user("q2")]
        await dep.chat(follow_up)
        await dep.chat(follow_up)  # the client regenerates the second answer
        assert offered(dep, 1) and not offered(dep, 2)
        assert dep.router.metrics.reuse_misses.get("taken") == 1


async def test_concurrent_branches_of_one_history_get_one_offer():
    async with Deployment(chunks=8) as dep:
        r1 = await dep.chat([user("root")])
        branches = [[user("root"), assistant(r1.answer), user(f"branch {i}")] for i in range(4)]
        results = await asyncio.gather(*(dep.chat(b) for b in branches))
        assert all(r.status == 200 and r.done for r in results)
        assert sum(offered(dep, i) for i in range(1, 5)) == 1
        # each branch is its own conversation from here on
        await dep.settle()
        nxt = [*branches[2], assistant(results[2].answer), user("deeper")]
        await dep.chat(nxt)
        assert offered(dep, 5)


async def test_an_explicit_id_wins_over_the_history():
    async with Deployment() as dep:
        r1 = await dep.chat([user("q")])  # stored under its history
        await dep.chat([user("q"), assistant(r1.answer), user("q2")], conversation_id="named")
        assert not offered(dep, 1)  # looked up by the id alone, which is new
        assert dep.router.metrics.reuse_lookups.get("id") == 1 and dep.router.metrics.reuse_lookups.get("history") == 0


async def test_the_most_recent_stored_turn_is_found_when_later_ones_were_not_stored():
    async with Deployment() as dep:
        r1 = await dep.chat([user("q")])
        # the second turn is not reused nor stored (n > 1), so the third is found by the first's key
        await dep.chat([user("q"), assistant(r1.answer), user("q2")], n=2)
        await dep.chat([user("q"), assistant(r1.answer), user("q2"), assistant("typed by the user"), user("q3")])
        assert offered(dep, 2)


async def test_history_lookups_zero_reuses_only_named_conversations():
    async with Deployment(history_lookups=0) as dep:
        r1 = await dep.chat([user("q")])
        await dep.chat([user("q"), assistant(r1.answer), user("q2")])
        assert not offered(dep, 1) and dep.router.metrics.reuse_misses.get("no_conversation_id") == 2
        assert len(dep.router.store) == 0


async def test_prompt_cache_key_names_the_conversation():
    async with Deployment() as dep:
        r1 = await dep.chat([user("q")], prompt_cache_key="user-42")
        r2 = await dep.chat([user("q"), assistant(r1.answer), user("q2")], prompt_cache_key="user-42")
        assert r2.headers["X-Bidikv-Reuse-Match"] == "prompt_cache_key" and offered(dep, 1)
        assert dep.p.prefill_requests()[1]["prompt_cache_key"] == "user-42"  # passed on as it came
        assert (await dep.chat([user("q")], prompt_cache_key=7)).status == 400


async def test_a_client_id_cannot_name_a_router_key():
    async with Deployment() as dep:
        r = await dep.chat([user("q")], conversation_id="\x00h:0123")
        assert r.status == 400 and r.body["error"]["param"] == "conversation_id"


async def test_tenants_do_not_share_history_keys():
    async with Deployment(keys={"a": "key-a", "b": "key-b"}) as dep:
        r1 = await dep.chat([user("same words")], key="key-a")
        await dep.chat([user("same words"), assistant(r1.answer), user("next")], key="key-b")
        assert not offered(dep, 1)
        await dep.chat([user("same words"), assistant(r1.answer), user("next")], key="key-a")
        assert offered(dep, 2)


async def test_text_completion_that_extends_the_last_one_reuses():
    async with Deployment() as dep:
        prompt1 = "System: be brief.\nUser: hi\nAssistant:"
        r1 = await dep.completion(prompt1)
        prompt2 = prompt1 + r1.answer + "\nUser: again\nAssistant:"
        r2 = await dep.completion(prompt2)
        assert r2.headers["X-Bidikv-Reuse-Match"] == "history" and offered(dep, 1)
        # the same anchor, another held text: its prefixes' exact keys name no stored turn (the guard is not
        # even reached), so it is not offered
        await dep.completion(prompt2.replace("brief", "long"))
        assert not offered(dep, 2) and dep.router.metrics.reuse_misses.get("guard") == 0


async def test_token_completion_that_extends_the_last_one_reuses():
    async with Deployment() as dep:
        prompt = list(range(10, 90))
        await dep.completion(prompt)
        out_ids = [1000 + i for i in range(4)]  # what the fake D generated
        await dep.completion(prompt + out_ids + [7, 7])
        assert offered(dep, 1)
