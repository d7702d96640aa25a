"""The continuation guard covers D's answer, for every prompt kind the router stores (mutants
that store the held sequence without the answer survived every test but the chat one).

D holds the prompt *and* what it generated; a next turn that resends an edited answer must not be
offered that KV, whichever way the prompt is given: chat messages, a text prompt, token ids. The
refused turn then runs (and is stored) like any other, so the turn after it reuses *its* KV.
"""

from __future__ import annotations

from tests.router.harness import Deployment


def offered(dep: Deployment, turn: int) -> bool:
    """Did P's request for the ``turn``-th prefill carry D's blocks?"""
    return bool(dep.p.prefill_requests()[turn]["kv_transfer_params"].get("remote_block_ids"))


async def test_text_prompt_with_an_edited_answer_is_not_offered_the_kv():
    async with Deployment() as dep:
        prompt1 = "Tell me a story."
        r1 = await dep.completion(prompt1, conversation_id="c")
        assert r1.status == 200 and r1.done and r1.answer
        prompt2 = prompt1 + r1.answer[:-2] + "\nUser: more"  # the client trimmed D's answer
        r2 = await dep.completion(prompt2, conversation_id="c")
        assert r2.status == 200 and r2.done and not offered(dep, 1)
        assert dep.router.metrics.reuse_misses.get("guard") == 1
        r3 = await dep.completion(prompt2 + r2.answer + "\nUser: again", conversation_id="c")
        assert r3.status == 200 and offered(dep, 2)  # the answer kept verbatim: reused


async def test_token_prompt_with_other_output_ids_is_not_offered_the_kv():
    async with Deployment(chunks=4) as dep:
        generated = [1000, 1001, 1002, 1003]  # the fake D's token ids, one per chunk, for every turn
        r1 = await dep.completion([11, 12, 13], conversation_id="c")
        assert r1.status == 200 and r1.done
        prompt2 = [11, 12, 13, 1000, 1001, 9999, 1003, 14]  # one generated id replaced
        r2 = await dep.completion(prompt2, conversation_id="c")
        assert r2.status == 200 and not offered(dep, 1)
        assert dep.router.metrics.reuse_misses.get("guard") == 1
        r3 = await dep.completion([*prompt2, *generated, 15], conversation_id="c")
        assert r3.status == 200 and offered(dep, 2)


async def test_chat_with_an_edited_answer_is_not_offered_the_kv():
    async with Deployment() as dep:
        q1 = {"role": "user", "content": "q1"}
        r1 = await dep.chat([q1], conversation_id="c")
        history2 = [q1, {"role": "assistant", "content": r1.answer + " (edited)"}, {"role": "user", "content": "q2"}]
        r2 = await dep.chat(history2, conversation_id="c")
        assert r2.status == 200 and r2.done and not offered(dep, 1)
        r3 = await dep.chat([*history2, {"role": "assistant", "content": r2.answer}, {"role": "user", "content": "q3"}],
                            conversation_id="c")
        assert r3.status == 200 and offered(dep, 2)
