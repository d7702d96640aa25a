"""Router replicas sharing one real Redis (``--store redis://``), in front of the same scripted P and D.

Whichever replica a turn reaches, it gets the previous turn's D params (final chunk, and the vLLM 0.32
notification path even when the notification lands after the client has [DONE]); a router restart
keeps the conversations; a replica killed mid-stream leaves the conversation to the others with
reuse; Redis killed -> every turn still answered, without reuse, counted, and reuse returns with
Redis; vLLM's session key (``session_id`` / ``X-Session-ID``, vLLM PR #48048) names the conversation;
a heartbeat reaching a replica D never notified is still relayed to D's listener.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from impl.router.app import ROUTER_KEY, Router, build_app, start_site
from impl.router.config import build_config
from impl.router.tenants import Tenants
from tests.redis_server import RedisServer, unique_prefix
from tests.router.fakes import FakeVllmUpstream, free_port
from tests.router.harness import TurnResult, parse_sse
from tests.router.test_heartbeat import FakeLeaseDecode

REPO = Path(__file__).resolve().parents[2]


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


class Fleet:
    """``n`` routers with one store URL and prefix, in front of one fake P and one fake D."""

    def __init__(self, store_url: str, n: int = 2, style: str = "final_chunk", decode: FakeVllmUpstream | None = None,
                 keys: dict[str, str] | None = None, **config: Any) -> None:
        self.keys = keys
        self.p = FakeVllmUpstream("p0", role="prefill")
        self.d = decode or FakeVllmUpstream("d0", role="decode", style=style)
        self.n = n
        self.config = {"store": store_url, "store_prefix": unique_prefix(), "health_interval_s": 60.0,
                       "connect_timeout_s": 1.0, "notify_wait_s": 2.0, "store_retry_s": 0.05,
                       "store_timeout_s": 10.0, **config}  # a loaded machine can stall Redis past 0.5 s
        self.apps: list[Any] = [None] * n
        self.runners: list[Any] = [None] * n
        self.urls: list[str] = [""] * n
        self.client: aiohttp.ClientSession | None = None

    def router(self, i: int) -> Router:
        return self.apps[i][ROUTER_KEY]

    async def __aenter__(self) -> "Fleet":
        await self.p.start()
        await self.d.start()
        for i in range(self.n):
            await self.start_router(i)
        self.client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        return self

    async def start_router(self, i: int) -> None:
        config = build_config(overrides={"prefill": [self.p.url], "decode": [self.d.url], "host": "127.0.0.1",
                                         "port": 0, **self.config})
        keys = {"KEYS": ",".join(f"{t}={k}" for t, k in self.keys.items())} if self.keys else {}
        self.apps[i] = build_app(config, tenants=Tenants.load(None, "KEYS", keys), environ={})
        self.runners[i], port = await start_site(self.apps[i], "127.0.0.1", 0)
        self.urls[i] = f"http://127.0.0.1:{port}"

    async def stop_router(self, i: int) -> None:
        await self.runners[i].cleanup()
        self.runners[i] = None

    async def __aexit__(self, *exc: Any) -> None:
        await self.client.close()
        for i in range(self.n):
            if self.runners[i] is not None:
                await self.stop_router(i)
        await self.p.stop()
        await self.d.stop()

    async def post(self, i: int, path: str, body: Any, headers: dict[str, str] | None = None) -> TurnResult:
        async with self.client.post(self.urls[i] + path, data=json.dumps(body).encode(),
                                    headers={"Content-Type": "application/json", **(headers or {})}) as resp:
            payload = await resp.read()
            if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                return TurnResult(resp.status, parse_sse(payload), payload, headers=dict(resp.headers))
            return TurnResult(resp.status, raw=payload, body=json.loads(payload) if payload else None,
                              headers=dict(resp.headers))

    async def chat(self, i: int, messages: list[dict], cid: str | None = None, headers: dict[str, str] | None = None,
                   **extra: Any) -> TurnResult:
        body = {"model": "fake-model", "messages": messages, "stream": True, "max_tokens": 16, **extra}
        if cid is not None:
            body["conversation_id"] = cid
        return await self.post(i, "/v1/chat/completions", body, headers)

    async def settle(self) -> None:
        for i in range(self.n):
            if self.runners[i] is not None:
                await self.router(i).proxy.recorder.settle()


def offered(r: TurnResult) -> int:
    return int(r.headers["X-Bidikv-Reuse-Offered-Tokens"])


async def three_turns(fleet: Fleet, cid: str, replicas: list[int], settle: bool = True) -> list[TurnResult]:
    messages, results = [user(f"{cid} q1")], []
    for n, i in enumerate(replicas):
        r = await fleet.chat(i, messages, cid)
        assert r.status == 200 and r.done and r.error is None, (r.status, r.raw[-300:])
        results.append(r)
        if settle:
            await fleet.settle()
        messages = messages + [assistant(r.answer), user(f"{cid} q{n + 2}")]
    return results


@pytest.mark.parametrize("style", ["final_chunk", "notify"])
async def test_turns_alternating_replicas_each_get_the_previous_turns_params(redis_server, style):
    async with Fleet(redis_server.url, style=style) as fleet:
        results = await three_turns(fleet, "conv", [0, 1, 0])
        assert [offered(r) > 0 for r in results] == [False, True, True]
        pulls = fleet.p.prefill_requests()
        issued = list(fleet.d.issued_d_params)  # D's request ids, in the order D answered
        # turn 2 (replica 1) and turn 3 (replica 0) each handed P exactly the previous turn's D params
        assert [b["kv_transfer_params"].get("remote_request_id") for b in pulls[1:]] == issued[:2]
        assert sum(fleet.router(i).metrics.reuse_hits.get() for i in range(2)) == 2


async def test_a_late_notification_on_one_replica_is_waited_for_by_the_next_turn_on_another(redis_server):
    """vLLM 0.32: D's params arrive after the client's [DONE]; the client's next turn, on the other replica,
    must neither miss nor be offered the turn before (whose blocks this turn's P already read)."""
    async with Fleet(redis_server.url, style="notify") as fleet:
        fleet.d.notify_delay_s = 0.3
        results = await three_turns(fleet, "late", [0, 1, 0], settle=False)  # no waiting between turns
        assert [offered(r) > 0 for r in results] == [False, True, True]
        pulls = fleet.p.prefill_requests()
        assert [b["kv_transfer_params"].get("remote_request_id") for b in pulls[1:]] == list(fleet.d.issued_d_params)[:2]


async def test_a_router_restart_keeps_the_conversations(redis_server):
    async with Fleet(redis_server.url, n=1) as fleet:
        messages = [user("restart q1")]
        r1 = await fleet.chat(0, messages, "restart")
        await fleet.settle()
        await fleet.stop_router(0)
        await fleet.start_router(0)  # a new process's worth of state: only Redis remembers
        r2 = await fleet.chat(0, messages + [assistant(r1.answer), user("restart q2")], "restart")
        assert r2.status == 200 and offered(r2) > 0


async def test_a_replica_killed_mid_stream_leaves_the_conversation_to_the_others_with_reuse(redis_server):
    """Replica 0 is a real router process, SIGKILLed while it streams turn 2; the client retries turn 2
    on replica 0, which serves it without reuse (turn 1's entry was taken by the killed replica: single
    use), and the conversation's next turn reuses the retry's KV through the shared store."""
    async with Fleet(redis_server.url, n=1) as fleet:
        port = free_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "impl.router", "--prefill", fleet.p.url, "--decode", fleet.d.url, "--host", "127.0.0.1",
            "--port", str(port), "--store", redis_server.url, "--store-prefix", fleet.config["store_prefix"],
            "--store-timeout-s", "10",
            "--health-interval-s", "60", "--log-level", "warning", cwd=str(REPO),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        try:
            killed = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:  # until the process answers /health
                try:
                    async with fleet.client.get(killed + "/health") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline and proc.returncode is None, "router process did not start"
                await asyncio.sleep(0.05)
            fleet.urls.append(killed)  # replica 1 of the fleet: the process
            messages = [user("killed q1")]
            r1 = await fleet.post(1, "/v1/chat/completions", {"model": "m", "messages": messages, "stream": True,
                                                              "max_tokens": 16, "conversation_id": "killed"})
            assert r1.status == 200 and r1.done
            turn1_rid = list(fleet.d.issued_d_params)[0]
            messages = messages + [assistant(r1.answer), user("killed q2")]
            fleet.d.chunk_delay_s = 0.5  # turn 2 streams slowly: time to kill its replica in the middle
            stream = asyncio.create_task(fleet.post(1, "/v1/chat/completions", {
                "model": "m", "messages": messages, "stream": True, "max_tokens": 16, "conversation_id": "killed"}))
            while len(fleet.d.decode_requests()) < 2:  # turn 2 has reached D through the process
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            proc.kill()
            await proc.wait()
            with pytest.raises(aiohttp.ClientError):
                await stream  # the client saw its replica die mid-stream
            fleet.d.chunk_delay_s = 0.0
            retry = await fleet.chat(0, messages, "killed")  # ... and retries on the other replica
            # which recomputes: turn 1's entry left the shared store when the killed replica offered it
            # (P read those blocks, and D frees blocks once read)
            assert retry.status == 200 and retry.done and offered(retry) == 0
            assert fleet.p.prefill_requests()[-1]["kv_transfer_params"].get("remote_request_id") != turn1_rid
            await fleet.settle()
            messages = messages + [assistant(retry.answer), user("killed q3")]
            r3 = await fleet.chat(0, messages, "killed")  # the retry was stored: reuse goes on from it
            assert r3.status == 200 and r3.done and offered(r3) > 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_redis_down_every_turn_is_served_without_reuse_and_reuse_returns_with_it():
    server = RedisServer().start()
    try:
        async with Fleet(server.url) as fleet:
            messages = [user("down q1")]
            r = await fleet.chat(0, messages, "down")
            await fleet.settle()
            server.stop()
            for n in range(2, 5):  # turns on both replicas while Redis is dead
                messages = messages + [assistant(r.answer), user(f"down q{n}")]
                r = await fleet.chat(n % 2, messages, "down")
                assert r.status == 200 and r.done and r.error is None and offered(r) == 0
            m0, m1 = fleet.router(0).metrics, fleet.router(1).metrics
            assert m0.reuse_misses.get("store_unavailable") + m1.reuse_misses.get("store_unavailable") == 3
            assert m0.turns_not_stored.get("store_unavailable") + m1.turns_not_stored.get("store_unavailable") >= 1
            server.start()  # back, empty (no persistence)
            # the first turns after it returns store again (once a replica's retry_s pause is over);
            # poll until a turn is offered reuse rather than guessing a delay
            deadline = time.monotonic() + 15
            hits = 0
            while not hits:
                assert time.monotonic() < deadline, "reuse never came back after Redis returned"
                messages = messages + [assistant(r.answer), user("again")]
                r = await fleet.chat(0, messages, "down")
                assert r.status == 200 and r.done
                await fleet.settle()
                hits = offered(r)
    finally:
        server.close()


async def test_session_id_and_x_session_id_name_the_conversation(redis_server):
    async with Fleet(redis_server.url) as fleet:
        messages = [user("session q1")]
        r1 = await fleet.chat(0, messages, session_id="sess-1")
        await fleet.settle()
        messages = messages + [assistant(r1.answer), user("session q2")]
        r2 = await fleet.chat(1, messages, headers={"X-Session-ID": "sess-1"})
        assert r2.status == 200 and offered(r2) > 0
        assert all("session_id" not in r.body for r in fleet.d.received + fleet.p.received)  # vLLM 0.32 has no such field
        bad = await fleet.chat(0, messages, "other", session_id="sess-1")
        assert bad.status == 400 and bad.body["error"]["param"] == "session_id"
        bad = await fleet.chat(0, messages, session_id="a", headers={"X-Session-ID": "b"})
        assert bad.status == 400 and bad.body["error"]["param"] == "session_id"


async def test_a_heartbeat_on_a_replica_d_never_notified_is_relayed(redis_server):
    d = FakeLeaseDecode("d0", role="decode", style="notify")
    async with Fleet(redis_server.url, decode=d) as fleet:
        r1 = await fleet.chat(0, [user("hb q1")], "hb")  # D notifies replica 0 only
        assert r1.status == 200
        await fleet.settle()
        await asyncio.gather(*fleet.router(0).heartbeats._sharing)  # the listener URL on its way to Redis
        hb = await fleet.post(1, "/v1/conversations/hb/heartbeat", {})
        assert hb.status == 200 and hb.body["renewed"] is True, hb.body
        assert len(d.heartbeats) == 1
        got = await fleet.router(0).conversations.get("default", "hb")
        assert got.entry.expires_at > time.monotonic() + 60  # the renewed expiry, seen by every replica


async def test_another_tenant_gets_nothing_whichever_replica_it_reaches(redis_server):
    keys = {"alice": "sk-alice", "bob": "sk-bob"}
    async with Fleet(redis_server.url, keys=keys) as fleet:
        alice = {"Authorization": "Bearer sk-alice"}
        messages = [user("tenant q1")]
        r1 = await fleet.chat(0, messages, "shared-id", headers=alice)
        assert r1.status == 200
        await fleet.settle()
        messages = messages + [assistant(r1.answer), user("tenant q2")]
        bob = await fleet.chat(1, messages, "shared-id", headers={"Authorization": "Bearer sk-bob"})
        assert bob.status == 200 and offered(bob) == 0  # bob replays alice's history under her id: no reuse
        again = await fleet.chat(1, messages, "shared-id", headers=alice)
        assert again.status == 200 and offered(again) > 0  # alice, on the other replica, still reuses


@pytest.mark.parametrize("style", ["final_chunk", "notify"])
async def test_without_an_id_turns_alternating_replicas_are_found_by_their_history(redis_server, style):
    async with Fleet(redis_server.url, style=style) as fleet:
        fleet.d.notify_delay_s = 0.2 if style == "notify" else 0.0  # the late-notification path too
        messages, results = [user("history q1")], []
        for n, i in enumerate([0, 1, 0]):
            r = await fleet.chat(i, messages)  # no id, no settle: the next turn follows at once
            assert r.status == 200 and r.done
            results.append(r)
            messages = messages + [assistant(r.answer), user(f"history q{n + 2}")]
        assert [r.headers["X-Bidikv-Reuse-Match"] for r in results] == ["none", "history", "history"]
        pulls = fleet.p.prefill_requests()
        assert [b["kv_transfer_params"].get("remote_request_id") for b in pulls[1:]] == list(fleet.d.issued_d_params)[:2]


async def test_branches_of_one_history_on_four_replicas_get_one_offer(redis_server):
    async with Fleet(redis_server.url, n=4) as fleet:
        r1 = await fleet.chat(0, [user("branch root")])
        await fleet.settle()
        branches = [[user("branch root"), assistant(r1.answer), user(f"branch {i}")] for i in range(4)]
        results = await asyncio.gather(*(fleet.chat(i, b) for i, b in enumerate(branches)))
        assert all(r.status == 200 and r.done for r in results)
        assert sum(offered(r) > 0 for r in results) == 1
        # the others were told why: taken (in the same instant, or by the reason the store keeps)
        assert sum(fleet.router(i).metrics.reuse_misses.get("taken") for i in range(4)) == 3


async def test_a_replica_without_keys_cannot_join_a_keyed_fleet(redis_server):
    """An open replica names every client 'default': on a keyed fleet's store its clients would share
    conversations with the others'. The store remembers the fleet's tenancy and refuses it at start."""
    async with Fleet(redis_server.url, n=1, keys={"acme": "key-acme"}) as fleet:
        fleet.keys = None
        fleet.apps.append(None), fleet.runners.append(None), fleet.urls.append("")
        with pytest.raises(ValueError, match="run keyed .* and this one open"):
            await fleet.start_router(1)
        fleet.apps.pop(), fleet.runners.pop(), fleet.urls.pop()


def test_a_keyed_tenant_cannot_take_the_open_routers_tenant_name():
    from impl.router.tenants import Tenants

    with pytest.raises(ValueError, match="cannot be named 'default'"):
        Tenants.load(None, "KEYS", {"KEYS": "default=key-1,acme=key-2"})
