"""Bad state in the shared store is a miss for that conversation, never a 500 and never the whole store
(a real redis-server; the entries are damaged the way another program, a bug or a newer router would)."""

from __future__ import annotations

import json

from impl.policy import ConversationEntry, ItemsPrompt, MissReason, sequence_digest
from impl.router.store_redis import ENTRY_FORMAT, RedisStore, member
from tests.redis_server import unique_prefix
from tests.router.test_fleet import Fleet, assistant, offered, user


def entry(tokens: list[int]) -> ConversationEntry:
    return ConversationEntry("d0", {"remote_num_tokens": len(tokens)}, 100.0, len(tokens), len(tokens),
                             sequence_digest(tokens))


async def _store(redis_server) -> RedisStore:
    return RedisStore.from_url(redis_server.url, clock_offset=0.0, timeout_s=10.0, prefix=unique_prefix())


async def _set_field(store: RedisStore, tenant: str, cid: str, field: str, value: bytes) -> None:
    key = store.prefix.encode() + b"e:" + member(tenant, cid)
    await store.client.hset(key, field, value)


async def test_an_undecodable_entry_is_a_miss_deleted_and_the_rest_of_the_store_serves(redis_server, caplog):
    store = await _store(redis_server)
    try:
        for cid in ("bad", "good", "worse"):
            await store.record_success("t", cid, entry([1, 2]), now=0.0)
        await _set_field(store, "t", "bad", "d", b"\x00garbage{")
        await _set_field(store, "t", "worse", "d", json.dumps({"kv_params": 3}).encode())
        for cid in ("bad", "worse"):
            assert (await store.lookup("t", cid, ItemsPrompt([1, 2, 3]), now=1.0)).miss is MissReason.CORRUPT
            # deleted: the next lookup is an ordinary miss, and the next turn can store again
            assert (await store.lookup("t", cid, ItemsPrompt([1, 2, 3]), now=1.0)).miss is MissReason.UNKNOWN
        assert (await store.lookup("t", "good", ItemsPrompt([1, 2, 3]), now=1.0)).hit
        assert store.bad_entries["corrupt"] == 2
        assert sum("cannot use" in r.message for r in caplog.records) == 1  # logged once per kind
        assert await store.get("t", "good") is not None
    finally:
        await store.close()


async def test_a_non_numeric_field_does_not_mark_the_store_down(redis_server):
    store = await _store(redis_server)
    try:
        await store.record_success("t", "c", entry([1]), now=0.0)
        await store.record_success("t", "other", entry([1]), now=0.0)
        await _set_field(store, "t", "c", "u", b"not a number")  # the Lua script compares it as a number
        assert (await store.lookup("t", "c", ItemsPrompt([1, 2]), now=1.0)).miss is MissReason.CORRUPT
        assert (await store.lookup("t", "other", ItemsPrompt([1, 2]), now=1.0)).hit  # the store is still up
    finally:
        await store.close()


async def test_a_newer_routers_entry_is_a_miss_kept_for_it(redis_server):
    """Rolling upgrade: an older replica misses on a newer format and leaves the entry to the newer ones."""
    store = await _store(redis_server)
    try:
        await store.record_success("t", "c", entry([1]), now=0.0)
        key = store.prefix.encode() + b"e:" + member("t", "c")
        data = json.loads(await store.client.hget(key, "d"))
        assert data["fmt"] == ENTRY_FORMAT
        data["fmt"] = ENTRY_FORMAT + 1
        await store.client.hset(key, "d", json.dumps(data).encode())
        assert (await store.lookup("t", "c", ItemsPrompt([1, 2]), now=1.0)).miss is MissReason.OTHER_VERSION
        assert await store.client.exists(key)  # kept
        # and an entry without the field (written before it existed) still reads as format 1
        del data["fmt"]
        await store.client.hset(key, "d", json.dumps(data).encode())
        assert (await store.lookup("t", "c", ItemsPrompt([1, 2]), now=1.0)).hit
    finally:
        await store.close()


async def test_through_the_router_a_damaged_entry_is_a_served_turn(redis_server):
    async with Fleet(redis_server.url, n=1) as fleet:
        r1 = await fleet.chat(0, [user("q1")], "damaged")
        await fleet.settle()
        store = fleet.router(0).conversations
        await _set_field(store, "default", "damaged", "d", b"[1, 2")
        r2 = await fleet.chat(0, [user("q1"), assistant(r1.answer), user("q2")], "damaged")
        assert r2.status == 200 and r2.done and offered(r2) == 0
        await fleet.settle()
        await _set_field(store, "default", "damaged", "d", b"{\"fmt\": \"x\"}")
        hb = await fleet.post(0, "/v1/conversations/damaged/heartbeat", {})
        assert hb.status == 404, hb.raw  # nothing this router can renew: as if unknown, never a 500
        assert fleet.router(0).metrics.reuse_misses.get("corrupt") == 1
