"""Client connections: how long each may take to say what it wants, and how many there may be.

aiohttp's server has no request-head timeout: a connection that sends nothing, or a head one byte
at a time (slowloris), is held until its keep-alive timeout (3,630 s in aiohttp 3.14), so only the
process's file-descriptor limit bounds them (measured: 2,000 idle connections, none closed). Every
client connection therefore runs through a thin protocol (:class:`_Guarded`) in front of aiohttp's
own, and one sweep over all of them (a few times per shortest timeout) enforces:

* **head** (``client_header_timeout_s``): from connecting, or from the first byte of the next
  request on a kept-alive connection, to a complete request head. Trickling bytes does not extend
  it. Answered ``408`` and closed.
* **idle** (``client_idle_timeout_s``): a kept-alive connection with no new request. Closed
  silently, as HTTP allows between requests.
* **body** (``client_body_timeout_s``): the whole request body, once the head is in
  (:func:`read_body`, in the handler). Answered ``408`` and closed.
* **write** (``client_write_timeout_s``): a client that stops reading what the router sends (its
  socket buffers full, the router's writes paused) for this long is cut, whatever the phase: a
  stream to a client that never reads would otherwise hold the handler and D's connection forever.
* **cap** (``max_client_connections``): one more connection is answered ``503`` and closed at once,
  before aiohttp sees it: refusing costs one write, serving would cost a file descriptor and a task.

A connection is *busy* from the handler's start to its end (:meth:`ClientConnections.middleware`),
and none of the three clocks runs then: how long a turn takes is the upstream timeouts' business.
Every close is counted in ``bidikv_router_client_connections_closed_total{reason}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from typing import Any, Awaitable, Callable

from aiohttp import web

log = logging.getLogger("bidikv.router")

HEAD, BUSY, IDLE, CLOSING = 0, 1, 2, 3


def _canned(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "timeout" if status == 408 else "service_unavailable",
                                 "param": None, "code": status}}).encode()
    retry = "Retry-After: 1\r\n" if status == 503 else ""  # a connection slot frees as soon as any client leaves
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"{retry}Connection: close\r\n\r\n").encode() + body


class BodyTimeout(Exception):
    """The client did not send its whole body within ``client_body_timeout_s``."""


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, with the phase and the time the sweep checks."""

    __slots__ = ("inner", "owner", "transport", "phase", "since", "paused_at")

    def __init__(self, inner: asyncio.Protocol, owner: "ClientConnections") -> None:
        self.inner = inner
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.phase = HEAD
        self.since = 0.0
        self.paused_at: float | None = None  # when the client stopped taking our bytes, if it has

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        owner = self.owner
        if len(owner.live) >= owner.max_connections:
            owner.count("over_limit")
            transport.write(owner.over_limit_reply)
            transport.close()
            return  # aiohttp never sees it
        self.transport = transport
        self.since = owner.loop.time()
        owner.live[transport] = self
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        phase = self.phase
        if phase == IDLE:  # the first byte of the next request starts its head clock
            self.phase = HEAD
            self.since = self.owner.loop.time()
        elif phase == CLOSING:
            return  # answered 408: read and dropped until the close
        self.inner.data_received(data)

    def answer_and_close(self, reply: bytes) -> None:
        """Send ``reply`` and our FIN now, close at the next sweep. Closing at once, with the client
        still sending, would reset the connection and could destroy the reply before it is read."""
        self.phase = CLOSING
        self.since = self.owner.loop.time()
        self.transport.write(reply)
        if self.transport.can_write_eof():
            self.transport.write_eof()

    def eof_received(self) -> bool | None:
        if self.transport is None:
            return None
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is None:
            return
        self.owner.live.pop(self.transport, None)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.transport is not None:
            self.paused_at = self.owner.loop.time()
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.transport is not None:
            self.paused_at = None
            self.inner.resume_writing()


class ClientConnections:
    """The live client connections of one server, their deadlines and their cap."""

    def __init__(self, header_timeout_s: float, body_timeout_s: float, idle_timeout_s: float, max_connections: int,
                 on_close: Callable[[str], None] = lambda reason: None, write_timeout_s: float = 60.0) -> None:
        self.header_timeout_s = header_timeout_s
        self.write_timeout_s = write_timeout_s
        self.body_timeout_s = body_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self.count = on_close
        self.live: dict[Any, _Guarded] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self._sweeper: asyncio.Task | None = None
        # a sweep every quarter of the shortest timeout: a connection overstays by at most that much
        self.sweep_interval_s = max(0.02, min(1.0, header_timeout_s / 4, idle_timeout_s / 4, write_timeout_s / 4))
        self.over_limit_reply = _canned(503, "Service Unavailable", f"the router holds its limit of {max_connections} "
                                                                    "client connections; retry shortly")
        self.header_timeout_reply = _canned(408, "Request Timeout", f"no complete request head within "
                                                                    f"{header_timeout_s:g} s")

    def protocol_factory(self, inner_factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        def make() -> asyncio.Protocol:
            return _Guarded(inner_factory(), self)
        return make

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        if self._sweeper is None:
            self._sweeper = self.loop.create_task(self._sweep_forever())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            try:
                await self._sweeper
            except asyncio.CancelledError:
                pass
            self._sweeper = None

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            try:
                self.sweep()
            except Exception:  # a sweep must never stop sweeping
                log.exception("client connection sweep failed")

    def sweep(self) -> None:
        now = self.loop.time()
        head_before = now - self.header_timeout_s
        idle_before = now - self.idle_timeout_s
        write_before = now - self.write_timeout_s
        for transport, conn in list(self.live.items()):
            if conn.paused_at is not None and conn.paused_at < write_before:
                self.count("write_timeout")
                transport.abort()  # its buffers are full: nothing more would reach it anyway
                continue
            phase = conn.phase
            if phase == BUSY:
                continue
            if phase == CLOSING:
                transport.close()
                continue
            if transport.get_write_buffer_size():
                conn.since = now  # the last answer is still leaving: not idle yet
                continue
            if phase == HEAD and conn.since < head_before:
                self.count("header_timeout")
                conn.answer_and_close(self.header_timeout_reply)
            elif phase == IDLE and conn.since < idle_before:
                self.count("idle")
                transport.close()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        conn = self.live.get(request.transport)
        if conn is None:  # a connection that did not come through the guard (tests may serve the app directly)
            return await handler(request)
        conn.phase = BUSY
        try:
            return await handler(request)
        finally:
            conn.phase = IDLE
            conn.since = self.loop.time()

    async def read_body(self, request: web.Request, limit: int | None = None,
                        budget: "ByteBudget | None" = None) -> bytes:
        """The request's whole body, or :class:`BodyTimeout` after ``client_body_timeout_s``.

        ``limit``: refuse (413, connection closed) as soon as more than this many bytes arrived, whatever
        the Content-Length said or a chunked body claims, instead of buffering up to the general limit
        first. ``budget``: the bytes held by every body of this kind being read at once, capped (503 when
        full): for an endpoint that reads before it can authenticate."""
        plain = limit is None and budget is None
        if plain and request.content.is_eof():  # nearly always: the body came with the head
            return await request.read()
        try:
            async with asyncio.timeout(self.body_timeout_s):
                return await (request.read() if plain else _read_capped(request, limit, budget))
        except TimeoutError:
            raise BodyTimeout() from None

    def body_timeout_response(self) -> web.Response:
        self.count("body_timeout")
        body = json.dumps({"error": {"message": f"request body not received within {self.body_timeout_s:g} s",
                                     "type": "timeout", "param": "body", "code": 408}}).encode()
        response = web.Response(status=408, body=body, headers={"Content-Type": "application/json"})
        response.force_close()
        return response


async def _read_capped(request: web.Request, limit: int | None, budget: "ByteBudget | None") -> bytes:
    """The body chunk by chunk, refused as soon as it passes ``limit`` or ``budget`` is full; what it held
    of the budget is given back however it ends."""
    parts: list[bytes] = []
    size = 0
    try:
        while True:
            chunk = await request.content.readany()
            if not chunk:
                return b"".join(parts)
            size += len(chunk)
            if limit is not None and size > limit:
                raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
            if budget is not None and not budget.take(len(chunk)):
                raise BodyBudgetFull()
            parts.append(chunk)
    finally:
        if budget is not None:
            budget.give(sum(len(p) for p in parts))


class BodyBudgetFull(Exception):
    """Every byte a :class:`ByteBudget` allows is held by bodies being read."""


class ByteBudget:
    """Bytes held at once by the bodies of one endpoint, capped (single event loop: no lock needed)."""

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self.held = 0
        self.refused = 0

    def take(self, n: int) -> bool:
        if self.held + n > self.cap_bytes:
            self.refused += 1
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held -= n


class GuardedTCPSite(web.TCPSite):
    """aiohttp's TCPSite whose connections go through :class:`ClientConnections`."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, connections: ClientConnections, **kwargs: Any) -> None:
        super().__init__(runner, host, port, **kwargs)
        self._connections = connections

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner
        loop = asyncio.get_running_loop()
        self._connections.start()
        self._server = await loop.create_server(self._connections.protocol_factory(self._runner.server),
                                                self._host, self._port, backlog=self._backlog,
                                                reuse_address=self._reuse_address, reuse_port=self._reuse_port)
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port

    async def stop(self) -> None:
        await super().stop()
        await self._connections.stop()


def raise_fd_limit(needed: int) -> int:
    """Raise the soft file-descriptor limit towards ``needed`` (up to the hard limit); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft
    return target
