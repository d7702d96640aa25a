"""How the router learns D's ``kv_transfer_params`` when the stream does not carry them (vLLM 0.32).

On vLLM 0.33, D puts its ``kv_transfer_params`` on the final SSE chunk; on 0.32 streamed responses
carry none (only non-streamed bodies do), so vLLM's own multi-turn proxy never reuses anything on
0.32. Our connector, running inside D, knows the params the moment vLLM's ``request_finished``
builds them; this module is the router's half of how it hands them over.

Contract, version 1
===================

Router -> D (in the request body D receives, next to P's params)::

    "kv_transfer_params": {
        ...P's params, as P returned them...,
        "bidikv_notify": {"v": 1, "url": "<router>/internal/kv_params",
                          "turn": "<opaque turn id>", "token": "<per-request random secret>"}
    }

D's connector -> router, once per request, when it retains the blocks for a later turn
(``request_finished`` returns params with ``remote_block_ids``; not for aborted or failed requests)::

    POST <url>   Content-Type: application/json
    {"turn": "<turn id>", "token": "<secret>",
     "kv_transfer_params": {<exactly the dict request_finished returns>},
     "expires_in_s": <seconds until D frees the blocks, optional>,
     "heartbeat_url": "<http://host:port/bidikv/heartbeat of D's listener, optional>"}

When D keeps nothing for a later turn (bidirectional OFF, an aborted or failed request, blocks it does not
retain) it says so at once, so that a next turn of the conversation does not wait ``notify_wait_s`` for
a notification that will never come (added compatibly within version 1; an older router answers 400 and
waits as before)::

    POST <url>   {"turn": "<turn id>", "token": "<secret>", "retained": false}

Measured before this existed, on the CPU deployment with bidirectional OFF: a turn sent less than 2 s
after the previous one ended waited out the rest of those 2 s (0.5-1.8 s more to its first token, on 16
of 32 turns of one run).

``heartbeat_url`` (optional, added compatibly within version 1: older routers ignore it) is where
the router relays a conversation's heartbeats (:mod:`impl.router.heartbeat`,
:mod:`impl.connector.heartbeat`); D sends it only when it runs the listener
(``bidikv_heartbeat_port``).

``expires_in_s`` exists because ``remote_blocks_expiry_time`` is D's ``time.perf_counter()``, which
means nothing on the router's clock; without it the router assumes ``decoder_kv_blocks_ttl`` from
the moment D's stream ended.

Replies: 204 accepted; 400 malformed body (names the field); 403 wrong token; 404 unknown or
already-finished turn (late: do not retry); 409 a notification for this turn was already accepted;
413 body too large. The connector posts off the engine's critical path (a background thread), with a
timeout of about one second, and retries at most once and only on a connection error: a lost
notification costs one turn's reuse, never correctness.

Authentication is the per-request token, not a tenant API key: only the D that received the turn
knows it, it is compared in constant time, and it dies with the turn. The turn id alone grants nothing.

Router side
===========

The router opens a turn before calling D. When D's stream has ended successfully (``[DONE]``, no
error), it takes whichever source it already has: a notification wins over a final-chunk copy when
both exist and differ (the connector reports what D actually retained; the conflict is counted). If
neither has arrived it waits up to ``notify_wait_s`` -- after the client already has ``[DONE]``, so
the client's stream is never delayed -- and otherwise stores nothing for that turn.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import math
import secrets
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

NOTIFY_KEY = "bidikv_notify"
CONTRACT_VERSION = 1
MAX_NOTIFY_BODY_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Notification:
    kv_params: dict[str, Any] | None  # None: D retained nothing for a later turn ("retained": false)
    expires_in_s: float | None
    received_at: float  # monotonic
    heartbeat_url: str | None = None  # D's heartbeat listener, when it runs one


class Delivery(enum.Enum):
    ACCEPTED = 204
    BAD_TOKEN = 403
    UNKNOWN_TURN = 404
    DUPLICATE = 409


class NotifyError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(slots=True)
class _Pending:
    token: str
    notification: Notification | None = None
    waiter: asyncio.Future | None = None


class NotifyHub:
    """Open turns waiting for D's notification. Entries live exactly as long as their turn."""

    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def open(self, turn: str) -> str:
        """Register ``turn``; returns the secret D must present."""
        token = secrets.token_urlsafe(18)
        self._pending[turn] = _Pending(token)
        return token

    def close(self, turn: str) -> None:
        pending = self._pending.pop(turn, None)
        if pending is not None and pending.waiter is not None and not pending.waiter.done():
            pending.waiter.set_result(None)  # a waiter still parked learns there is nothing to come

    def peek(self, turn: str) -> Notification | None:
        pending = self._pending.get(turn)
        return None if pending is None else pending.notification

    def deliver(self, turn: str, token: str, notification: Notification) -> Delivery:
        pending = self._pending.get(turn)
        if pending is None:
            return Delivery.UNKNOWN_TURN
        if not hmac.compare_digest(pending.token.encode(), token.encode("utf-8", "surrogatepass")):
            return Delivery.BAD_TOKEN
        if pending.notification is not None:
            return Delivery.DUPLICATE
        pending.notification = notification
        if pending.waiter is not None and not pending.waiter.done():
            pending.waiter.set_result(notification)
        return Delivery.ACCEPTED

    async def wait(self, turn: str, timeout_s: float) -> Notification | None:
        pending = self._pending.get(turn)
        if pending is None:
            return None
        if pending.notification is not None or timeout_s <= 0:
            return pending.notification
        if pending.waiter is None:
            pending.waiter = asyncio.get_running_loop().create_future()
        try:
            return await asyncio.wait_for(asyncio.shield(pending.waiter), timeout_s)
        except asyncio.TimeoutError:
            return pending.notification


def notify_field(url: str, turn: str, token: str) -> dict[str, Any]:
    return {"v": CONTRACT_VERSION, "url": url, "turn": turn, "token": token}


def parse_notification(body: Any, now: float | None = None) -> tuple[str, str, Notification]:
    """Validate a notification body; raises :class:`NotifyError` naming the bad field."""
    if not isinstance(body, dict):
        raise NotifyError("body", "must be a JSON object")
    turn, token, params = body.get("turn"), body.get("token"), body.get("kv_transfer_params")
    if not isinstance(turn, str) or not turn or len(turn) > 128:
        raise NotifyError("turn", "must be a non-empty string of at most 128 characters")
    if not isinstance(token, str) or not token or len(token) > 256:
        raise NotifyError("token", "must be a non-empty string")
    retained = body.get("retained", True)
    if not isinstance(retained, bool):
        raise NotifyError("retained", "must be true or false")
    if not retained:
        extra = sorted(k for k in body if k not in ("turn", "token", "retained"))
        if extra:
            raise NotifyError(extra[0], "is not allowed with \"retained\": false")
        return turn, token, Notification(None, None, time.monotonic() if now is None else now)
    if not isinstance(params, dict) or not params:
        raise NotifyError("kv_transfer_params", "must be a non-empty object")
    expires_in = body.get("expires_in_s")
    if expires_in is not None:
        if isinstance(expires_in, bool) or not isinstance(expires_in, (int, float)) or not math.isfinite(expires_in) or expires_in < 0:
            raise NotifyError("expires_in_s", "must be a finite number >= 0")
        expires_in = float(expires_in)
    heartbeat_url = body.get("heartbeat_url")
    if heartbeat_url is not None and not _is_http_url(heartbeat_url):
        raise NotifyError("heartbeat_url", "must be an http(s) URL with a host and port, of at most 512 characters")
    return turn, token, Notification(params, expires_in, time.monotonic() if now is None else now, heartbeat_url)


def _is_http_url(value: Any) -> bool:
    if not isinstance(value, str) or len(value) > 512:
        return False
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:  # a port out of range or not a number
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and port is not None \
        and not parts.username and not parts.password and not parts.query and not parts.fragment
