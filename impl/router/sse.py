"""Incremental splitting of a server-sent-event byte stream into whole events.

D's stream reaches the router in arbitrary pieces: an event can be cut anywhere (even inside a
``\\r\\n``), several events can share one read, keep-alive comments (``: ping``) can sit between them.
llm-d's sidecar review (#2831) reproduced lost ``kv_transfer_params`` from exactly such cuts. The
router therefore forwards D's bytes at event granularity only: a whole event is forwarded (or
rewritten) as one unit, so an error event the router injects after a broken upstream can never land
in the middle of a half-forwarded one.

Per the SSE spec a line ends with CRLF, LF or CR and an empty line ends an event; only ``data:``
fields matter here (vLLM names no events), several ``data:`` lines join with ``\\n``.

Every event comes out of the splitter already checked by :mod:`impl.router.scrub` (so no caller can
forget it): one that could spell a KV location is re-encoded without it, one that could but cannot
be parsed is replaced by an error event, a suspicious comment is dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from impl.router.scrub import scrub_event, suspect

_BOUNDARY = re.compile(rb"(?:\r\n|\n|\r)(?:\r\n|\n|\r)")
_LINE_END = re.compile(rb"\r\n|\n|\r")

DONE = b"[DONE]"
# what replaces an event that could carry KV locations but cannot be parsed (capture reads it as D's error)
REFUSED_DATA = (b'{"error":{"message":"decode instance sent an event the router could not check for KV locations; '
                b'dropped","type":"upstream_error","code":502}}')


class SSEError(Exception):
    """The upstream's stream is not a usable event stream (an event larger than the limit)."""


@dataclass(frozen=True, slots=True)
class SSEEvent:
    raw: bytes  # the event's bytes as received, including its terminating blank line
    data: bytes | None  # joined data fields; None for comment-only / field-less blocks (keep-alives)


def checked_event(raw: bytes, data: bytes | None) -> SSEEvent:
    """The event as the client may see it (see the module doc); ``data`` is what capture reads."""
    if data is None:
        return SSEEvent(b"" if suspect(raw) else raw, None)
    cleaned = scrub_event(data)
    if cleaned is None:
        return SSEEvent(format_event(REFUSED_DATA), REFUSED_DATA)
    client, capture = cleaned
    if client is data:
        return SSEEvent(raw, data)
    return SSEEvent(format_event(client), capture)


def event_data(block: bytes) -> bytes | None:
    """The joined ``data:`` fields of one event block, or None if it has none."""
    if block.startswith(b"data: ") and b"\n" not in block[:-2] and b"\r" not in block[:-2]:
        # fast path: vLLM's one-line "data: ...\n\n"
        end = len(block)
        while end and block[end - 1] in b"\r\n":
            end -= 1
        return block[6:end]
    parts: list[bytes] = []
    for line in _LINE_END.split(block):
        if line.startswith(b"data"):
            if line == b"data":
                parts.append(b"")
            elif line[4:5] == b":":
                value = line[5:]
                parts.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(parts) if parts else None


class SSESplitter:
    """Feed bytes, get whole events back; remembers the tail of an unfinished event."""

    __slots__ = ("_buf", "max_event_bytes")

    def __init__(self, max_event_bytes: int = 8 * 1024 * 1024) -> None:
        self._buf = b""
        self.max_event_bytes = max_event_bytes

    @property
    def pending(self) -> int:
        """Bytes received that do not yet form a whole event."""
        return len(self._buf)

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        buf = self._buf + chunk if self._buf else chunk
        events: list[SSEEvent] = []
        start = 0
        if b"\r" not in buf:  # vLLM's framing: LF only, so a plain search finds every boundary
            find = buf.find
            clean = not suspect(buf)  # one check for all this read holds: nothing in it can spell a location
            while (end := find(b"\n\n", start)) >= 0:
                block = buf[start:end + 2]
                if buf.startswith(b"data: ", start) and find(b"\n", start, end) < 0:
                    data = buf[start + 6:end]  # one "data: ..." line
                    events.append(SSEEvent(block, data) if clean or not suspect(data) else checked_event(block, data))
                elif clean:
                    events.append(SSEEvent(block, event_data(block)))
                else:
                    events.append(checked_event(block, event_data(block)))
                start = end + 2
            self._buf = buf[start:]
            if len(self._buf) > self.max_event_bytes:
                raise SSEError(f"an event exceeds {self.max_event_bytes} bytes without ending")
            return events
        n = len(buf)
        for m in _BOUNDARY.finditer(buf):
            end = m.end()
            if end == n and buf[-1:] == b"\r":
                break  # a trailing CR may be the first half of CRLF: wait for the next byte
            block = buf[start:end]
            events.append(checked_event(block, event_data(block)))
            start = end
        self._buf = buf[start:]
        if len(self._buf) > self.max_event_bytes:
            raise SSEError(f"an event exceeds {self.max_event_bytes} bytes without ending")
        return events

    def flush(self) -> list[SSEEvent]:
        """At end of stream: a tail ended by a lone CR pair is still an event; anything else is cut."""
        buf, self._buf = self._buf, b""
        if buf and _BOUNDARY.search(buf):
            return [checked_event(buf, event_data(buf))]
        return []

    def take_incomplete(self) -> bytes:
        """The unfinished tail (what a stream cut mid-event leaves behind)."""
        buf, self._buf = self._buf, b""
        return buf


def format_event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"
