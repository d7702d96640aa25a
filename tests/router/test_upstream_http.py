"""The router's own HTTP/1.1 client (impl.router.upstream_http) against scripted raw servers.

The servers here write exact bytes (split where a test wants, closed when a test wants), which is
how framing, reuse and the keep-alive race are checked without trusting another HTTP library.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Awaitable, Callable

import pytest
from hypothesis import given, settings, strategies as st

from impl.router.upstream_http import (MAX_HEAD_BYTES, ChunkedDecoder, UpstreamClient, UpstreamConnectError,
                                       UpstreamDisconnected, UpstreamProtocolError, UpstreamTimeout, parse_head)
from tests.router.fakes import free_port

# -- chunked decoding ------------------------------------------------------------------------------


def encode_chunked(pieces: list[bytes], extensions: list[bytes], trailers: list[bytes], upper: bool) -> bytes:
    out = []
    for i, piece in enumerate(pieces):
        size = format(len(piece), "X" if upper else "x").encode()
        out.append(size + extensions[i % len(extensions)] + b"\r\n" + piece + b"\r\n")
    out.append(b"0" + extensions[0] + b"\r\n")
    out.extend(t + b"\r\n" for t in trailers)
    out.append(b"\r\n")
    return b"".join(out)


def feed_split(data: bytes, cuts: list[int]) -> tuple[bytes, bytes, bool]:
    decoder = ChunkedDecoder()
    body: list[bytes] = []
    rest = b""
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    for a, b in zip(points, points[1:]):
        rest += decoder.feed(data[a:b], body)
    return b"".join(body), rest, decoder.done


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.binary(min_size=1, max_size=300), max_size=8),
       extensions=st.lists(st.sampled_from([b"", b";name=value", b"; a", b' ;q="x;y"']), min_size=1, max_size=3),
       trailers=st.lists(st.sampled_from([b"X-Trailer: 1", b"Digest: abc"]), max_size=2),
       upper=st.booleans(),
       after=st.binary(max_size=20),
       cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=12))
def test_chunked_decoding_is_independent_of_split_points(pieces, extensions, trailers, upper, after, cuts):
    wire = encode_chunked(pieces, extensions, trailers, upper)
    body, rest, done = feed_split(wire + after, cuts)
    assert done
    assert body == b"".join(pieces)
    assert rest == after  # what follows the body is handed back, never eaten


@settings(max_examples=100, deadline=None)
@given(pieces=st.lists(st.binary(min_size=1, max_size=100), min_size=1, max_size=5),
       cut=st.integers(min_value=0, max_value=10_000))
def test_chunked_body_cut_short_is_not_done(pieces, cut):
    wire = encode_chunked(pieces, [b""], [], False)
    cut = cut % len(wire)  # strictly shorter than the whole message
    body, rest, done = feed_split(wire[:cut], [cut // 2])
    assert not done and rest == b""
    assert b"".join(pieces).startswith(body)


@pytest.mark.parametrize("line", [b"0x10", b"+10", b"1_0", b"zz", b"", b"-1", b"1 0", b"1" * 17])
def test_bad_chunk_size_lines_are_protocol_errors(line):
    with pytest.raises(UpstreamProtocolError):
        ChunkedDecoder().feed(line + b"\r\n" + b"x" * 20 + b"\r\n0\r\n\r\n", [])


def test_chunk_data_must_end_with_crlf_and_size_lines_are_bounded():
    with pytest.raises(UpstreamProtocolError):
        ChunkedDecoder().feed(b"2\r\nabXY0\r\n\r\n", [])
    with pytest.raises(UpstreamProtocolError):
        ChunkedDecoder().feed(b"1" + b";" * 10_000, [])


def test_parse_head():
    head = parse_head(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-A: 1\r\nx-a: 2\r\nEmpty:")
    assert (head.version, head.status, head.reason) == (1, 200, "OK")
    assert head.headers == {"content-type": "text/event-stream", "x-a": "1, 2", "empty": ""}
    assert parse_head(b"HTTP/1.0 503").status == 503
    for bad in (b"HTTP/2 200 OK", b"ICY 200 OK", b"HTTP/1.1 2000 OK", b"HTTP/1.1 200 OK\r\nno colon",
                b"HTTP/1.1 200 OK\r\nA: 1\r\n folded", b"HTTP/1.1 200 OK\r\nName : v"):
        with pytest.raises(UpstreamProtocolError):
            parse_head(bad)


# -- a scripted server -------------------------------------------------------------------------------

Script = Callable[["Exchange"], Awaitable[None]]


class Exchange:
    """One request as the scripted server saw it, and the means to answer it byte by byte."""

    def __init__(self, server: "RawServer", reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 conn: int, index: int, head: bytes, body: bytes) -> None:
        self.server, self.reader, self.writer = server, reader, writer
        self.conn, self.index, self.head, self.body = conn, index, head, body

    async def send(self, *parts: bytes, pause: float = 0.0) -> None:
        for part in parts:
            self.writer.write(part)
            await self.writer.drain()
            if pause:
                await asyncio.sleep(pause)

    def close(self) -> None:
        self.writer.close()


def ok(body: bytes = b"hello", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body


class RawServer:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[Exchange] = []
        self.disconnects = 0
        self.server: asyncio.AbstractServer | None = None
        self.url = ""

    async def __aenter__(self) -> "RawServer":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self.connections
        self.connections += 1
        index = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                ex = Exchange(self, reader, writer, conn, index, head, body)
                self.requests.append(ex)
                index += 1
                await self.script(ex)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.disconnects += 1
        finally:
            writer.close()


async def answer_ok(ex: Exchange) -> None:
    await ex.send(ok(b"body-%d-%d" % (ex.conn, ex.index)))


# -- the client against it -----------------------------------------------------------------------------


async def test_keepalive_connection_is_reused_and_request_is_one_well_formed_message():
    async with RawServer(answer_ok) as srv:
        client = UpstreamClient()
        for i in range(3):
            resp = await client.request("POST", srv.url + "/v1/completions", b'{"a": 1}',
                                        {"Content-Type": "application/json", "X-Request-Id": f"r{i}"})
            assert resp.status == 200 and resp.headers["content-length"] == "8"
            assert await resp.read() == b"body-0-%d" % i
            resp.release()
        await client.close()
        assert srv.connections == 1
        assert client.stats.connections_opened == 1 and client.stats.reused == 2
        head = srv.requests[0].head
        assert head.startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
        assert b"\r\nContent-Length: 8\r\n" in head and b"\r\nX-Request-Id: r0\r\n" in head
        assert srv.requests[0].body == b'{"a": 1}'


async def test_sockets_have_nodelay():
    async with RawServer(answer_ok) as srv:
        client = UpstreamClient()
        resp = await client.request("GET", srv.url + "/health")
        await resp.read()
        conn = resp._conn
        sock = conn.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        resp.release()
        await client.close()


async def test_chunked_stream_is_iterated_as_it_arrives_then_connection_reused():
    async def script(ex: Exchange) -> None:
        if ex.index == 0:
            wire = b"7\r\ndata: a\r\n" + b"9\r\n\n\ndata: b\r\n" + b"2\r\n\n\n\r\n0\r\nT: 1\r\n\r\n"
            # byte by byte: every split point of the framing is crossed
            await ex.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            await ex.send(*[wire[i:i + 1] for i in range(len(wire))], pause=0.001)
        else:
            await ex.send(ok(b"again"))

    async with RawServer(script) as srv:
        client = UpstreamClient()
        resp = await client.request("POST", srv.url + "/v1/chat/completions", b"{}")
        got = [chunk async for chunk in resp]
        assert b"".join(got) == b"data: a\n\ndata: b\n\n"
        assert len(got) > 1  # delivered incrementally, not at the end
        assert resp.complete
        resp.release()
        resp = await client.request("POST", srv.url + "/v1/chat/completions", b"{}")
        assert await resp.read() == b"again"
        resp.release()
        assert srv.connections == 1
        await client.close()


async def test_connection_close_and_until_close_bodies_are_not_reused():
    async def script(ex: Exchange) -> None:
        if ex.index == 0 and ex.conn == 0:
            await ex.send(ok(b"bye", b"Connection: close\r\n"))
        else:
            await ex.send(b"HTTP/1.1 200 OK\r\n\r\nuntil the end")
            ex.close()

    async with RawServer(script) as srv:
        client = UpstreamClient()
        for expected in (b"bye", b"until the end", b"until the end"):
            resp = await client.request("GET", srv.url + "/x")
            assert await resp.read() == expected
            resp.release()
        assert srv.connections == 3 and client.stats.reused == 0
        await client.close()


async def test_keepalive_race_post_is_a_clear_error_get_is_retried_once():
    closes = {"left": 0}

    async def script(ex: Exchange) -> None:
        if ex.index >= 1 and closes["left"]:
            closes["left"] -= 1
            ex.close()  # what uvicorn does to an idle connection as the request arrives
            return
        await answer_ok(ex)

    async with RawServer(script) as srv:
        client = UpstreamClient()
        resp = await client.request("POST", srv.url + "/p", b"{}")
        await resp.read()
        resp.release()
        closes["left"] = 1
        with pytest.raises(UpstreamDisconnected) as info:
            await client.request("POST", srv.url + "/p", b"{}")
        assert info.value.reused and not info.value.response_started  # the router retries this itself

        resp = await client.request("GET", srv.url + "/health")  # warm a kept-alive connection again
        await resp.read()
        resp.release()
        closes["left"] = 1
        resp = await client.request("GET", srv.url + "/health")
        assert resp.status == 200 and (await resp.read()).startswith(b"body-")
        resp.release()
        assert client.stats.stale_retries == 1
        await client.close()


async def test_get_is_retried_only_once():
    async def fresh_fails(ex: Exchange) -> None:  # the first request is answered, nothing after it
        if ex.conn == 0 and ex.index == 0:
            await answer_ok(ex)
        else:
            ex.close()

    async with RawServer(fresh_fails) as srv:
        client = UpstreamClient()
        resp = await client.request("GET", srv.url + "/health")
        await resp.read()
        resp.release()
        with pytest.raises(UpstreamDisconnected) as info:
            await client.request("GET", srv.url + "/health")
        assert not info.value.reused  # the retry went out on a new connection and failed: no third try
        assert client.stats.stale_retries == 1 and len(srv.requests) == 3
        await client.close()


async def test_idle_connection_closed_by_server_leaves_the_pool():
    async def script(ex: Exchange) -> None:
        await answer_ok(ex)
        if ex.conn == 0:
            await asyncio.sleep(0.05)
            ex.close()  # closes the idle kept-alive connection, as vLLM does after 5 s

    async with RawServer(script) as srv:
        client = UpstreamClient()
        resp = await client.request("POST", srv.url + "/p", b"{}")
        await resp.read()
        resp.release()
        await asyncio.sleep(0.2)
        resp = await client.request("POST", srv.url + "/p", b"{}")  # no error: a new connection
        assert await resp.read() == b"body-1-0"
        resp.release()
        assert client.stats.reused == 0
        await client.close()


async def test_connections_idle_beyond_keepalive_are_not_reused():
    async with RawServer(answer_ok) as srv:
        client = UpstreamClient(keepalive_s=0.05)
        for _ in range(2):
            resp = await client.request("POST", srv.url + "/p", b"{}")
            await resp.read()
            resp.release()
            await asyncio.sleep(0.1)
        assert srv.connections == 2
        await client.close()


async def test_oversize_head_is_a_protocol_error():
    async def script(ex: Exchange) -> None:
        await ex.send(b"HTTP/1.1 200 OK\r\n" + b"X-Big: " + b"a" * (MAX_HEAD_BYTES + 10) + b"\r\n\r\n")

    async with RawServer(script) as srv:
        client = UpstreamClient()
        with pytest.raises(UpstreamProtocolError, match="exceeds"):
            await client.request("POST", srv.url + "/p", b"{}")
        await client.close()


@pytest.mark.parametrize("response", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
])
async def test_body_cut_short_is_a_disconnect_after_the_response_began(response):
    async def script(ex: Exchange) -> None:
        await ex.send(response)
        ex.close()

    async with RawServer(script) as srv:
        client = UpstreamClient()
        resp = await client.request("POST", srv.url + "/p", b"{}")
        with pytest.raises(UpstreamDisconnected) as info:
            await resp.read()
        assert info.value.response_started
        resp.release()
        await client.close()


async def test_bad_framing_mid_stream_is_a_protocol_error():
    async def script(ex: Exchange) -> None:
        await ex.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n")

    async with RawServer(script) as srv:
        client = UpstreamClient()
        resp = await client.request("POST", srv.url + "/p", b"{}")
        chunks = []
        with pytest.raises(UpstreamProtocolError):
            async for chunk in resp:
                chunks.append(chunk)
        resp.close()
        await client.close()


async def test_unreachable_is_a_connect_error():
    client = UpstreamClient()
    with pytest.raises(UpstreamConnectError):
        await client.request("POST", f"http://127.0.0.1:{free_port()}/p", b"{}")
    await client.close()


async def test_idle_and_total_timeouts():
    async def script(ex: Exchange) -> None:
        await ex.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(10):
            await ex.send(b"1\r\nx\r\n")
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)

    async with RawServer(script) as srv:
        client = UpstreamClient()
        resp = await client.request("POST", srv.url + "/p", b"{}", idle_timeout=0.2)
        with pytest.raises(UpstreamTimeout):  # steady bytes are fine, then a 1 s silence is not
            async for chunk in resp:
                assert chunk.startswith(b"x")
        resp.close()
        resp = await client.request("POST", srv.url + "/p", b"{}", timeout=0.2)
        with pytest.raises(TimeoutError):  # steady bytes, but the whole exchange is over time
            await resp.read()
        resp.close()
        await client.close()


async def test_pool_bound_is_respected_and_every_request_served():
    async def script(ex: Exchange) -> None:
        await asyncio.sleep(0.02)
        await answer_ok(ex)

    async with RawServer(script) as srv:
        client = UpstreamClient(max_connections_per_host=2)

        async def one() -> bytes:
            resp = await client.request("POST", srv.url + "/p", b"{}", timeout=5)
            try:
                return await resp.read()
            finally:
                resp.release()

        bodies = await asyncio.gather(*(one() for _ in range(12)))
        assert all(b.startswith(b"body-") for b in bodies)
        assert srv.connections == 2
        await client.close()


async def test_pool_wait_obeys_the_deadline():
    async def script(ex: Exchange) -> None:
        await asyncio.sleep(0.5)
        await answer_ok(ex)

    async with RawServer(script) as srv:
        client = UpstreamClient(max_connections_per_host=1)
        first = asyncio.ensure_future(client.request("POST", srv.url + "/p", b"{}"))
        await asyncio.sleep(0.05)
        with pytest.raises(UpstreamTimeout) as info:
            await client.request("POST", srv.url + "/p", b"{}", timeout=0.1)
        assert info.value.phase == "pool"
        resp = await first
        await resp.read()
        resp.release()
        await client.close()


async def test_closing_a_response_mid_stream_drops_the_connection():
    seen = asyncio.Event()

    async def script(ex: Exchange) -> None:
        await ex.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\n")
        seen.set()
        try:
            await ex.reader.read(1)  # the client hanging up ends this read
        finally:
            ex.server.disconnects += 1
            ex.close()

    async with RawServer(script) as srv:
        client = UpstreamClient()
        resp = await client.request("POST", srv.url + "/p", b"{}")
        assert await resp.__anext__() == b"abcd"
        resp.close()
        await asyncio.wait_for(seen.wait(), 1)
        for _ in range(50):
            if srv.disconnects:
                break
            await asyncio.sleep(0.01)
        assert srv.disconnects == 1
        await client.close()


async def test_large_body_with_reading_paused_and_resumed():
    payload = bytes(range(256)) * 12_000  # ~3 MiB, beyond the pause threshold

    async def script(ex: Exchange) -> None:
        await ex.send(ok(payload))

    async with RawServer(script) as srv:
        client = UpstreamClient()
        resp = await client.request("GET", srv.url + "/big")
        await asyncio.sleep(0.1)  # let it buffer: reading pauses
        assert await resp.read() == payload
        resp.release()
        await client.close()


async def test_header_injection_is_refused():
    client = UpstreamClient()
    with pytest.raises(ValueError):
        await client.request("POST", "http://127.0.0.1:1/p", b"{}", {"X-Id": "a\r\nEvil: 1"})
    await client.close()


async def test_interim_responses_are_skipped():
    async def script(ex: Exchange) -> None:
        await ex.send(b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"real"))

    async with RawServer(script) as srv:
        client = UpstreamClient()
        resp = await client.request("POST", srv.url + "/p", b"{}")
        assert resp.status == 200 and await resp.read() == b"real"
        resp.release()
        await client.close()


def test_reuse_under_uvloop():
    uvloop = pytest.importorskip("uvloop")

    async def main() -> None:
        await test_keepalive_connection_is_reused_and_request_is_one_well_formed_message()
        await test_chunked_stream_is_iterated_as_it_arrives_then_connection_reused()
        await test_keepalive_race_post_is_a_clear_error_get_is_retried_once()

    uvloop.run(main())


async def test_router_turns_reuse_one_connection_per_upstream():
    from tests.router.harness import Deployment

    async with Deployment(upstream_keepalive_s=30.0) as dep:
        history = [{"role": "user", "content": "q0"}]
        for turn in range(6):
            r = await dep.chat(history, conversation_id="reuse", stream=turn % 2 == 0)
            assert r.status == 200 and r.error is None
            history = history + [{"role": "assistant", "content": r.answer}, {"role": "user", "content": f"q{turn + 1}"}]
        stats = dep.router.proxy.client.stats
        assert stats.connections_opened == 2 and stats.requests == 12 and stats.reused == 10
        assert len(dep.p._peers) == 1 and len(dep.d._peers) == 1


async def test_https_upstream(tmp_path):
    import shutil
    import ssl
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(ok(b"secure"))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_ctx)
    url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/health"
    client = UpstreamClient(ssl_context=ssl.create_default_context(cafile=str(cert)))
    for _ in range(2):
        resp = await client.request("GET", url)
        assert await resp.read() == b"secure"
        resp.release()
    assert client.stats.connections_opened == 1
    await client.close()
    untrusting = UpstreamClient()  # the default context does not trust a self-signed certificate
    with pytest.raises(UpstreamConnectError):
        await untrusting.request("GET", url)
    await untrusting.close()
    server.close()


# -- the router's stream to its client ------------------------------------------------------------------

P_BODY = (b'{"choices": [{"index": 0, "text": "x"}], "kv_transfer_params": {"remote_engine_id": "P", '
          b'"remote_block_ids": [[1]], "remote_request_id": "p", "remote_host": "h", "remote_port": 1}}')
D_EVENTS = b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n'


def d_script(delay_first_event: float, gate: asyncio.Event | None = None) -> Script:
    """D's answer; with ``gate``, its events wait for the gate after the head went out."""
    async def script(ex: Exchange) -> None:
        if b'"stream": true' not in ex.body:
            await ex.send(ok(P_BODY, b"Content-Type: application/json\r\n"))
            return
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        body = b"%x\r\n" % len(D_EVENTS) + D_EVENTS + b"\r\n0\r\n\r\n"
        if gate is not None:
            await ex.send(head)
            await gate.wait()
            await ex.send(body)
        elif delay_first_event:
            await ex.send(head)
            await asyncio.sleep(delay_first_event)
            await ex.send(body)
        else:
            await ex.send(head + body)
    return script


async def _router_first_read(upstream_url: str, gate: asyncio.Event | None = None) -> tuple[bytes, float, bytes]:
    """What the router's client gets in its first read, when, and everything; ``gate`` (D's events) is
    opened once the first read returned, or after 10 s without one (then the first read is empty)."""
    import time

    from impl.router.app import build_app, start_site
    from impl.router.config import build_config
    from impl.router.tenants import Tenants

    config = build_config(overrides={"prefill": [upstream_url], "decode": [upstream_url], "host": "127.0.0.1", "port": 0,
                                     "health_interval_s": 60.0, "notify": False,
                                     "max_model_len": 4096})  # no /v1/models probe to the scripted server
    app = build_app(config, tenants=Tenants.load(None, "KEYS", {}), environ={})
    runner, port = await start_site(app, "127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = b'{"model": "m", "prompt": "hi", "stream": true, "max_tokens": 4}'
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        t0 = time.monotonic()
        if gate is None:
            first = await reader.read(65536)
        else:
            try:
                first = await asyncio.wait_for(reader.read(65536), 10)
            except asyncio.TimeoutError:
                first = b""  # the router held its head back for D's first event
            gate.set()
        elapsed = time.monotonic() - t0
        rest = await reader.read()
        writer.close()
        return first, elapsed, first + rest
    finally:
        await runner.cleanup()


async def test_router_sends_headers_with_the_first_events_when_d_sent_them_together(monkeypatch):
    from aiohttp import http_writer

    writes = []
    for name in ("_write", "_writelines"):  # every byte aiohttp sends to the router's client passes one of these
        original = getattr(http_writer.StreamWriter, name)

        def counted(self, data, _original=original):
            writes.append(data)
            return _original(self, data)
        monkeypatch.setattr(http_writer.StreamWriter, name, counted)
    async with RawServer(d_script(0.0)) as srv:
        first, _, whole = await _router_first_read(srv.url)
    assert first.startswith(b"HTTP/1.1 200") and b"data: " in first
    assert whole.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert len(writes) == 1  # head, events and the end of the chunked body in one send


async def test_router_sends_headers_at_once_when_d_is_slow_to_its_first_event():
    # order, not timing: D's first event is held until the client has read the router's head
    gate = asyncio.Event()
    async with RawServer(d_script(0.0, gate)) as srv:
        first, _, whole = await _router_first_read(srv.url, gate)
    assert first.startswith(b"HTTP/1.1 200") and b"data: " not in first  # not held for D
    assert b'"text": "a"' in whole and whole.endswith(b"0\r\n\r\n")


async def test_router_with_a_bounded_upstream_pool_serves_every_turn():
    from tests.router.harness import Deployment

    # the connect timeout is wall time on the one event loop the router, the fakes and the clients share:
    # the harness's 1 s is short of what a loaded CI machine gives 20 concurrent turns (a 504 was seen)
    async with Deployment(upstream_max_connections=2, n_prefill=1, n_decode=1, connect_timeout_s=10.0) as dep:
        dep.d.chunk_delay_s = 0.005  # D streams hold their connection a while

        async def turn(i: int) -> None:
            r = await dep.chat([{"role": "user", "content": f"q{i}"}], conversation_id=f"b{i}")
            assert r.status == 200 and r.done and r.error is None

        await asyncio.gather(*(turn(i) for i in range(20)))
        assert len(dep.p._peers) <= 2 and len(dep.d._peers) <= 2
