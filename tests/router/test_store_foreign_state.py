"""What another program, a mistake or a hostile writer leaves in the shared store is a miss for that one
conversation, never the store down for all (a real redis-server): a key of the wrong Redis type where an
entry's hash should be, numbers beyond any context; and a replica whose key file maps a key to another
tenant than the fleet's does is refused at start-up."""

from __future__ import annotations

import json

import pytest

from impl.policy import ItemsPrompt, MissReason
from impl.router.store_redis import member
from tests.router.test_fleet import Fleet, assistant, offered, user
from tests.router.test_store_bad_state import _store, entry


async def _wrong_type(store, tenant: str, cid: str, kind: str) -> None:
    key = store.prefix.encode() + b"e:" + member(tenant, cid)
    await store.client.delete(key)
    if kind == "string":
        await store.client.set(key, b"not a hash")
    else:
        await store.client.rpush(key, b"a", b"b")


@pytest.mark.parametrize("kind", ["string", "list"])
async def test_a_key_of_the_wrong_redis_type_is_a_miss_for_that_key_never_the_store(redis_server, kind):
    store = await _store(redis_server)
    try:
        for cid in ("odd", "good"):
            await store.record_success("t", cid, entry([1, 2]), now=0.0)
        await _wrong_type(store, "t", "odd", kind)
        assert (await store.lookup("t", "odd", ItemsPrompt([1, 2, 3]), now=1.0)).miss is MissReason.CORRUPT
        assert (await store.lookup("t", "good", ItemsPrompt([1, 2, 3]), now=1.0)).hit  # the store is up
        assert store.errors == 0
        await _wrong_type(store, "t", "good", kind)
        assert await store.get("t", "good") is None  # a heartbeat's read: nothing to renew, store still up
        assert await store.replace("t", "good", entry([1]), now=1.0, expect="1") is False
        assert await store.forget("t", "good", expect="1") is False
        await store.record_success("t", "odd", entry([1, 2]), now=1.0)  # a new turn writes over it
        assert (await store.lookup("t", "odd", ItemsPrompt([1, 2, 3]), now=2.0)).hit
        assert store.errors == 0
    finally:
        await store.close()


@pytest.mark.parametrize("field, value", [("num_tokens", 10**30), ("num_tokens", 1e30), ("num_tokens", -5),
                                          ("held_len", 10**20), ("expires_at", float("nan"))])
async def test_numbers_beyond_any_context_read_from_the_store_are_a_miss(redis_server, field, value):
    store = await _store(redis_server)
    try:
        await store.record_success("t", "c", entry([1, 2]), now=0.0)
        key = store.prefix.encode() + b"e:" + member("t", "c")
        data = json.loads(await store.client.hget(key, "d"))
        data[field] = value
        await store.client.hset(key, "d", json.dumps(data).encode())
        assert (await store.lookup("t", "c", ItemsPrompt([1, 2, 3]), now=1.0)).miss is MissReason.CORRUPT
    finally:
        await store.close()


async def test_through_the_router_a_huge_stored_token_count_never_reaches_headers_or_counters(redis_server):
    async with Fleet(redis_server.url, n=1) as fleet:
        r1 = await fleet.chat(0, [user("big q1")], "big")
        await fleet.settle()
        store = fleet.router(0).conversations
        key = store.prefix.encode() + b"e:" + member("default", "big")
        data = json.loads(await store.client.hget(key, "d"))
        data["num_tokens"] = 10**30
        await store.client.hset(key, "d", json.dumps(data).encode())
        r2 = await fleet.chat(0, [user("big q1"), assistant(r1.answer), user("big q2")], "big")
        assert r2.status == 200 and offered(r2) == 0
        assert "1000000000000000000000000000000" not in fleet.router(0).metrics.registry.render()


async def test_a_replica_mapping_a_key_to_another_tenant_is_refused_at_start_up(redis_server):
    async with Fleet(redis_server.url, n=1, keys={"tenantA": "key-a", "tenantB": "key-b"}) as fleet:
        stored = await fleet.router(0).conversations.client.hgetall(fleet.router(0).conversations.prefix + "key_map")
        assert len(stored) == 2 and not any(b"key-" in k or b"tenant" in v for k, v in stored.items())
        fleet.keys = {"tenantA": "key-b"}  # B's key is tenantA on this replica: it would read A's entries
        fleet.apps.append(None), fleet.runners.append(None), fleet.urls.append("")
        with pytest.raises(ValueError, match="belong to another tenant"):
            await fleet.start_router(1)
        fleet.n = 2  # stopped with the fleet
        fleet.keys = {"tenantA": "key-a", "tenantB": "key-b", "tenantC": "key-c"}  # a key added: fine
        await fleet.start_router(1)
        fleet.n = 2  # stopped with the fleet
