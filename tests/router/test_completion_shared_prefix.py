"""``/v1/completions`` conversations that share a long prefix (a few-shot or system preamble) each find
their own previous turn: their anchors fall inside the shared prefix, and the held sequences listed
under an anchor are told apart by what follows it, the earlier answer included."""

from __future__ import annotations

from tests.router.harness import Deployment

SHARED = "You are a careful assistant. Examples follow. " * 18  # 828 characters: every anchor below 1,024 is inside


def _offered(r) -> int:
    return int(r.headers.get("X-Bidikv-Reuse-Offered-Tokens", "0"))


async def test_interleaved_completion_conversations_sharing_a_long_prefix_each_reuse_their_own_turn():
    for prompt_kind in ("text", "tokens"):
        async with Deployment(style="final_chunk") as dep:
            if prompt_kind == "text":
                prompts = [SHARED + f"User {c}: question one.\n" for c in range(4)]
            else:
                prompts = [list(range(1, 801)) + [5000 + c, 6000 + c] for c in range(4)]
            hits = 0
            for turn in range(4):
                for c in range(4):  # interleaved: every conversation's turn between two of another's
                    r = await dep.completion(prompts[c])
                    assert r.status == 200
                    await dep.settle()
                    if turn:
                        hits += _offered(r) > 0
                        assert r.headers["X-Bidikv-Reuse-Match"] == "history"
                    if prompt_kind == "text":
                        prompts[c] = prompts[c] + r.answer + f"\nUser {c}: and then {turn}.\n"
                    else:
                        ids = [t["token_ids"] for t in r.events if isinstance(t, dict) for t in t["choices"]]
                        prompts[c] = prompts[c] + [i for chunk in ids for i in chunk] + [7000 + c, turn]
            assert hits == 12, (prompt_kind, hits)
            # and each was offered its own conversation's blocks: the D request P was offered is this prompt's
            offered = [b["kv_transfer_params"]["remote_request_id"] for b in dep.p.prefill_requests()
                       if b["kv_transfer_params"].get("remote_request_id")]
            assert len(offered) == len(set(offered)) == 12


async def test_a_prompt_that_continues_another_conversations_prefix_only_is_not_offered_its_turn():
    async with Deployment(style="final_chunk") as dep:
        a = SHARED + "User A: the first question.\n"
        r = await dep.completion(a)
        await dep.settle()
        other = SHARED + "User B: something else entirely, at length.\n"
        assert _offered(await dep.completion(other)) == 0
        assert _offered(await dep.completion(a + r.answer + "\nUser A: next.\n")) > 0


async def test_across_two_replicas_sharing_redis_each_conversation_still_finds_its_own_turn(redis_server):
    from tests.router.test_fleet import Fleet

    async with Fleet(redis_server.url, n=2) as fleet:
        prompts = [SHARED + f"User {c}: question one.\n" for c in range(4)]
        hits = 0
        for turn in range(3):
            for c in range(4):
                replica = (turn + c) % 2  # each turn on the other replica than the conversation's last
                r = await fleet.post(replica, "/v1/completions", {"model": "fake-model", "prompt": prompts[c],
                                                                   "max_tokens": 16, "stream": False})
                assert r.status == 200
                await fleet.settle()
                hits += turn > 0 and _offered(r) > 0
                prompts[c] = prompts[c] + r.body["choices"][0]["text"] + f"\nUser {c}: and then {turn}.\n"
        assert hits == 8
