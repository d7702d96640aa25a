"""Client connections cannot be held forever. Silent and slowloris connections get
408 and are closed, a kept-alive connection with no new request is closed, a body that does not
arrive gets 408, connections beyond the cap get 503; every close is counted.

Raw sockets (asyncio streams), because an HTTP client library will not misbehave on purpose. Waits
are deadline polls far longer than the configured timeouts: a pass never depends on timing luck."""

from __future__ import annotations

import asyncio
import json
import socket
import time

from tests.router.harness import Deployment

DEADLINE_S = 10.0  # >> every timeout configured below
SHORT = dict(client_header_timeout_s=0.3, client_body_timeout_s=0.3, client_idle_timeout_s=0.4)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def connect(dep: Deployment) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = dep.url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def read_until_closed(reader: asyncio.StreamReader, deadline_s: float = DEADLINE_S) -> bytes:
    """Everything the server sends until it closes the connection; fails if it has not by the deadline."""
    return await asyncio.wait_for(reader.read(), deadline_s)  # read() with no size: until EOF


async def closed_count(dep: Deployment, reason: str) -> float:
    return dep.router.metrics.client_closed.get(reason)


async def poll(predicate, deadline_s: float = DEADLINE_S) -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < end, "condition not reached before the deadline"
        await asyncio.sleep(0.02)


def test_a_silent_connection_gets_408_and_is_closed():
    async def body():
        async with Deployment(**SHORT) as dep:
            reader, writer = await connect(dep)
            answer = await read_until_closed(reader)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 408 ")
            assert dep.router.metrics.client_closed.get("header_timeout") == 1
    run(body())


def test_a_slowloris_head_gets_408_however_it_trickles():
    async def body():
        async with Deployment(**SHORT) as dep:
            reader, writer = await connect(dep)
            head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000

            async def trickle():
                for i in range(len(head)):  # one byte every 20 ms: each byte well inside any timeout
                    writer.write(head[i:i + 1])
                    await asyncio.sleep(0.02)

            sender = asyncio.ensure_future(trickle())
            try:
                answer = await read_until_closed(reader)
            finally:
                sender.cancel()
                writer.close()
            assert answer.startswith(b"HTTP/1.1 408 ")
            assert dep.router.metrics.client_closed.get("header_timeout") == 1
    run(body())


def test_a_body_that_does_not_arrive_gets_408_and_is_counted():
    async def body():
        async with Deployment(**SHORT) as dep:
            reader, writer = await connect(dep)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"messages\": ")
            answer = await read_until_closed(reader)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:100]
            assert b'"param": "body"' in answer
            assert dep.router.metrics.client_closed.get("body_timeout") == 1
            assert dep.router.metrics.requests.get("/v1/chat/completions", "408") == 1
            assert not dep.d.received and not dep.p.received  # nothing reached an upstream
    run(body())


def test_an_idle_kept_alive_connection_is_closed_after_its_request():
    async def body():
        async with Deployment(**SHORT) as dep:
            reader, writer = await connect(dep)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = await read_until_closed(reader)  # the answer, then the close
            writer.close()
            assert answer.startswith(b"HTTP/1.1 200 ") and answer.count(b"HTTP/1.1") == 1
            assert dep.router.metrics.client_closed.get("idle") == 1
    run(body())


def test_connections_beyond_the_cap_get_503_and_a_freed_slot_serves_again():
    async def body():
        async with Deployment(max_client_connections=3, client_header_timeout_s=30.0) as dep:
            held = [await connect(dep) for _ in range(3)]
            await poll(lambda: len(dep.router.connections.live) == 3)
            reader, writer = await connect(dep)
            answer = await read_until_closed(reader)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 503 ")
            assert dep.router.metrics.client_closed.get("over_limit") == 1
            held[0][1].close()
            await poll(lambda: len(dep.router.connections.live) == 2)
            status, _ = await dep.get("/health")  # a new connection gets in
            assert status == 200
            for _, w in held[1:]:
                w.close()
            _, text = await dep.get("/metrics")
            assert b'bidikv_router_client_connections_closed_total{reason="over_limit"} 1' in text
    run(body())


def test_a_slow_turn_is_not_cut_by_the_client_clocks():
    """The clocks stop while a request is being served: a turn longer than every client timeout completes."""
    async def body():
        async with Deployment(**SHORT, chunks=3) as dep:
            dep.d.chunk_delay_s = 0.5  # 1.5 s of streaming, > header, body and idle timeouts
            r = await dep.chat([{"role": "user", "content": "slow"}])
            assert r.status == 200 and r.done and r.error is None
    run(body())


def test_a_heartbeat_body_that_does_not_arrive_gets_408_too():
    async def body():
        async with Deployment(**SHORT) as dep:
            reader, writer = await connect(dep)
            writer.write(b"POST /v1/conversations/c1/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
            answer = await read_until_closed(reader)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:100]
            assert dep.router.metrics.client_closed.get("body_timeout") == 1
    run(body())


def test_a_client_that_stops_reading_a_stream_is_cut_after_the_write_timeout():
    async def body():
        async with Deployment(client_write_timeout_s=0.5, chunks=1) as dep:
            big = json.dumps({"choices": [{"index": 0, "delta": {"content": "x" * 65536}}]}).encode()
            dep.d.fault, dep.d.inject = "inject_events", [big] * 400  # ~26 MB: more than every buffer between us
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            host, port = dep.url.removeprefix("http://").split(":")
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
            request = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
            sock.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(request) + request)
            try:
                await poll(lambda: dep.router.metrics.client_closed.get("write_timeout") == 1)  # never reading
                await poll(lambda: not dep.router.connections.live)
            finally:
                sock.close()
            r = await dep.chat([{"role": "user", "content": "a reader"}], stream=False)
            assert r.status == 200
    run(body())
