"""vLLM's ``cache_salt`` partitions the prefix cache per user within a tenant; the keys the router derives
for a conversation (history digests, completion anchors, ``prompt_cache_key``) are partitioned by it too,
so a client with another salt who resends someone's history learns nothing of it and takes nothing."""

from __future__ import annotations

import pytest

from tests.router.harness import Deployment
from tests.router.test_heartbeat import assistant, user


async def test_history_keys_of_another_cache_salt_never_match_nor_use_up_the_entry():
    async with Deployment(style="final_chunk") as dep:
        x1 = await dep.chat([user("x q1")], cache_salt="user-X")
        assert x1.status == 200
        await dep.settle()
        history = [user("x q1"), assistant(x1.answer), user("x q2")]
        y = await dep.chat(history, cache_salt="user-Y")  # Y resends X's exchange under its own salt
        assert y.status == 200
        assert y.headers["X-Bidikv-Reuse-Match"] == "none" and y.headers["X-Bidikv-Reuse-Offered-Tokens"] == "0"
        unsalted = await dep.chat(history)  # no salt is a partition of its own too
        assert unsalted.headers["X-Bidikv-Reuse-Offered-Tokens"] == "0"
        x2 = await dep.chat(history, cache_salt="user-X")  # X's own next turn still finds it
        assert x2.headers["X-Bidikv-Reuse-Match"] == "history" and int(x2.headers["X-Bidikv-Reuse-Offered-Tokens"]) > 0


async def test_completion_anchors_of_another_cache_salt_never_match():
    async with Deployment(style="final_chunk") as dep:
        prompt = "p" * 300
        x1 = await dep.completion(prompt, cache_salt="user-X")
        await dep.settle()
        follow = prompt + x1.answer + " next"
        y = await dep.completion(follow, cache_salt="user-Y")
        assert y.headers["X-Bidikv-Reuse-Offered-Tokens"] == "0"
        x2 = await dep.completion(follow, cache_salt="user-X")
        assert int(x2.headers["X-Bidikv-Reuse-Offered-Tokens"]) > 0


async def test_a_prompt_cache_key_is_scoped_by_cache_salt():
    async with Deployment(style="final_chunk") as dep:
        x1 = await dep.chat([user("k q1")], prompt_cache_key="shared-key", cache_salt="user-X")
        await dep.settle()
        history = [user("k q1"), assistant(x1.answer), user("k q2")]
        y = await dep.chat(history, prompt_cache_key="shared-key", cache_salt="user-Y")
        assert y.headers["X-Bidikv-Reuse-Offered-Tokens"] == "0"
        x2 = await dep.chat(history, prompt_cache_key="shared-key", cache_salt="user-X")
        assert x2.headers["X-Bidikv-Reuse-Match"] == "prompt_cache_key"
        assert int(x2.headers["X-Bidikv-Reuse-Offered-Tokens"]) > 0


@pytest.mark.parametrize("salt", [7, "", "s" * 257, ["a"]])
async def test_a_malformed_cache_salt_is_refused_naming_the_field(salt):
    async with Deployment() as dep:
        r = await dep.chat([user("q")], cache_salt=salt)
        assert r.status == 400 and r.body["error"]["param"] == "cache_salt"
