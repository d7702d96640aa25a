"""Client heartbeats: ``POST /v1/conversations/{conversation_id}/heartbeat``, relayed to the D holding the KV.

Under the ``lease`` retention (:class:`impl.policy.HeartbeatLease`, ``bidikv_retention: "lease"`` on
D) D frees a finished turn's blocks ``lease_s`` after the last heartbeat, so a conversation that goes
idle stops pinning decode memory within one lease instead of a whole TTL. A client (or the agent
framework driving it) heartbeats while the conversation is live, every ``heartbeat_interval_s``
(D's answer says how often); this module carries each heartbeat to D and brings the new expiry back.

Per heartbeat:

1. Authenticate like completions (tenant API key). The conversation is looked up under the key's
   tenant only; unknown, expired and another tenant's ids all get the same 404, so an id's existence
   never leaks across tenants.
2. Find D's listener: D's connector sends its ``heartbeat_url`` in the notification of every retained
   turn (:mod:`impl.router.notify`), remembered here per ``remote_engine_id`` (a listener belongs to
   one engine core). With ``rewrite_remote_host`` its host is replaced by the D instance's HTTP host,
   as ``remote_host`` is (D advertises ``VLLM_NIXL_SIDE_CHANNEL_HOST``, often ``localhost``).
3. POST ``{"request_id", "engine_id"}`` to it (:mod:`impl.connector.heartbeat` has the protocol).
   D applies its retention policy's ``renew`` and answers the expiry it now enforces.
4. Update the stored entry: its expiry on the router's clock (send time + D's ``expires_in_s``: D's
   clock read the answer later than we sent, so this never overestimates) and
   ``remote_blocks_expiry_time`` in its params (D's clock, forwarded to P, which declines a read
   within 5 s of it: without the update P would decline a renewed conversation's read).

Answers: 200 ``{"conversation_id", "renewed", "expires_in_s", ...}`` (``renewed`` false when D's
policy is not a lease, when the lease is at its ``max_hold_s`` cap, or when D runs no listener --
then the blocks live out their fixed expiry); 410 when D no longer holds the blocks (the entry is
dropped: the next turn recomputes); 404 unknown; 401; 400 naming the field; 503 D unreachable or
busy, 504 D timed out, 502 D answered nonsense -- in all three the entry is left as it was.

Separate from the turn path on purpose: its own small aiohttp session (D's listener is another port,
one request per connection), and nothing here runs for completions.

Which client behaviour a caller implements (the simulator's names, ``sim/clients/renewal.py``; ``bidikv tune
--client-renewal`` recommends for one; examples in the README's router section):

* ``while_open`` -- a chat UI that heartbeats while its page is open, or an API client while its
  session object lives: after every reply, whether or not the user writes again. Browsers throttle
  a hidden tab's repeating timers to once a minute after five minutes
  (https://chromestatus.com/feature/4718288976216064), so a chat UI's lease must outlast a minute
  plus one interval or its background tabs lapse.
* ``tool_calls`` -- an agent framework that heartbeats only while a tool call it made runs, and
  stops once the model answers the user.
* ``never`` -- a client that never calls this endpoint: D's lease is then a fixed TTL of ``lease_s``.
* ``until_next_turn`` -- heartbeats exactly until the next turn: no client knows that; the simulator
  keeps it only as an upper bound.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import math
import time
from typing import Any, Callable
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from aiohttp import web

from impl.policy import ConversationEntry
from impl.router.config import RouterConfig, url_host
from impl.router.connections import BodyTimeout, ClientConnections
from impl.router.metrics import Counter, RouterMetrics
from impl.router.notify import Notification
from impl.router.proxy import NOT_HELD_REASONS, body_too_large_response, error_response, unauthenticated_response
from impl.router.request import RequestError, check_conversation_id, parse_json_body
from impl.router.stores import MAX_ENGINES, RouterStore, StoreUnavailable
from impl.router.tenants import Tenants

log = logging.getLogger("bidikv.router")

# any id a turn can be stored under, braces and all (aiohttp's default "{name}" pattern, [^{}/]+,
# refuses "{3F2504E0-...}"): everything between the fixed parts
HEARTBEAT_ROUTE = "/v1/conversations/{conversation_id:.+}/heartbeat"
METRIC_ROUTE = "/v1/conversations/{id}/heartbeat"  # the requests_total label: never the id itself
MAX_ANSWER_BYTES = 64 * 1024
# D's clock runs from its finish, the stored entry's from when the router stored it (after D's
# notification): a renewal may sit this much further past the published expiry than the router's own
# elapsed time says, and more is a D answering nonsense
RENEW_SLACK_S = 2.0
_NOT_FOUND = "unknown conversation (never stored under this API key, expired, or evicted)"


class HeartbeatDirectory:
    """``remote_engine_id`` -> D's heartbeat URL, learnt from D's notifications; LRU-bounded."""

    def __init__(self, max_engines: int = MAX_ENGINES) -> None:
        self.max_engines = max_engines
        self._urls: collections.OrderedDict[str, str] = collections.OrderedDict()

    def learn(self, notification: Notification) -> None:
        engine = notification.kv_params.get("remote_engine_id")
        if notification.heartbeat_url is None or not isinstance(engine, str) or not engine:
            return
        self._urls[engine] = notification.heartbeat_url
        self._urls.move_to_end(engine)
        while len(self._urls) > self.max_engines:
            self._urls.popitem(last=False)

    def url_for(self, engine_id: Any) -> str | None:
        return self._urls.get(engine_id) if isinstance(engine_id, str) else None

    def __len__(self) -> int:
        return len(self._urls)


class _RelayFailure(Exception):
    def __init__(self, status: int, outcome: str, message: str) -> None:
        super().__init__(message)
        self.status, self.outcome, self.message = status, outcome, message


class HeartbeatRelay:
    def __init__(self, config: RouterConfig, tenants: Tenants, store: RouterStore, metrics: RouterMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.tenants = tenants
        self.store = store
        self.metrics = metrics
        self.clock = clock  # the store's clock (the turn proxy's: time.monotonic)
        self.directory = HeartbeatDirectory()
        # the router's client-connection clocks (impl.router.connections): a body that never arrives
        # must not hold this handler either; the Router swaps in its own
        self.connections: ClientConnections | None = None
        self.outcomes: Counter = metrics.registry.add(Counter(
            "bidikv_router_heartbeats_total",
            "Client heartbeats, by outcome (renewed; not_renewed: D held the blocks but its policy did not "
            "extend them; no_listener; not_held; not_found; unauthenticated; invalid; unreachable; timeout; "
            "busy; bad_answer; skipped: D's listener failed to answer within --heartbeat-retry-s, not asked "
            "again yet; superseded; store_unavailable).", ("outcome",)))
        self.timeout = aiohttp.ClientTimeout(total=config.heartbeat_timeout_s,
                                             sock_connect=min(config.connect_timeout_s, config.heartbeat_timeout_s))
        self.session: aiohttp.ClientSession | None = None
        self._sharing: set[asyncio.Task] = set()  # listener URLs on their way to the shared store
        # listener URL -> until when it is skipped (it timed out or refused): a hung listener costs one
        # --heartbeat-timeout-s per --heartbeat-retry-s, not one per turn; bounded like the directory
        self._skipped: collections.OrderedDict[str, float] = collections.OrderedDict()

    def learn(self, notification: Notification) -> None:
        engine = notification.kv_params.get("remote_engine_id")
        if notification.heartbeat_url is not None and isinstance(engine, str) and engine \
                and self.directory.url_for(engine) != notification.heartbeat_url:
            # shared with the other replicas (a no-op in memory), off the notification's path
            task = asyncio.get_running_loop().create_task(self._share_listener(engine, notification.heartbeat_url))
            self._sharing.add(task)
            task.add_done_callback(self._sharing.discard)
        self.directory.learn(notification)

    async def _share_listener(self, engine: str, url: str) -> None:
        try:
            await self.store.remember_listener(engine, url)
        except StoreUnavailable:
            pass  # another replica then answers this conversation's heartbeats with renewed: false

    async def start(self) -> None:
        # D's listener answers one request per connection: no keep-alive pool to manage
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256, force_close=True),
                                             cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False)

    async def stop(self) -> None:
        if self._sharing:
            await asyncio.gather(*list(self._sharing), return_exceptions=True)
        if self.session is not None:
            await self.session.close()
            self.session = None

    # -- the endpoint ------------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.Response:
        try:
            response, outcome = await self._handle(request)
        except BodyTimeout:
            response, outcome = self.connections.body_timeout_response(), "invalid"
        except ConnectionResetError:  # the client left mid-body: its doing, nobody to answer
            response, outcome = web.Response(status=499), "invalid"
        except Exception:
            log.exception("unhandled error on %s", METRIC_ROUTE)
            response, outcome = error_response(500, "internal router error", "internal_error"), "error"
        self.outcomes.inc(outcome)
        self.metrics.requests.inc(METRIC_ROUTE, str(response.status))
        return response

    async def _handle(self, request: web.Request) -> tuple[web.Response, str]:
        tenant = self.tenants.tenant_for(request.headers.get("Authorization"))
        if tenant is None:
            return unauthenticated_response(), "unauthenticated"
        try:
            conversation_id = check_conversation_id(request.match_info.get("conversation_id", ""),
                                                    self.config.max_conversation_id_len)
            raw = await (self.connections.read_body(request) if self.connections is not None else request.read())
            if raw.strip():
                parse_json_body(raw)  # an optional JSON object; no field is read yet, so none can be wrong
        except RequestError as e:
            return error_response(e.status, e.message, "invalid_request_error", e.field), "invalid"
        except web.HTTPRequestEntityTooLarge:
            return body_too_large_response(self.config.max_body_bytes), "invalid"

        try:
            got = await self.store.get(tenant, conversation_id)  # tenant-scoped: another tenant's id is None too
        except StoreUnavailable:
            return _store_down(), "store_unavailable"
        entry = got.entry if got is not None else None
        now = self.clock()
        if entry is None or now >= entry.expires_at:
            return error_response(404, _NOT_FOUND, "not_found_error", "conversation_id"), "not_found"
        url = await self._listener_url(entry)
        if url is None:
            # D runs no listener (or never told us): its blocks live out the expiry it published
            return self._ok(conversation_id, entry, now, renewed=False, reason="no_heartbeat_listener"), "no_listener"

        sent_at = self.clock()
        try:
            answer = await self._relay(url, entry)
        except _RelayFailure as e:
            self.metrics.upstream_errors.inc(entry.decode_instance, "decode", f"heartbeat_{e.outcome}")
            kind = "service_unavailable" if e.status == 503 else "upstream_error"
            return error_response(e.status, e.message, kind), e.outcome

        try:
            current = await self.store.get(tenant, conversation_id)
        except StoreUnavailable:
            return _store_down(), "store_unavailable"
        now = self.clock()
        if current is None or current.version != got.version:
            # a newer turn replaced (or the store dropped) the entry while D answered: D renewed blocks
            # nobody will read again, and the newer entry's expiry is D's fresh one
            if current is None:
                return error_response(404, _NOT_FOUND, "not_found_error", "conversation_id"), "not_found"
            return self._ok(conversation_id, current.entry, now, renewed=False, reason="superseded"), "superseded"
        if answer["status"] == "not_held":
            # read by a next turn already, or expired on D: offering it again would only be declined.
            # Only this very entry: another replica may have stored a newer turn since (compare-and-set)
            try:
                await self.store.forget(tenant, conversation_id, expect=got.version)
            except StoreUnavailable:
                pass  # P declines the stale blocks on the next turn, which then recomputes
            return error_response(410, "the decode instance no longer holds this conversation's KV "
                                       f"({answer['reason']}); the next turn recomputes it",
                                  "not_held", "conversation_id"), "not_held"
        # D's figures, bounded by what D's retention can grant: never longer than D's TTL or the hold it
        # published with the turn, whichever is longer (a broken D answering 1e9 s is not believed)
        cap = max(self.config.decoder_kv_blocks_ttl, entry.expires_at - entry.stored_at)
        in_s = min(answer["expires_in_s"], cap)
        expires_at = sent_at + in_s
        if answer["renewed"] and expires_at > entry.expires_at:
            params = dict(entry.kv_params)
            expiry = _bounded_expiry(answer["expiry_time"], entry, sent_at, cap)
            if expiry is not None:
                params["remote_blocks_expiry_time"] = expiry
            renewed_entry = dataclasses.replace(entry, kv_params=params, expires_at=expires_at)
            try:
                # written back only over the entry we read: a newer turn stored meanwhile (on any
                # replica) has had P read these blocks, and must not be replaced by them
                stored = await self.store.replace(tenant, conversation_id, renewed_entry, now, expect=got.version)
            except StoreUnavailable:
                return _store_down(), "store_unavailable"
            if not stored:
                newer = await self._current(tenant, conversation_id)
                if newer is None:
                    return error_response(404, _NOT_FOUND, "not_found_error", "conversation_id"), "not_found"
                return self._ok(conversation_id, newer, now, renewed=False, reason="superseded"), "superseded"
            entry = renewed_entry
            outcome, renewed = "renewed", True
        else:
            outcome, renewed = "not_renewed", False
        extra = {"retention": answer.get("retention")}
        if answer.get("heartbeat_interval_s") is not None:
            extra["heartbeat_interval_s"] = answer["heartbeat_interval_s"]
        return self._ok(conversation_id, entry, now, renewed=renewed, **extra), outcome

    async def renew_for_read(self, entry: ConversationEntry) -> tuple[str, float | None]:
        """Give-back D (``bidikv_renew_before_read`` in its params): ask it to renew the turn P is about to
        read. (outcome, expiry to forward as ``remote_blocks_expiry_time``): 'renewed' or 'lapsing' (D is
        giving it back; P may read until the expiry it was given) with D's expiry; 'given_back' or another
        not-held reason with None (nothing to read); a relay failure's outcome with None (the stored,
        older expiry is forwarded: P declines it once it is near, never reads past it)."""
        url = await self._listener_url(entry)
        if url is None:
            return "no_listener", None
        sent_at = self.clock()
        try:
            answer = await self._relay(url, entry)
        except _RelayFailure as e:
            self.metrics.upstream_errors.inc(entry.decode_instance, "decode", f"renew_{e.outcome}")
            return e.outcome, None
        if answer["status"] == "not_held":
            return answer["reason"], None
        # a renewal moves D's published expiry on by the time passed since it published it: D answers
        # min(intended, now + publish window) (impl.policy.give_back); more is not believed
        return ("renewed" if answer["renewed"] else "lapsing"), _bounded_expiry(answer["expiry_time"], entry, sent_at, 0.0)

    async def _current(self, tenant: str, conversation_id: str) -> ConversationEntry | None:
        try:
            got = await self.store.get(tenant, conversation_id)
        except StoreUnavailable:
            return None
        return None if got is None else got.entry

    async def _listener_url(self, entry: ConversationEntry) -> str | None:
        engine = entry.kv_params.get("remote_engine_id")
        url = self.directory.url_for(engine)
        if url is None and isinstance(engine, str):
            # the notification naming it may have reached another replica: the shared store has it
            try:
                url = await self.store.listener(engine)
            except StoreUnavailable:
                url = None
        if url is None or not self.config.rewrite_remote_host:
            return url
        host = urlsplit(entry.decode_instance).hostname
        if not host:
            return url
        parts = urlsplit(url)
        return urlunsplit((parts.scheme, f"{url_host(host)}:{parts.port}", parts.path, "", ""))

    def _ok(self, conversation_id: str, entry: ConversationEntry, now: float, *, renewed: bool,
            **extra: Any) -> web.Response:
        left = max(0.0, entry.expires_at - now)
        body = {"conversation_id": conversation_id, "renewed": renewed, "expires_in_s": round(left, 3),
                "expires_at": round(time.time() + left, 3)}  # wall clock, for clients; the store keeps monotonic
        body.update({k: v for k, v in extra.items() if v is not None})
        return web.json_response(body)

    async def _relay(self, url: str, entry: ConversationEntry) -> dict[str, Any]:
        """D's validated answer, or _RelayFailure (503 unreachable/busy, 504 timeout, 502 nonsense)."""
        if self.session is None:
            raise _RelayFailure(503, "unreachable", "the router is not started")
        skipped_until = self._skipped.get(url)
        if skipped_until is not None:
            if time.monotonic() < skipped_until:
                raise _RelayFailure(503, "skipped", "the decode instance's heartbeat listener failed to answer "
                                                    "recently; heartbeat again shortly")
            del self._skipped[url]
        payload = json.dumps({"request_id": entry.kv_params.get("remote_request_id"),
                              "engine_id": entry.kv_params.get("remote_engine_id")}).encode()
        try:
            async with self.session.post(url, data=payload, headers={"Content-Type": "application/json"},
                                         timeout=self.timeout) as resp:
                status = resp.status
                raw = await _read_bounded(resp, MAX_ANSWER_BYTES)
        except aiohttp.ClientConnectorError:
            self._skip(url)
            raise _RelayFailure(503, "unreachable", "the decode instance holding this conversation is unreachable") from None
        except asyncio.TimeoutError:
            self._skip(url)
            raise _RelayFailure(504, "timeout", "the decode instance holding this conversation did not answer in time") from None
        except aiohttp.ClientError as e:
            raise _RelayFailure(502, "bad_answer", f"the decode instance's heartbeat listener failed ({type(e).__name__})") from None
        if status == 503:
            raise _RelayFailure(503, "busy", "the decode instance is busy; heartbeat again shortly")
        answer = _parse_answer(raw) if status == 200 and raw is not None else None
        if answer is None:
            raise _RelayFailure(502, "bad_answer", f"the decode instance's heartbeat listener answered HTTP {status} "
                                                   "without a valid answer")
        return answer

    def _skip(self, url: str) -> None:
        self._skipped[url] = time.monotonic() + self.config.heartbeat_retry_s
        self._skipped.move_to_end(url)
        while len(self._skipped) > MAX_ENGINES:
            self._skipped.popitem(last=False)


def _bounded_expiry(answered: float, entry: ConversationEntry, sent_at: float, extra_s: float) -> float | None:
    """D's answered expiry (D's clock), at most the expiry it published with the turn plus the time the
    router has seen pass since it stored it (plus ``extra_s`` and the slack); None when the entry holds no
    published expiry to measure from (the stored params are then left as they are)."""
    published = entry.kv_params.get("remote_blocks_expiry_time")
    if not _finite(published):
        return None
    return min(answered, published + max(0.0, sent_at - entry.stored_at) + extra_s + RENEW_SLACK_S)


async def _read_bounded(resp: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The whole body, or None beyond ``limit`` bytes (D's answers are a few hundred bytes)."""
    if resp.content_length is not None and resp.content_length > limit:
        return None
    parts, size = [], 0
    async for chunk in resp.content.iter_chunked(8192):
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)


def _store_down() -> web.Response:
    return error_response(503, "the conversation store is unavailable; heartbeat again shortly", "service_unavailable")


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _parse_answer(raw: bytes) -> dict[str, Any] | None:
    """D's answer (impl.connector.heartbeat's protocol) if well-formed, else None."""
    try:
        answer = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(answer, dict):
        return None
    if answer.get("status") == "not_held":
        reason = answer.get("reason", "not_held")
        return {"status": "not_held", "reason": reason if reason in NOT_HELD_REASONS else "other"}
    if answer.get("status") != "held" or not isinstance(answer.get("renewed"), bool):
        return None
    if not _finite(answer.get("expires_in_s")) or answer["expires_in_s"] < 0 or not _finite(answer.get("expiry_time")):
        return None
    interval = answer.get("heartbeat_interval_s")
    if interval is not None and not (_finite(interval) and interval > 0):
        answer.pop("heartbeat_interval_s")
    if not isinstance(answer.get("retention"), str):
        answer.pop("retention", None)
    return answer


__all__ = ["HEARTBEAT_ROUTE", "HeartbeatDirectory", "HeartbeatRelay"]
