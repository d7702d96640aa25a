"""A small HTTP/1.1 client for the router's calls to P and D: keep-alive pools, streamed bodies.

Why not aiohttp's client (which the router used before): the router's overhead budget is <= 0.6 ms of
router CPU per turn and a turn makes two upstream calls. aiohttp's client spent ~136 us a call on the 2-core
machine (request/response objects, multidict headers, URL objects, tracing hooks, a StreamReader per
body), a bare asyncio HTTP/1.1 exchange ~49 us. This module is that bare exchange plus what the
router needs around it, and nothing more:

* one keep-alive pool per upstream ``scheme://host:port``, optionally bounded
  (``max_connections_per_host``, waiters served FIFO), idle connections used most-recent first and
  never reused after ``keepalive_s`` idle (below vLLM's 5 s keep-alive, so a connection is not
  reused just as uvicorn closes it); a connection the server closes while idle leaves the pool at once;
* requests written in one ``transport.write`` (head and body together: no Nagle/delayed-ACK stall
  between them) on sockets with ``TCP_NODELAY``;
* responses framed by Content-Length, chunked transfer coding (:class:`ChunkedDecoder`) or
  connection close; the body is iterated as it arrives (D's SSE stream) or read whole (P);
* timeouts without a task per request: a deadline for the whole exchange (P) and/or an idle limit
  between reads (D), each one ``loop.call_later`` per wait;
* errors in four classes the router's classifier (``TurnProxy._connection_failure``) maps to its
  outcomes: :class:`UpstreamConnectError` (not reachable: mark down), :class:`UpstreamDisconnected`
  (closed or reset: before any response byte on a kept-alive connection that is the keep-alive
  race, retried), :class:`UpstreamTimeout` (a ``TimeoutError``) and :class:`UpstreamProtocolError`
  (not HTTP we accept: oversized head, bad chunk framing). None of them is a ``ConnectionResetError``:
  the router reads that one as *its client* having gone away.

Not supported, because vLLM's OpenAI server needs none of it: redirects, cookies, compression,
proxies, ``Expect: 100-continue``, pipelining, HTTP/2, LF-only line endings in response heads.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl as ssl_module
from dataclasses import dataclass
from typing import Mapping
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024  # status line + headers; uvicorn's are ~150 bytes
MAX_CHUNK_LINE_BYTES = 4 * 1024  # a chunk-size line with extensions
MAX_TRAILER_BYTES = 16 * 1024
MAX_BODY_BYTES = 256 * 1024 * 1024  # read(): a whole non-streamed answer; bigger is not a vLLM answer
PAUSE_READING_BYTES = 1024 * 1024  # body bytes received but not yet taken: stop reading the socket beyond


class UpstreamError(Exception):
    """The request could not be completed; see the subclasses."""


class UpstreamConnectError(UpstreamError):
    """No connection could be opened (refused, unreachable, unknown name, TLS handshake failed)."""


class UpstreamDisconnected(UpstreamError):
    """The connection was closed or reset before the response was complete.

    ``reused``: the request went out on a kept-alive connection; ``response_started``: some of the
    response had arrived. ``reused and not response_started`` is the keep-alive race (the server
    closed an idle connection as the request was sent): the server never saw the request.
    """

    def __init__(self, message: str, *, reused: bool = False, response_started: bool = False) -> None:
        super().__init__(message)
        self.reused = reused
        self.response_started = response_started


class UpstreamProtocolError(UpstreamError):
    """The response is not HTTP/1.x this client accepts (malformed or oversized)."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """A timeout expired; ``phase`` says which: connect, pool (waiting for a free connection) or response."""

    def __init__(self, message: str, phase: str) -> None:
        super().__init__(message)
        self.phase = phase


# -- chunked transfer coding ---------------------------------------------------------------------

_SIZE, _DATA, _DATA_END, _TRAILER, _DONE = range(5)
_HEX = b"0123456789abcdefABCDEF"


class ChunkedDecoder:
    """Incremental decoder of ``Transfer-Encoding: chunked`` (RFC 9112 section 7.1).

    ``feed(data, out)`` appends the body bytes ``data`` completes to ``out`` and returns the bytes
    that follow the body's end (empty until then). Input may be split anywhere; only an unfinished
    size or trailer line is buffered, body bytes are passed on as they come.
    """

    __slots__ = ("_state", "_remaining", "_buf", "_trailer_bytes")

    def __init__(self) -> None:
        self._state = _SIZE
        self._remaining = 0
        self._buf = b""
        self._trailer_bytes = 0

    @property
    def done(self) -> bool:
        return self._state == _DONE

    def feed(self, data: bytes, out: list[bytes]) -> bytes:
        if self._state == _DONE:
            return data
        buf = self._buf + data if self._buf else data
        self._buf = b""
        pos, n = 0, len(buf)
        while pos < n:
            state = self._state
            if state == _DATA:
                take = min(self._remaining, n - pos)
                out.append(buf[pos:pos + take] if (pos or take != n) else buf)
                pos += take
                self._remaining -= take
                if not self._remaining:
                    self._state = _DATA_END
            elif state == _SIZE:
                end = buf.find(b"\r\n", pos, pos + MAX_CHUNK_LINE_BYTES + 2)
                if end < 0:
                    if n - pos > MAX_CHUNK_LINE_BYTES:
                        raise UpstreamProtocolError("chunk size line too long")
                    break
                digits = buf[pos:end].split(b";", 1)[0].strip(b" \t")  # drop chunk extensions
                # int(x, 16) alone would also take "0x1f", "+1f", "1_f" and surrounding whitespace
                if not digits or len(digits) > 16 or digits.translate(None, _HEX):
                    raise UpstreamProtocolError(f"bad chunk size line {buf[pos:end][:40]!r}")
                size = int(digits, 16)
                pos = end + 2
                if size:
                    self._remaining = size
                    self._state = _DATA
                else:
                    self._state = _TRAILER
            elif state == _DATA_END:
                if n - pos < 2:
                    if buf[pos:pos + 1] != b"\r":
                        raise UpstreamProtocolError("chunk data not followed by CRLF")
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise UpstreamProtocolError("chunk data not followed by CRLF")
                pos += 2
                self._state = _SIZE
            else:  # _TRAILER: header lines after the last chunk, then an empty line
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if self._trailer_bytes + n - pos > MAX_TRAILER_BYTES:
                        raise UpstreamProtocolError("chunked trailer too long")
                    break
                if end == pos:  # the empty line: the message ends here
                    self._state = _DONE
                    return buf[pos + 2:]
                self._trailer_bytes += end - pos + 2
                if self._trailer_bytes > MAX_TRAILER_BYTES:
                    raise UpstreamProtocolError("chunked trailer too long")
                pos = end + 2
        self._buf = buf[pos:]
        return b""

# -- response head ---------------------------------------------------------------------------------


@dataclass(slots=True)
class ResponseHead:
    version: int  # minor version: 0 or 1
    status: int
    reason: str
    headers: dict[str, str]  # lower-case names; repeated fields joined with ", "


def parse_head(head: bytes) -> ResponseHead:
    """Parse a status line and header fields (without the final empty line)."""
    lines = head.split(b"\r\n")
    status_line = lines[0]
    if not status_line.startswith((b"HTTP/1.1 ", b"HTTP/1.0 ")):
        raise UpstreamProtocolError(f"not an HTTP/1.x status line: {status_line[:60]!r}")
    code = status_line[9:12]
    if len(code) != 3 or not code.isdigit() or status_line[12:13] not in (b"", b" "):
        raise UpstreamProtocolError(f"bad status line {status_line[:60]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
            # no colon, empty name, whitespace before the colon, or obsolete line folding (RFC 9112 5.1-5.2)
            raise UpstreamProtocolError(f"bad header line {line[:60]!r}")
        key = name.decode("latin-1").lower()
        text = value.strip(b" \t").decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return ResponseHead(1 if status_line[7:8] == b"1" else 0, int(code), status_line[13:].decode("latin-1"), headers)


# -- one connection and one response ----------------------------------------------------------------

_HEAD, _BODY, _COMPLETE = range(3)
_LENGTH, _CHUNKED, _UNTIL_CLOSE = range(3)


class _Connection(asyncio.Protocol):
    __slots__ = ("pool", "transport", "closed", "requests", "idle_since", "response")

    def __init__(self, pool: "_HostPool") -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.requests = 0  # requests sent on it: > 1 means the current one reused it
        self.idle_since = 0.0
        self.response: UpstreamResponse | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:  # asyncio and uvloop set it already; said here because latency depends on it
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # bytes while idle: the server is out of step, do not reuse
            self.close()
            return
        response._feed(data)

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self.response
        if response is not None:
            response._lost(exc)
        else:
            self.pool._forget_idle(self)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()


class UpstreamResponse:
    """Status and headers of a response whose body is read with :meth:`read` or ``async for``.

    Give it back with :meth:`release` (a complete body returns the connection to the pool) or
    :meth:`close` (drops the connection: the way to abort a vLLM request mid-stream).
    """

    __slots__ = ("status", "reason", "headers", "_conn", "_reused", "_phase", "_framing", "_remaining", "_chunked",
                 "_head_buf", "_pieces", "_buffered", "_paused", "_keep_alive", "_exc", "_waiter", "_deadline",
                 "_idle_timeout", "_loop", "_no_body", "_finished")

    def __init__(self, conn: _Connection, loop: asyncio.AbstractEventLoop, reused: bool, no_body: bool,
                 deadline: float | None, idle_timeout: float | None) -> None:
        self.status = 0
        self.reason = ""
        self.headers: dict[str, str] = {}
        self._conn = conn
        self._loop = loop
        self._reused = reused
        self._no_body = no_body  # HEAD request
        self._phase = _HEAD
        self._framing = _LENGTH
        self._remaining = 0
        self._chunked: ChunkedDecoder | None = None
        self._head_buf = b""
        self._pieces: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._keep_alive = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._deadline = deadline
        self._idle_timeout = idle_timeout
        self._finished = False  # released or closed


    # -- protocol side (called by the connection) --------------------------------------------
    def _feed(self, data: bytes) -> None:
        if self._exc is not None:
            return
        try:
            if self._phase == _HEAD:
                data = self._feed_head(data)
                if self._phase != _BODY:
                    return
                if not data:
                    if self._framing == _LENGTH and not self._remaining:
                        self._complete()
                    self._wake()
                    return
            if self._phase == _BODY:
                self._feed_body(data)
            elif data:  # bytes after a complete response: out of step, do not reuse
                self._keep_alive = False
        except UpstreamProtocolError as e:
            self._fail(e)
            return
        self._wake()

    def _feed_head(self, data: bytes) -> bytes:
        while True:
            buf = self._head_buf + data if self._head_buf else data
            end = buf.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES + 4)
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise UpstreamProtocolError(f"response head exceeds {MAX_HEAD_BYTES} bytes")
                self._head_buf = buf
                return b""
            self._head_buf = b""
            head = parse_head(buf[:end])
            data = buf[end + 4:]
            if 100 <= head.status < 200:
                if head.status == 101:
                    raise UpstreamProtocolError("unexpected protocol switch")
                continue  # an interim response (100 Continue, 103 Early Hints): the real one follows
            self.status, self.reason, self.headers = head.status, head.reason, head.headers
            self._frame(head)
            self._phase = _BODY
            return data

    def _frame(self, head: ResponseHead) -> None:
        headers = head.headers
        connection = headers.get("connection", "").lower()
        self._keep_alive = head.version == 1 and "close" not in connection
        te = headers.get("transfer-encoding")
        if self._no_body or head.status in (204, 304):
            self._framing, self._remaining = _LENGTH, 0
        elif te is not None:
            if te.rsplit(",", 1)[-1].strip().lower() == "chunked":
                self._framing, self._chunked = _CHUNKED, ChunkedDecoder()
            else:
                self._framing = _UNTIL_CLOSE
            if "content-length" in headers:
                self._keep_alive = False  # both framings given: RFC 9112 6.3 says close afterwards
        elif "content-length" in headers:
            values = {v.strip() for v in headers["content-length"].split(",")}
            value = values.pop() if len(values) == 1 else ""
            if not value.isdigit() or len(value) > 18:  # isdigit: no sign, no spaces
                raise UpstreamProtocolError(f"bad Content-Length {headers['content-length'][:40]!r}")
            self._framing, self._remaining = _LENGTH, int(value)
        else:
            self._framing = _UNTIL_CLOSE
        if self._framing == _UNTIL_CLOSE:
            self._keep_alive = False

    def _feed_body(self, data: bytes) -> None:
        framing = self._framing
        if framing == _CHUNKED:
            before = len(self._pieces)
            rest = self._chunked.feed(data, self._pieces)  # type: ignore[union-attr]
            for piece in self._pieces[before:]:
                self._buffered += len(piece)
            if self._chunked.done:  # type: ignore[union-attr]
                if rest:
                    self._keep_alive = False
                self._complete()
        elif framing == _LENGTH:
            take = len(data)
            if take > self._remaining:
                self._keep_alive = False  # more than announced: out of step
                data, take = data[:self._remaining], self._remaining
            if take:
                self._pieces.append(data)
                self._buffered += take
                self._remaining -= take
            if not self._remaining:
                self._complete()
        elif data:
            self._pieces.append(data)
            self._buffered += len(data)
        if self._buffered > PAUSE_READING_BYTES and not self._paused and self._phase == _BODY:
            self._paused = True
            self._conn.transport.pause_reading()  # type: ignore[union-attr]

    def _complete(self) -> None:
        self._phase = _COMPLETE
        if self._paused:
            self._paused = False
            self._conn.transport.resume_reading()  # type: ignore[union-attr]

    def _lost(self, exc: Exception | None) -> None:
        if self._phase == _BODY and self._framing == _UNTIL_CLOSE and exc is None:
            self._complete()  # a clean close is the body's end (a reset is not)
        elif self._phase != _COMPLETE and self._exc is None:
            started = self._phase != _HEAD or bool(self._head_buf)
            why = f"{type(exc).__name__}: {exc}" if exc is not None else "closed by the server"
            self._exc = UpstreamDisconnected(f"connection lost before the response was complete ({why})",
                                             reused=self._reused, response_started=started)
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self._exc is None:
            self._exc = exc
        self._conn.close()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _on_timeout(self, phase: str) -> None:
        what = "the response head" if self._phase == _HEAD else "more of the response"
        self._fail(UpstreamTimeout(f"timed out waiting for {what}", phase))

    async def _wait(self) -> None:
        """Until the protocol has news (data, end, error) or a timeout expires (then ``_exc`` is set)."""
        loop = self._loop
        timeout = self._idle_timeout
        if self._deadline is not None:
            left = self._deadline - loop.time()
            if left <= 0:
                self._on_timeout("response")
                return
            if timeout is None or left < timeout:
                timeout = left
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(timeout, self._on_timeout, "response") if timeout is not None else None
        try:
            await waiter
        except BaseException:  # cancelled: the response cannot be finished, nor the connection reused
            self.close()
            raise
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    # -- consumer side ---------------------------------------------------------------------------
    async def _read_head(self) -> None:
        while self._phase == _HEAD:
            if self._exc is not None:
                raise self._exc
            await self._wait()
        if self._exc is not None and not self._pieces:
            raise self._exc

    def __aiter__(self) -> "UpstreamResponse":
        return self

    async def __anext__(self) -> bytes:
        """The body bytes received since the last call (whatever has arrived, at least one byte)."""
        while True:
            pieces = self._pieces
            if pieces:
                data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
                pieces.clear()
                self._buffered = 0
                if self._paused:
                    self._paused = False
                    self._conn.transport.resume_reading()  # type: ignore[union-attr]
                return data
            if self._exc is not None:
                raise self._exc
            if self._phase == _COMPLETE:
                raise StopAsyncIteration
            await self._wait()

    async def read(self, max_bytes: int = MAX_BODY_BYTES) -> bytes:
        parts: list[bytes] = []
        size = 0
        async for data in self:
            size += len(data)
            if size > max_bytes:
                self._fail(UpstreamProtocolError(f"response body exceeds {max_bytes} bytes"))
                raise self._exc  # type: ignore[misc]
            parts.append(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    @property
    def body_buffered(self) -> bool:
        """Some of the body (or its end) has arrived and not been taken yet."""
        return bool(self._pieces) or self._phase == _COMPLETE

    @property
    def complete(self) -> bool:
        return self._phase == _COMPLETE and self._exc is None

    def release(self) -> None:
        """Done with it: a fully read response gives the connection back for reuse, else it is closed."""
        if self._finished:
            return
        conn = self._conn
        # an answer that came before all of the request was sent (an early 4xx, say) leaves the
        # connection mid-request: only a connection with nothing left to write goes back
        if not (self._phase == _COMPLETE and self._exc is None and self._keep_alive and not conn.closed
                and not conn.transport.get_write_buffer_size()):  # type: ignore[union-attr]
            self.close()
            return
        self._finished = True
        conn.response = None
        conn.pool._put_back(conn)

    def close(self) -> None:
        """Drop the connection whatever was read (an unfinished vLLM request is aborted by this)."""
        if self._finished:
            return
        self._finished = True
        conn = self._conn
        conn.response = None
        conn.close()
        conn.pool._gone(conn)


# -- pools and the client ---------------------------------------------------------------------------------


@dataclass(slots=True)
class ClientStats:
    connections_opened: int = 0
    requests: int = 0
    reused: int = 0  # requests sent on a kept-alive connection
    stale_retries: int = 0  # idempotent requests re-sent after the keep-alive race


class _HostPool:
    __slots__ = ("client", "host", "port", "ssl", "server_hostname", "idle", "total", "waiters")

    def __init__(self, client: "UpstreamClient", host: str, port: int, ssl: ssl_module.SSLContext | None) -> None:
        self.client = client
        self.host, self.port, self.ssl = host, port, ssl
        self.server_hostname = host if ssl is not None else None
        self.idle: list[_Connection] = []  # most recently used last
        self.total = 0  # idle + busy + connecting
        self.waiters: collections.deque[asyncio.Future] = collections.deque()

    async def acquire(self, deadline: float | None, fresh: bool = False) -> _Connection:
        """A connection for one request: an idle kept-alive one (unless ``fresh``), a new one, or --
        at the bound -- the next one given back (or a free slot), waiting at most until ``deadline``."""
        client = self.client
        limit = client.max_connections_per_host
        while True:
            if not fresh:
                now = client.loop.time()
                idle = self.idle
                while idle:
                    conn = idle.pop()
                    if conn.closed or conn.transport.is_closing() or now - conn.idle_since > client.keepalive_s:  # type: ignore[union-attr]
                        conn.close()
                        self.total -= 1
                        continue
                    return conn
            if not limit or self.total < limit:
                self.total += 1
                try:
                    return await self._open(deadline)
                except BaseException:
                    self._gone(None)
                    raise
            handed = await self._wait_for_slot(deadline)
            if handed is None:
                continue  # a slot came free: open (or take an idle one)
            if handed.closed or handed.transport.is_closing():  # type: ignore[union-attr]
                handed.close()  # lost while being handed over
                self.total -= 1
                continue
            return handed

    async def _wait_for_slot(self, deadline: float | None) -> _Connection | None:
        loop = self.client.loop
        waiter = loop.create_future()
        self.waiters.append(waiter)
        timer = None
        if deadline is not None:
            timer = loop.call_later(max(0.0, deadline - loop.time()), _expire, waiter)
        try:
            return await waiter  # a connection handed over, or None: a slot is free
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                handed = waiter.result()  # given to us just as we gave up: pass it on
                if handed is not None:
                    self._put_back(handed)
                else:
                    self._wake_one()
            else:
                try:
                    self.waiters.remove(waiter)
                except ValueError:
                    pass
            raise
        finally:
            if timer is not None:
                timer.cancel()

    async def _open(self, deadline: float | None) -> _Connection:
        client = self.client
        loop = client.loop
        timeout = client.connect_timeout_s
        if deadline is not None:
            left = deadline - loop.time()
            timeout = left if timeout is None else min(timeout, left)
            if timeout <= 0:
                raise UpstreamTimeout(f"no time left to connect to {self.host}:{self.port}", "connect")
        connect = loop.create_connection(lambda: _Connection(self), self.host, self.port, ssl=self.ssl,
                                         server_hostname=self.server_hostname)
        try:
            _, conn = await (asyncio.wait_for(connect, timeout) if timeout is not None else connect)
        except OSError as e:  # refused, unreachable, name unknown, TLS failure (ssl.SSLError is an OSError)
            if isinstance(e, TimeoutError) and e.errno is None:  # ours (wait_for), not the kernel's ETIMEDOUT
                raise UpstreamTimeout(f"connecting to {self.host}:{self.port} timed out", "connect") from None
            raise UpstreamConnectError(f"cannot connect to {self.host}:{self.port}: {type(e).__name__}: {e}") from e
        client.stats.connections_opened += 1
        return conn  # type: ignore[return-value]

    def _put_back(self, conn: _Connection) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        if self.client.closed:
            conn.close()
            self.total -= 1
            return
        conn.idle_since = self.client.loop.time()
        self.idle.append(conn)

    def _gone(self, conn: _Connection | None) -> None:
        """A busy (or never opened) connection is no more: its slot may go to a waiter."""
        self.total -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _forget_idle(self, conn: _Connection) -> None:
        """The server closed an idle connection: it must not be handed out."""
        try:
            self.idle.remove(conn)
        except ValueError:
            return  # already taken out (or handed to a waiter that will find it closed)
        self.total -= 1

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.total -= len(self.idle)
        self.idle.clear()
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_exception(UpstreamConnectError("client closed"))


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(UpstreamTimeout("timed out waiting for a free upstream connection", "pool"))


@dataclass(slots=True, frozen=True)
class _Target:
    pool: _HostPool
    path: str
    host_header: str


class UpstreamClient:
    """Keep-alive HTTP/1.1 client; one per router, used from one event loop."""

    def __init__(self, max_connections_per_host: int = 0, keepalive_s: float = 4.0,
                 connect_timeout_s: float | None = 3.0, ssl_context: ssl_module.SSLContext | None = None) -> None:
        self.max_connections_per_host = max_connections_per_host  # 0: unbounded
        self.keepalive_s = keepalive_s
        self.connect_timeout_s = connect_timeout_s
        self.ssl_context = ssl_context  # for https:// upstreams; None: the default verifying context
        self.stats = ClientStats()
        self.closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pools: dict[tuple[str, str, int], _HostPool] = {}
        self._targets: dict[str, _Target] = {}

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"not an http(s) URL: {url!r}")
            port = parts.port or (443 if parts.scheme == "https" else 80)
            key = (parts.scheme, parts.hostname, port)
            pool = self._pools.get(key)
            if pool is None:
                context = None
                if parts.scheme == "https":
                    context = self.ssl_context or ssl_module.create_default_context()
                pool = self._pools[key] = _HostPool(self, parts.hostname, port, context)
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            target = _Target(pool, path, parts.netloc.rpartition("@")[2])
            if len(self._targets) < 1024:  # the router has a handful of URLs; do not grow without bound
                self._targets[url] = target
        return target

    async def request(self, method: str, url: str, body: bytes = b"", headers: Mapping[str, str] | None = None, *,
                      timeout: float | None = None, idle_timeout: float | None = None,
                      retry_stale: bool | None = None) -> UpstreamResponse:
        """Send one request; returns once the response head is in (the body is read from the result).

        ``timeout``: the whole exchange, body included (counted from now); ``idle_timeout``: the
        longest wait for any byte. ``retry_stale`` (default: for GET and HEAD only): on the
        keep-alive race, send once more on a new connection. A POST is not re-sent here: whether
        that is safe is the caller's decision (the router's is in ``TurnProxy._connection_failure``).
        """
        if self.closed:
            raise UpstreamConnectError("client closed")
        target = self._target(url)
        loop = self.loop
        deadline = loop.time() + timeout if timeout is not None else None
        lines = [f"{method} {target.path} HTTP/1.1\r\nHost: {target.host_header}\r\n"]
        if body or method not in ("GET", "HEAD"):
            lines.append(f"Content-Length: {len(body)}\r\n")
        if headers:
            block = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            # a CR or LF inside a name or value would start a header (or a request) of its own
            if block.count("\n") != len(headers) or block.count("\r") != len(headers):
                raise ValueError("header names and values must not contain CR or LF")
            lines.append(block)
        lines.append("\r\n")
        data = "".join(lines).encode("latin-1") + body
        if retry_stale is None:
            retry_stale = method in ("GET", "HEAD")
        fresh = False
        while True:
            conn = await target.pool.acquire(deadline, fresh)
            conn.requests += 1
            reused = conn.requests > 1
            self.stats.requests += 1
            if reused:
                self.stats.reused += 1
            response = UpstreamResponse(conn, loop, reused, method == "HEAD", deadline, idle_timeout)
            conn.response = response
            try:
                try:
                    conn.transport.write(data)  # type: ignore[union-attr]
                except (RuntimeError, OSError) as e:  # closed under us (uvloop raises, asyncio drops the bytes)
                    response._lost(e if isinstance(e, OSError) else None)
                await response._read_head()
            except UpstreamDisconnected as e:
                response.close()
                if retry_stale and e.reused and not e.response_started and not fresh:
                    self.stats.stale_retries += 1
                    fresh = True
                    continue
                raise
            except BaseException:
                response.close()
                raise
            return response

    async def close(self) -> None:
        self.closed = True
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self._targets.clear()
