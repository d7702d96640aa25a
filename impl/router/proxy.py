"""One turn through P and D: vLLM's bidirectional flow (RFC #32733), with its faults handled.

1. Look the conversation up in impl.policy's store under the key's tenant, with the guard's prompt
   view (see :mod:`impl.router.request`). A hit yields the previous turn's D params; a miss (unknown,
   expired, guard, tenant, evicted -- or no conversation id, or a request shape that is never
   reused) yields the fresh-turn params. A hit leaves the store (single-use): once P may have read
   D's blocks, D frees them, so a failed turn's retry recomputes rather than being offered them again.
2. P gets the request with ``max_tokens=1``, ``stream=false`` and those params
   (``do_remote_decode=true``), exactly as vLLM's proxy sends it. P unreachable -> the next P;
   P 5xx after being offered reuse -> retried without reuse (a failed pull under
   ``kv_load_failure_policy: "fail"`` must not fail the turn); P 4xx -> the client's error, passed on.
   No P -> 503.
3. D gets the original request with P's returned params (plus the notify field of
   :mod:`impl.router.notify`). D unreachable or 5xx before answering -> the next D, with the same P
   params (any D can read P's blocks); no D -> 503/502, and P frees its blocks after its
   ``kv_lease_duration`` since no D heartbeats them.
4. D's answer goes to the client event by event while the router captures the answer and D's
   params. D failing mid-stream, stalling beyond ``decode_idle_timeout_s`` or ending without
   ``[DONE]`` -> an SSE error event (then ``[DONE]``), nothing stored.
5. Only a complete turn is stored (:mod:`impl.router.recorder`), with D's params from the final
   chunk or D's notification, the expiry on the router's clock, and the digest of the sequence D
   now holds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import aiohttp
from aiohttp import web

from impl.policy import ConversationEntry, Lookup, MissReason
from impl.policy.history_key import add_anchor_length, anchor_lengths
from impl.policy.give_back import RENEW_BEFORE_READ_KEY
from impl.policy.prefill_affinity import PrefillAffinity
from impl.policy.prefill_on_d import PathDecision, PathReason, TurnPath
from impl.policy.prefix_check import REPORT_KEY
from impl.policy.return_time import RETENTION_KEY
from impl.router.capture import TurnCapture
from impl.router.host_tier import REMOTE_KV_SOURCE, HostOffer, HostTierRouter
from impl.router.config import RouterConfig
from impl.router.metrics import RouterMetrics
from impl.router.on_d import OnDRouting, on_d_params
from impl.router.notify import NOTIFY_KEY, NotifyHub, notify_field
from impl.router.recorder import TurnRecorder
from impl.router.request import TurnRequest, shown_id
from impl.router.retention import RouterRetention
from impl.router.sse import SSEError, SSESplitter, format_event
from impl.router.trace_writer import TurnTracer
from impl.router.stores import RouterStore, StoreUnavailable
from impl.router.upstream_http import (UpstreamClient, UpstreamConnectError, UpstreamDisconnected, UpstreamError,
                                       UpstreamResponse)
from impl.router.upstreams import Upstream, UpstreamPool

log = logging.getLogger("bidikv.router")
# one line per turn (how it was matched, what was offered, where it went); silence it by name
turn_log = logging.getLogger("bidikv.router.turns")

FRESH_TURN_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Fields P does not accept or that would make it do more than prefill (as vLLM's proxy strips them).
# what a D answers for a turn it no longer holds (impl.connector.heartbeat's not_held reasons); any other
# reason is read as "other" (impl.router.heartbeat): D's text never becomes a metric label or client text
NOT_HELD_REASONS = ("given_back", "expired", "unknown", "other_engine", "not_held")
_NOT_HELD = NOT_HELD_REASONS
# relay outcomes in which D said nothing about the blocks (impl.router.heartbeat)
NO_ANSWER = ("no_listener", "unreachable", "timeout", "busy", "skipped")
# renewal outcomes after which the expiry D published with the turn still stands: D said it holds the
# blocks (without an expiry the router could bound), or said nothing at all (P declines near that expiry)
_STILL_HELD = ("renewed", "lapsing") + NO_ANSWER
# answers a history key can be told from: plain, or with reasoning (the key's normal form drops it)
_KEYABLE_ANSWERS = (None, "reasoning_content", "reasoning")
_PREFILL_DROP = ("max_completion_tokens", "min_tokens", "min_completion_tokens", "stream_options")
# The fields P's and D's bodies set differently. The rest of the client's body (the history: nearly
# all its bytes) is JSON-encoded once per turn and shared by both (see _SharedBody).
_PER_UPSTREAM_KEYS = frozenset(("stream", "max_tokens", "kv_transfer_params", "return_token_ids") + _PREFILL_DROP)
# A pooled keep-alive connection the upstream closed meanwhile (vLLM's uvicorn drops idle ones after
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s) fails before any response byte (UpstreamDisconnected with
# response_started false): retried on the same instance, which is fine. uvicorn closes a connection
# only between requests, so such a request never reached vLLM and re-sending the POST is safe.
STALE_RETRIES = 2
_NOT_LISTED = Lookup(None, MissReason.UNKNOWN)  # an anchor whose directory lists nothing this prompt continues
_JSON_HEADERS = {"Content-Type": "application/json"}


def error_body(message: str, kind: str, status: int, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}).encode()


# Retry-After on the router's own 429/503s: an instance that left rotation is probed again every
# health_interval_s (2 s by default), so a retry sooner than that finds the same state. The openai SDKs
# honour the header when they retry (their max_retries, 2 by default).
RETRY_AFTER_S = "2"


def error_response(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    headers = _JSON_HEADERS if status not in (429, 503) else {**_JSON_HEADERS, "Retry-After": RETRY_AFTER_S}
    return web.Response(status=status, body=error_body(message, kind, status, param), headers=headers)


def unauthenticated_response() -> web.Response:
    return error_response(401, "a valid API key is required (Authorization: Bearer <key>)", "authentication_error")


def body_too_large_response(max_body_bytes: int) -> web.Response:
    return error_response(413, f"request body exceeds {max_body_bytes} bytes", "invalid_request_error", "body")


class UpstreamFailure(Exception):
    """No upstream could serve this step: 503 (none reachable), 502 (they failed), 504 (timed out)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def response(self) -> web.Response:
        return error_response(self.status, self.message, "service_unavailable" if self.status == 503 else "upstream_error")


class _SharedBody:
    """A turn's body encoded once, for P's and D's variants of it.

    Encoding a long conversation's history costs ~15 us per 2 KB here and the turn needs it twice (P
    and D), so the fields the two differ in are encoded apart and spliced onto the shared part:
    ``{"model": ..., "messages": [...], <own fields>}``. Only key order differs from encoding each
    body whole; the values are the same.
    """

    __slots__ = ("own", "_head")

    def __init__(self, body: dict[str, Any]) -> None:
        common = {k: v for k, v in body.items() if k not in _PER_UPSTREAM_KEYS}
        self.own = {k: v for k, v in body.items() if k in _PER_UPSTREAM_KEYS}  # the client's values of those
        encoded = json.dumps(common)
        self._head = encoded[:-1] + ", " if common else "{"  # the shared part, open for more fields

    def encode(self, fields: dict[str, Any]) -> bytes:
        if not fields:
            return (self._head[:-2] + "}" if self._head != "{" else "{}").encode()
        return (self._head + json.dumps(fields)[1:]).encode()


@dataclass(slots=True)
class PrefillResult:
    upstream: Upstream
    kv_params: dict[str, Any] | None
    cached_tokens: int | None = None  # P's usage.prompt_tokens_details.cached_tokens (local + pulled), if reported
    prompt_tokens: int | None = None  # P's usage.prompt_tokens
    reuse_report: dict[str, Any] | None = None  # what P offered / verified / pulled (our connector on P)
    host_local_tokens: int | None = None  # P was asked to pull D's host tier: its own estimated hit then


class TurnProxy:
    def __init__(self, config: RouterConfig, session: aiohttp.ClientSession | None, prefill: UpstreamPool, decode: UpstreamPool,
                 store: RouterStore, hub: NotifyHub, metrics: RouterMetrics, upstream_headers: dict[str, str],
                 notify_url: Callable[[], str | None], clock: Callable[[], float] = time.monotonic,
                 client: UpstreamClient | None = None) -> None:
        self.config = config
        self.session = session  # aiohttp's: health probes and /v1/models (see app.py); not on a turn's path
        # P and D calls: the router's own HTTP/1.1 client (impl.router.upstream_http says why)
        self.client = client if client is not None else UpstreamClient(
            max_connections_per_host=config.upstream_max_connections, keepalive_s=config.upstream_keepalive_s,
            connect_timeout_s=config.connect_timeout_s)
        self.prefill = prefill
        self.decode = decode
        self.store = store
        self.hub = hub
        self.metrics = metrics
        self.upstream_headers = upstream_headers
        self.notify_url = notify_url
        self.clock = clock
        # which P last prefilled a conversation (its prefix cache likely holds it): KV-aware placement input
        self.affinity = PrefillAffinity(config.max_conversations)
        self.recorder = TurnRecorder(config, store, hub, metrics, clock)
        # give-back D's renewal before P reads (impl.router.heartbeat.HeartbeatRelay.renew_for_read; set by the app)
        self.renew_for_read: Callable[[ConversationEntry], Awaitable[tuple[str, float | None]]] | None = None
        self.tracer: TurnTracer | None = None  # --trace-out (set by the app)
        self.retention: RouterRetention | None = None  # --learnt-retention-budget-tokens (set by the app)
        self.on_d: OnDRouting | None = None  # --prefill-on-d (set by the app)
        self.host_tier: HostTierRouter | None = None  # --host-tier-capacity-tokens (set by the app)

    # ------------------------------------------------------------------------------------------
    async def handle(self, request: web.Request, turn: TurnRequest, tenant: str, t0: float) -> web.StreamResponse:
        offered, given_back, key, miss = await self._lookup(turn, tenant)
        path = _OFF if self.on_d is None or offered is not None else _NOTHING_HELD
        # a conversation D gave back may still be in D's prefix cache (impl.router.on_d: a lapsed hold)
        held = offered if offered is not None else given_back
        if self.on_d is not None and held is not None:
            path, d = self.on_d.choose(turn, held, lapsed=offered is None)
            if d is not None:  # the whole request to the D that holds the conversation (impl.router.on_d)
                served = await self._turn(request, turn, tenant, t0, offered, given_back, key, miss, path, d)
                if served is not None:
                    return served
                # D failed before its answer began: the P path serves the turn (nothing reached the client)
                path = PathDecision(TurnPath.PULL_TO_P, PathReason.D_UNAVAILABLE, path.suffix_tokens)
        return await self._turn(request, turn, tenant, t0, offered, given_back, key, miss, path, None)

    async def _turn(self, request: web.Request, turn: TurnRequest, tenant: str, t0: float,
                    offered: ConversationEntry | None, given_back: ConversationEntry | None, key: tuple[str, str] | None,
                    miss: str | None,
                    path: PathDecision, on_d: Upstream | None) -> web.StreamResponse | None:
        """One turn through P then D, or (``on_d``) through that D alone; None if ``on_d`` could not take it."""
        request_id = os.urandom(16).hex()  # as unique as uuid4().hex, without building a UUID (~4 us)
        headers = dict(self.upstream_headers)
        headers["X-Request-Id"] = request_id
        shared = _SharedBody(turn.body)
        offered_tokens = offered.num_tokens if offered is not None else 0

        # D no longer holds the turn in HBM: its host tier may (impl.router.host_tier)
        host = self.host_tier.offer(key) if self.host_tier is not None and offered is None and on_d is None else None
        try:
            prefill = (PrefillResult(on_d, on_d_params(offered)) if on_d is not None
                       else await self._prefill(turn, shared, offered, headers, key, host))
        except (UpstreamFailure, _PassThrough) as e:
            failed = e.response() if isinstance(e, UpstreamFailure) else e.response
            if self.tracer is not None:
                self.tracer.record(turn=turn, tenant=tenant, request_id=request_id, arrival=_wall(t0), status=failed.status,
                                   stored=None, offered=offered_tokens, miss=miss, prompt_tokens=None, cached_tokens=None,
                                   report=None, capture=None, prefill=None, decode=None, finished_after_s=None)
            return failed

        t = _Turn(turn, tenant, t0, request_id, prefill, on_d, path.suffix_tokens)
        payload = self._decode_payload(t, shared, key)
        info = self._turn_headers(t, offered, given_back, key)
        served = _served_path(path, on_d, offered, prefill.reuse_report)
        info["X-Bidikv-Path"], info["X-Bidikv-Path-Reason"] = served.value, path.reason.value
        self.metrics.turn_paths.inc(served.value, path.reason.value)
        if self.host_tier is not None:
            self.host_tier.account(info, offered is not None, prefill.host_local_tokens, prefill.cached_tokens)
        response: web.StreamResponse | None = None
        capture = upstream = None
        fell_back = False
        if on_d is not None:  # its suffix is D's pending work until D's first token (or the end)
            self.on_d.sent(on_d, path.suffix_tokens)
            t.answer_pending = True
        try:
            if turn.stream:
                response, capture, upstream = await self._decode_stream(request, t, payload, headers, info)
            else:
                response, capture, upstream = await self._decode_json(t, payload, headers, info)
            if not t.recorded and capture is not None and upstream is not None:
                await self._record(t, capture, upstream)  # a JSON answer goes out after this returns: stored first too
            return response
        except _DecodeUnavailable:
            fell_back = True
            self.metrics.turn_paths.inc(TurnPath.PREFILL_ON_D.value, "fallback")
            return None
        finally:
            self._answered(t)
            if t.token is not None and not t.handed_off:
                self.hub.close(request_id)
            if fell_back:
                return None  # the P path serves the turn and traces and logs it  # noqa: B012
            if self.host_tier is not None and capture is not None and upstream is not None and capture.complete:
                prompt = prefill.prompt_tokens if prefill.prompt_tokens is not None else turn.estimated_tokens
                # D's host tier took the turn in (the last sampled token has no KV yet)
                self.host_tier.turn_finished(key, t.stored_key, upstream, prompt + (capture.output_tokens or 0) - 1)
            self._log_turn(t, response, capture, upstream, info, key, offered_tokens, miss, served)

    def _decode_payload(self, t: _Turn, shared: _SharedBody, key: tuple[str, str] | None) -> bytes:
        """D's body: the client's as it was, with P's params (and the learnt hold and notification field)."""
        turn = t.turn
        d_params: dict[str, Any] = dict(t.prefill.kv_params) if t.prefill.kv_params else {}
        if self.retention is not None and t.storable and d_params:  # D keeps only what P handed it
            t.learnt = self.retention.arrived(turn, t.tenant, key)
            d_params[RETENTION_KEY] = t.learnt.hold.retention_s
        url = self.notify_url() if (t.storable and self.config.notify) else None
        if url:
            t.token = self.hub.open(t.request_id)
            d_params[NOTIFY_KEY] = notify_field(url, t.request_id, t.token)
        d_fields = dict(shared.own)  # D gets the client's body as it was, plus:
        if d_params:
            d_fields["kv_transfer_params"] = d_params
        if turn.prompt_kind == "tokens" and t.storable:
            d_fields["return_token_ids"] = True
        return shared.encode(d_fields)

    def _turn_headers(self, t: _Turn, offered: ConversationEntry | None, given_back: ConversationEntry | None,
                      key: tuple[str, str] | None) -> dict[str, str]:
        """What this turn got, for clients that measure (bidikv bench): names and counts, never KV locations."""
        info = {"X-Bidikv-Reuse-Offered-Tokens": str(offered.num_tokens if offered is not None else 0),
                "X-Bidikv-Reuse-Match": t.turn.match if offered is not None else "none"}
        if t.p_name:  # absent for a turn served on D: no P leg
            info["X-Bidikv-Prefill"] = t.p_name
        if t.prefill.cached_tokens is not None:
            info["X-Bidikv-Prefill-Cached-Tokens"] = str(t.prefill.cached_tokens)
        if given_back is not None:  # D gave this conversation's KV back under memory pressure: not pulled
            info["X-Bidikv-Reuse-Given-Back"] = "1"
        if offered is not None and t.on_d is None:
            self._account_reuse(t.prefill, info, key)
        return info

    async def _record(self, t: _Turn, capture: TurnCapture, upstream: Upstream) -> None:
        """Store a complete turn under the key its next turn looks up (before the client sees its end)."""
        t.recorded = True
        if not t.storable:
            return
        turn, tenant = t.turn, t.tenant
        if not capture.complete:  # the recorder counts why; nothing is stored under any key
            await self.recorder.finish_turn((tenant, ""), turn, capture, upstream, None)
            return
        if turn.match == "history" and capture.unreconstructable not in _KEYABLE_ANSWERS:
            # tool calls (or several choices): the message the client resends cannot be told, so no
            # key would ever find the entry
            self.metrics.turns_not_stored.inc("unreconstructable")
            return
        stored = turn.stored_id(capture.answer, capture.output_token_ids)
        if stored is None:
            self.metrics.turns_not_stored.inc("no_token_ids")
            return
        if turn.match == "history" and t.p_name:  # the next turn looks its P up under this key
            self.affinity.served((tenant, stored), t.p_name, turn.estimated_tokens)
        t.stored_key = (tenant, stored)
        if turn.anchored:  # listed before it is stored: a next turn then waits for a pending update
            directory = turn.anchor_directory(capture.answer, capture.output_token_ids)
            if directory is not None:
                await self._list_in_directory(tenant, *directory)
        t.handed_off = await self.recorder.finish_turn(t.stored_key, turn, capture, upstream,
                                                       t.request_id if t.token else None)
        if t.learnt is not None:
            prefill = t.prefill
            prompt = prefill.prompt_tokens if prefill.prompt_tokens is not None else turn.estimated_tokens
            self.retention.finished(t.learnt, tenant, t.stored_key, prompt + (capture.output_tokens or 0))

    def _answered(self, t: _Turn) -> None:
        """D began answering a turn sent to it whole (or gave up): its suffix is no longer D's pending work."""
        if t.answer_pending:
            t.answer_pending = False
            self.on_d.answered(t.on_d, t.suffix_tokens)

    def _log_turn(self, t: _Turn, response: web.StreamResponse | None, capture: TurnCapture | None,
                  upstream: Upstream | None, info: dict[str, str], key: tuple[str, str] | None, offered_tokens: int,
                  miss: str | None, served: TurnPath) -> None:
        stored_key, prefill = t.stored_key, t.prefill
        if self.tracer is not None:
            self.tracer.record(turn=t.turn, tenant=t.tenant, request_id=t.request_id, arrival=_wall(t.t0),
                               status=response.status if response is not None else 499,
                               stored=stored_key[1] if stored_key is not None else None, offered=offered_tokens,
                               miss=miss, prompt_tokens=prefill.prompt_tokens, cached_tokens=prefill.cached_tokens,
                               report=prefill.reuse_report, capture=capture, prefill=t.p_name,
                               decode=upstream.name if upstream is not None else None,
                               finished_after_s=self.clock() - t.t0, path=served.value,
                               tier=info.get("X-Bidikv-Reuse-Tier"))
        # "next": the key the turn is stored under if D's params arrive (turns_stored says whether they did)
        # "miss": why nothing was offered (the reuse_misses label; "-" on a hit)
        turn_log.info("turn %s match=%s key=%s offered=%d miss=%s P=%s path=%s next=%s", t.request_id,
                      info["X-Bidikv-Reuse-Match"], shown_id(key[1]) if key else "-", offered_tokens, miss or "-",
                      t.p_name or "-", served.value, shown_id(stored_key[1]) if stored_key else "-")

    # -- 1. lookup --------------------------------------------------------------------------------
    async def _lookup(self, turn: TurnRequest, tenant: str
                      ) -> tuple[ConversationEntry | None, ConversationEntry | None, tuple[str, str] | None, str | None]:
        """The entry to offer P (or None), the entry D gave back under pressure (or None), the key the turn was
        looked up under (the one that hit, else the first tried; None if none was) and why it missed."""
        if turn.view is None:
            return self._missed("unsupported", None)
        first = turn.store_id
        if first is None:
            return self._missed("no_history" if turn.match == "history" else "no_conversation_id", None)
        self.metrics.reuse_lookups.inc(turn.match)
        key = (tenant, first)
        await self.recorder.wait_pending(key)  # the previous turn may still await D's notification
        candidates = turn.history_candidates if turn.match == "history" else (first,)
        miss: str | None = None
        entry = None
        try:
            for cid in candidates:
                # single-use, whatever the key: P's read frees D's blocks (vLLM frees them on P's read
                # notification), so neither a regenerated turn nor the retry of a turn that failed after P
                # read may be offered them again; a retry recomputes instead of reading freed blocks
                if turn.anchored:
                    found, cid = await self._take_listed(tenant, turn, cid)
                else:
                    found = await self.store.take(tenant, cid, turn.view, self.clock())
                if found.entry is not None:
                    entry, key = found.entry, (tenant, cid)
                    break
                if miss is None:  # the most recent candidate's reason is the one that says why
                    miss = found.miss.value if found.miss else "unknown"
        except StoreUnavailable:  # Redis down: the turn is served, without reuse (the store logged it once)
            return self._missed("store_unavailable", key)
        if entry is None:
            return self._missed(miss or "unknown", key)
        if entry.kv_params.get(RENEW_BEFORE_READ_KEY) and self.renew_for_read is not None:
            # a give-back D publishes short expiries: renewed now, P gets a fresh one (impl.policy.give_back)
            outcome, expiry = await self.renew_for_read(entry)
            self.metrics.give_back_renewals.inc(outcome)
            if expiry is not None:
                entry = dataclasses.replace(entry, kv_params={**entry.kv_params, "remote_blocks_expiry_time": expiry})
            elif outcome not in _STILL_HELD:
                # only an explicit, well-formed "held" is held: any other answer (a not_held reason, one the
                # router does not know, nonsense) means the blocks may be gone, and P is not offered them
                reason = "given_back" if outcome == "given_back" else "expired" if outcome in _NOT_HELD else "not_held"
                self.metrics.reuse_misses.inc(reason)
                return None, entry if outcome == "given_back" else None, key, reason
        self.metrics.reuse_hits.inc()
        self.metrics.reuse_matches.inc(turn.match)
        self.metrics.tokens_reused.inc(amount=entry.num_tokens)
        return entry, None, key, None

    async def _take_listed(self, tenant: str, turn: TurnRequest, directory: str) -> tuple[Lookup, str]:
        """An anchored completion: take the first held sequence listed in ``directory`` that this prompt
        continues (its exact key, computed from the prompt), the most recently listed first."""
        got = await self.store.get(tenant, directory)
        lengths = anchor_lengths(got.entry.kv_params, len(turn.body["prompt"])) if got is not None else []
        found = _NOT_LISTED
        for cid in turn.exact_ids(lengths):
            await self.recorder.wait_pending((tenant, cid))
            taken = await self.store.take(tenant, cid, turn.view, self.clock())
            if taken.entry is not None:
                return taken, cid
            if found is _NOT_LISTED:
                found = taken
        return found, directory

    async def _list_in_directory(self, tenant: str, directory: str, length: int) -> None:
        """Add a held length to its anchor's directory (kept as long as D could keep any turn)."""
        now = self.clock()
        try:
            got = await self.store.get(tenant, directory)
            old = got.entry if got is not None else None
            expires = max(now + self.config.decoder_kv_blocks_ttl, old.expires_at if old is not None else now)
            params = add_anchor_length(old.kv_params if old is not None else None, length)
            await self.store.record_success(tenant, directory, ConversationEntry("", params, expires, 0, 0, None, now), now)
        except StoreUnavailable:
            pass  # the next turn is not found by this anchor: it recomputes

    def _missed(self, reason: str, key: tuple[str, str] | None
                ) -> tuple[None, None, tuple[str, str] | None, str]:
        self.metrics.reuse_misses.inc(reason)
        return None, None, key, reason

    # -- 2. prefill -------------------------------------------------------------------------------
    async def _prefill(self, turn: TurnRequest, shared: _SharedBody, offered: ConversationEntry | None,
                       headers: dict[str, str], key: tuple[str, str] | None, host: HostOffer | None = None) -> PrefillResult:
        return await self._retrying(_PrefillLeg(self, turn, shared, offered, headers, key, host))

    def _account_reuse(self, prefill: PrefillResult, info: dict[str, str], key: tuple[str, str] | None) -> None:
        """P's report of an offered turn: counted, logged when P refused part of it, and in the headers."""
        report = prefill.reuse_report
        counts = {}
        if isinstance(report, dict):
            for name in ("offered", "verified", "pulled"):
                value = report.get(name)
                if type(value) is int and value >= 0:
                    counts[name] = value
        reason = report.get("reason") if isinstance(report, dict) else None
        reason = reason if isinstance(reason, str) and reason.isidentifier() and len(reason) <= 32 else "none"
        self.metrics.p_verify_results.inc(reason)
        for name, value in counts.items():
            self.metrics.p_verified_tokens.inc(name, amount=value)
            info[f"X-Bidikv-Reuse-{name.capitalize()}-Tokens"] = str(value)
        info["X-Bidikv-Reuse-Verify"] = reason
        if counts.get("verified", 0) < counts.get("offered", 0):
            log.info("conversation %s: P verified %d of %d offered tokens (%s), pulled %d",
                     shown_id(key[1]) if key else "-", counts.get("verified", 0), counts["offered"], reason,
                     counts.get("pulled", 0))

    async def _retrying(self, leg: _Leg) -> Any:
        """Send ``leg`` (P's or D's request) to one instance after another until one answers it.

        An instance that cannot be reached, drops the connection or times out before answering is left
        for the next (a keep-alive connection it had closed: the same one again, up to ``STALE_RETRIES``
        times); its 4xx (408 aside) is the client's own error, passed on; any other status is the
        instance's failure, and the leg may retry it differently (:meth:`_Leg.rejected`). Raises the
        last failure (UpstreamFailure) when no instance is left, or _PassThrough."""
        while True:
            upstream = leg.pick()
            if upstream is None:
                raise leg.failure
            leg.tried.add(upstream.name)
            try:
                status, answer = await leg.send(upstream)
            except UpstreamError as e:
                leg.failure, retry_same = self._connection_failure(leg.role, leg.pool, upstream, e, leg.stale_retries)
                if retry_same:
                    leg.stale_retries -= 1
                    leg.tried.discard(upstream.name)
                continue
            if status == 200:
                result = leg.answered(upstream, answer)
                if result is not None:
                    return result
                continue
            if 400 <= status < 500 and status != 408:
                raise _PassThrough(_passthrough_error(status, answer, leg.sent_params()))
            self.metrics.upstream_errors.inc(upstream.name, leg.role, f"http_{status}")
            leg.failure = UpstreamFailure(502, f"{leg.role} failed with HTTP {status}")
            leg.rejected(upstream)

    def _connection_failure(self, role: str, pool: UpstreamPool, upstream: Upstream, exc: BaseException,
                            stale_retries: int) -> tuple[UpstreamFailure, bool]:
        """Classify a failed request to ``upstream`` before any answer: the failure to report if no
        other instance serves, and whether to retry the same instance (a keep-alive connection the
        server had already closed, up to ``STALE_RETRIES`` times)."""
        when = " before answering" if role == "decode" else ""  # D's answer is streamed: say it had not begun
        if isinstance(exc, UpstreamConnectError):
            self.metrics.upstream_errors.inc(upstream.name, role, "unreachable")
            pool.mark_down(upstream, type(exc).__name__)
            return UpstreamFailure(503, f"no {role} instance is reachable"), False
        if isinstance(exc, UpstreamDisconnected) and not exc.response_started:
            self.metrics.upstream_errors.inc(upstream.name, role, "disconnected")
            if not stale_retries:
                pool.mark_down(upstream, type(exc).__name__)
            return UpstreamFailure(502, f"{role} instance disconnected{when}"), bool(stale_retries)
        if isinstance(exc, TimeoutError):  # UpstreamTimeout: connecting, or P's whole exchange
            self.metrics.upstream_errors.inc(upstream.name, role, "timeout")
            return UpstreamFailure(504, f"{role} timed out{when}"), False
        # malformed, oversized, or cut after the response had begun
        self.metrics.upstream_errors.inc(upstream.name, role, "protocol")
        return UpstreamFailure(502, f"{role} failed ({type(exc).__name__})"), False

    # -- 3./4. decode -----------------------------------------------------------------------------
    async def _open_decode(self, turn: TurnRequest, payload: bytes, headers: dict[str, str],
                           only: Upstream | None = None) -> tuple[UpstreamResponse, Upstream]:
        """A 200 response from some D (caller must release it), or UpstreamFailure / _PassThrough. With
        ``only``, that D or _DecodeUnavailable (the caller serves the turn another way)."""
        return await self._retrying(_DecodeLeg(self, turn, payload, headers, only))

    async def _decode_json(self, t: _Turn, payload: bytes, headers: dict[str, str], info: dict[str, str],
                           ) -> tuple[web.StreamResponse, TurnCapture | None, Upstream | None]:
        turn = t.turn
        try:
            resp, upstream = await self._open_decode(turn, payload, headers, t.on_d)
        except UpstreamFailure as e:
            return e.response(), None, None
        except _PassThrough as e:
            return e.response, None, None
        try:
            raw = await resp.read()
        except UpstreamError as e:
            kind = "timeout" if isinstance(e, TimeoutError) else "cut"
            self.metrics.upstream_errors.inc(upstream.name, "decode", kind)
            return error_response(502, "decode failed while answering", "upstream_error"), None, None
        finally:
            resp.release()
        capture = TurnCapture(chat=turn.endpoint == "chat")
        capture.first_token_s = self.clock() - t.t0  # a whole answer: its first token arrives with its last
        try:
            obj = json.loads(raw)
        except ValueError:
            self.metrics.upstream_errors.inc(upstream.name, "decode", "bad_body")
            return error_response(502, "decode returned an unreadable body", "upstream_error"), None, None
        obj = capture.on_body(obj)
        body = json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")
        return web.Response(body=body, headers={**_JSON_HEADERS, **info, "X-Bidikv-Decode": upstream.name}), capture, upstream

    async def _decode_stream(self, request: web.Request, t: _Turn, payload: bytes, headers: dict[str, str],
                             info: dict[str, str]) -> tuple[web.StreamResponse, TurnCapture | None, Upstream | None]:
        turn = t.turn
        try:
            resp, upstream = await self._open_decode(turn, payload, headers, t.on_d)
        except UpstreamFailure as e:
            return e.response(), None, None
        except _PassThrough as e:
            return e.response, None, None
        capture = TurnCapture(chat=turn.endpoint == "chat")
        out = _EventStreamResponse(coalesce_headers=resp.body_buffered, status=200,
                                   headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                            "X-Request-Id": headers["X-Request-Id"], **info,
                                            "X-Bidikv-Decode": upstream.name})
        failure: str | None = None
        first_token_seen = False
        # Headers go out with the first events when D sent them with its head (else at once, as before).
        # The events of D's last read, when its body ended there too: sent together with the end of our
        # chunked body in one write (vLLM's last read is "data: [DONE]" and the terminator). Held back
        # only once D's body is complete, so no event ever waits for a later one.
        final = b""
        try:
            await out.prepare(request)
            splitter = SSESplitter()
            try:
                async for chunk in resp:  # whatever of D's body has arrived
                    events = splitter.feed(chunk)
                    if not events:
                        continue
                    parts = []
                    for ev in events:
                        if ev.data is None:
                            parts.append(ev.raw)  # keep-alive comments reach the client as they came
                            continue
                        replacement = capture.on_event(ev.data)
                        parts.append(ev.raw if replacement is None else format_event(replacement))
                    if not first_token_seen and capture.events:
                        first_token_seen = True
                        capture.first_token_s = self.clock() - t.t0
                        self.metrics.ttft.observe(capture.first_token_s)
                        self._answered(t)
                    data = b"".join(parts) if len(parts) > 1 else parts[0]
                    if resp.complete:
                        final = data  # the loop ends here: goes out with write_eof below
                    else:
                        await out.write(data)
                for ev in splitter.flush():
                    if ev.data is not None:
                        replacement = capture.on_event(ev.data)
                        final += ev.raw if replacement is None else format_event(replacement)
                if splitter.take_incomplete():
                    failure = "cut"
            except SSEError:
                failure = "oversized_event"
            except TimeoutError:  # UpstreamTimeout: D silent for decode_idle_timeout_s
                failure = "timeout"
            except UpstreamError:  # closed, reset or malformed chunk framing mid-stream
                failure = "cut"
            if failure is None and not capture.done:
                failure = "no_done"
            if failure is not None:
                self.metrics.upstream_errors.inc(upstream.name, "decode", failure)
                self.metrics.stream_errors.inc(failure)
                message = {"cut": "decode instance failed mid-stream", "timeout": "decode instance stalled",
                           "no_done": "decode stream ended without [DONE]",
                           "oversized_event": "decode instance sent an oversized event"}[failure]
                final += format_event(error_body(message, "upstream_error", 502)) + format_event(b"[DONE]")
            capture.finish()  # decode what was forwarded raw
            if failure is None:
                # stored before the client can see [DONE]: a client that sends its next turn at once
                # must find this one (stored after write_eof, a loaded router could resume this handler
                # only after that next turn's lookup)
                await self._record(t, capture, upstream)
            await out.write_eof(final)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            self.metrics.stream_errors.inc("client_gone")
            return out, None, None  # the client left: D's request is aborted by closing it, nothing stored
        finally:
            if failure is None and capture.done:
                resp.release()  # fully read: the connection goes back to the pool
            else:
                resp.close()  # unfinished: dropping the connection makes vLLM abort the request
        return out, (capture if failure is None else None), upstream

    async def close(self) -> None:
        await self.recorder.close()
        await self.client.close()


@dataclass(slots=True, eq=False)
class _Turn:
    """One turn's facts and outcome, shared by the steps of :meth:`TurnProxy._turn`."""

    turn: TurnRequest
    tenant: str
    t0: float
    request_id: str
    prefill: PrefillResult
    on_d: Upstream | None  # the D the whole turn went to (prefill on D), else None
    suffix_tokens: int  # the suffix D computes when ``on_d``
    learnt: Any = None  # the learnt hold D was sent (impl.router.retention), if any
    token: str | None = None  # the notification token D was sent, if any
    answer_pending: bool = False  # the turn's suffix counts as D's pending work until D answers
    recorded: bool = False  # the turn reached the recorder (or was found not storable)
    handed_off: bool = False  # the recorder took over the notification token
    stored_key: tuple[str, str] | None = None
    storable: bool = dataclasses.field(init=False)
    p_name: str | None = dataclasses.field(init=False)  # None for a turn served on D: no P leg

    def __post_init__(self) -> None:
        self.storable = self.turn.match != "none" and self.turn.view is not None
        self.p_name = self.prefill.upstream.name if self.on_d is None else None


class _Leg:
    """One request (P's or D's) as :meth:`TurnProxy._retrying` sends it: the instances tried, the
    stale-connection retries left and the failure to report if no instance answers."""

    __slots__ = ("proxy", "role", "pool", "turn", "headers", "tried", "stale_retries", "failure")

    def __init__(self, proxy: TurnProxy, role: str, pool: UpstreamPool, turn: TurnRequest,
                 headers: dict[str, str]) -> None:
        self.proxy = proxy
        self.role = role
        self.pool = pool
        self.turn = turn
        self.headers = headers
        self.tried: set[str] = set()
        self.stale_retries = STALE_RETRIES
        self.failure = UpstreamFailure(503, f"no {role} instance is available")

    def pick(self) -> Upstream | None:
        """The next instance to send to (None: none is left)."""
        raise NotImplementedError

    async def send(self, upstream: Upstream) -> tuple[int, Any]:
        """The status and what ``answered`` takes (200) or the error body (else); UpstreamError before
        any answer."""
        raise NotImplementedError

    def answered(self, upstream: Upstream, answer: Any) -> Any:
        """The leg's result from a 200 answer, or None (``failure`` set) to try the next instance."""
        raise NotImplementedError

    def sent_params(self) -> Any:
        """The kv_transfer_params sent (an error quoting them is not passed on)."""
        raise NotImplementedError

    def rejected(self, upstream: Upstream) -> None:
        """``upstream`` answered with a server error."""


class _PrefillLeg(_Leg):
    """P's request: ``max_tokens=1`` with D's params when reuse is offered; a P's server error after an
    offer is retried on the same P without it (a failed pull under ``kv_load_failure_policy: "fail"``
    must not fail the turn). Without an offer, D's host tier may be named (``remote_kv_source``), and a
    server error with it is retried on the same P without it too."""

    __slots__ = ("shared", "offered", "key", "body", "reuse", "params", "cached", "host", "host_local")

    def __init__(self, proxy: TurnProxy, turn: TurnRequest, shared: _SharedBody, offered: ConversationEntry | None,
                 headers: dict[str, str], key: tuple[str, str] | None, host: HostOffer | None = None) -> None:
        super().__init__(proxy, "prefill", proxy.prefill, turn, headers)
        self.shared = shared
        self.offered = offered
        self.key = key
        body = {k: v for k, v in shared.own.items() if k not in _PREFILL_DROP}  # P's own fields; the rest is shared
        body["stream"] = False
        body["max_tokens"] = 1
        self.body = body
        self.reuse = offered is not None
        self.params: dict[str, Any] = {}
        self.cached = proxy.affinity.cached_tokens(key) if key is not None else {}
        self.host = host
        self.host_local: int | None = None  # P's own estimated hit, when asked to pull D's host tier

    def pick(self) -> Upstream | None:
        if self.reuse:
            params = dict(self.offered.kv_params)  # type: ignore[union-attr]
            params["do_remote_decode"] = True
            params["do_remote_prefill"] = False
        else:
            params = dict(FRESH_TURN_PARAMS)
        self.params = self.body["kv_transfer_params"] = params
        upstream = self.pool.pick(self.turn.estimated_tokens, self.tried,
                                  self.offered.num_tokens if self.reuse else 0, self.cached)  # type: ignore[union-attr]
        self.host_local = None
        if upstream is not None and self.host is not None and not self.reuse:
            # this attempt's id: the P2P tier refuses a second fetch under one kv_request_id on a session
            source = self.proxy.host_tier.ask(self.host, f"{self.headers['X-Request-Id']}-{len(self.tried) + 1}")
            if source is None:
                self.host = None
            else:
                params[REMOTE_KV_SOURCE] = source
                self.host_local = self.cached.get(upstream.name, 0)
        return upstream

    async def send(self, upstream: Upstream) -> tuple[int, bytes]:
        tokens = self.turn.estimated_tokens
        payload = self.shared.encode(self.body)
        upstream.in_flight += 1
        upstream.in_flight_tokens += tokens
        try:
            resp = await self.proxy.client.request("POST", upstream.url_for(self.turn.endpoint), payload, self.headers,
                                                   timeout=self.proxy.config.prefill_timeout_s)
            try:
                return resp.status, await resp.read()
            finally:
                resp.release()
        finally:
            upstream.in_flight -= 1
            upstream.in_flight_tokens -= tokens

    def answered(self, upstream: Upstream, answer: bytes) -> PrefillResult | None:
        """P's params for D (P's prefix cache now holds the conversation), or None for an unreadable body."""
        try:
            obj = json.loads(answer)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            self.proxy.metrics.upstream_errors.inc(upstream.name, "prefill", "bad_body")
            self.failure = UpstreamFailure(502, "prefill returned an unreadable body")
            return None
        kv = obj.get("kv_transfer_params")
        report = None
        if not isinstance(kv, dict) or not kv:
            kv = None  # P without a KV connector: D computes the prompt itself
        else:
            kv = dict(kv)
            report = kv.pop(REPORT_KEY, None)  # for the router, not for D
            if self.proxy.config.rewrite_remote_host:
                kv["remote_host"] = upstream.host
        if self.key is not None:
            self.proxy.affinity.served(self.key, upstream.name, self.turn.estimated_tokens)
        return PrefillResult(upstream, kv, cached_tokens=_cached_tokens(obj),
                             reuse_report=report if self.reuse else None, prompt_tokens=_prompt_tokens(obj),
                             host_local_tokens=self.host_local)

    def sent_params(self) -> dict[str, Any]:
        return self.params

    def rejected(self, upstream: Upstream) -> None:
        if self.reuse:
            # maybe the pull failed (kv_load_failure_policy "fail"): same instance, no reuse
            self.reuse = False
            self.tried.discard(upstream.name)
            self.proxy.metrics.reuse_misses.inc("prefill_error")
        elif self.host_local is not None:  # the same for a host-tier pull: same instance, without it
            self.host = None
            self.tried.discard(upstream.name)
            self.proxy.host_tier.prefill_failed()


class _DecodeLeg(_Leg):
    """D's request, streamed: the open 200 response is the result; with ``only``, that D alone, and
    _DecodeUnavailable once it failed (the turn is then served another way)."""

    __slots__ = ("payload", "only")

    def __init__(self, proxy: TurnProxy, turn: TurnRequest, payload: bytes, headers: dict[str, str],
                 only: Upstream | None) -> None:
        super().__init__(proxy, "decode", proxy.decode, turn, headers)
        self.payload = payload
        self.only = only

    def pick(self) -> Upstream | None:
        if self.only is not None:
            if self.only.name in self.tried:
                raise _DecodeUnavailable(self.failure.message)
            return self.only
        return self.pool.pick(self.turn.estimated_tokens, self.tried)

    async def send(self, upstream: Upstream) -> tuple[int, Any]:
        resp = await self.proxy.client.request("POST", upstream.url_for(self.turn.endpoint), self.payload, self.headers,
                                               idle_timeout=self.proxy.config.decode_idle_timeout_s)
        if resp.status == 200:
            return 200, resp
        try:
            raw = await resp.read()
        except UpstreamError:
            raw = b""
        finally:
            resp.release()
        return resp.status, raw

    def answered(self, upstream: Upstream, answer: UpstreamResponse) -> tuple[UpstreamResponse, Upstream]:
        return answer, upstream

    def sent_params(self) -> Any:
        return _sent_params(self.payload)
class _EventStreamResponse(web.StreamResponse):
    """aiohttp's StreamResponse whose headers may wait for the first body write and go out with it
    (as aiohttp does for web.Response): one send and one wake-up of the client instead of two.
    Used only when D's first bytes are already here, so the client never waits longer for headers."""

    def __init__(self, *, coalesce_headers: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if coalesce_headers:
            # aiohttp's own switch (web.Response turns it off); an aiohttp without it ignores this
            self._send_headers_immediately = False


class _DecodeUnavailable(Exception):
    """The one D a turn was sent to could not take it before answering (prefill on D falls back to P)."""


_OFF = PathDecision(TurnPath.RECOMPUTE_ON_P, PathReason.OFF, 0)
_NOTHING_HELD = PathDecision(TurnPath.RECOMPUTE_ON_P, PathReason.NOTHING_HELD, 0)  # --prefill-on-d, no entry


def _served_path(decision: PathDecision, on_d: Upstream | None, offered: ConversationEntry | None,
                 report: dict[str, Any] | None) -> TurnPath:
    """Which of the three the turn got: on D, or through P pulling (what P's report says it pulled, or, from
    a P that sends no report, that it was offered D's blocks) or recomputing."""
    if on_d is not None:
        return TurnPath.PREFILL_ON_D
    if offered is None:
        return TurnPath.RECOMPUTE_ON_P
    pulled = report.get("pulled") if isinstance(report, dict) else None
    if type(pulled) is int:
        return TurnPath.PULL_TO_P if pulled > 0 else TurnPath.RECOMPUTE_ON_P
    return TurnPath.PULL_TO_P


class _PassThrough(Exception):
    """An upstream 4xx that is the client's own error: answered as the upstream gave it."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


def _passthrough_error(status: int, raw: bytes, sent: Any = None) -> web.Response:
    """P's or D's 4xx for the client: as it came, unless it quotes any of the turn's secrets (the KV
    locations and the notification URL and token the router sent that upstream: stripping by key cannot
    see them inside a message string); then only its error type, with a message of ours."""
    try:
        obj = json.loads(raw)
    except ValueError:
        obj = None
    if isinstance(obj, dict) and len(raw) <= 64 * 1024 and not _quotes_secrets(raw, sent):
        return web.Response(status=status, body=raw, headers=_JSON_HEADERS)
    kind = "invalid_request_error"
    error = obj.get("error") if isinstance(obj, dict) else None
    named = (error.get("type") if isinstance(error, dict) else obj.get("type")) if isinstance(obj, dict) else None
    if isinstance(named, str) and named.isidentifier() and len(named) <= 64:
        kind = named
    return error_response(status, f"upstream rejected the request (HTTP {status})", kind)


def _sent_params(payload: bytes) -> Any:
    """The kv_transfer_params of a body the router sent (parsed only on an upstream's error)."""
    try:
        body = json.loads(payload)
    except ValueError:
        return None
    return body.get("kv_transfer_params") if isinstance(body, dict) else None


_MIN_SECRET_CHARS = 6  # shorter strings (true, null, a small port) would match ordinary text


def _quotes_secrets(raw: bytes, sent: Any) -> bool:
    """Whether ``raw`` contains a string value of ``sent`` (at any depth), a host:port pair of it, or a
    list of its block ids as JSON or Python writes it."""
    if not isinstance(sent, dict) or not sent:
        return False
    text = raw.decode("utf-8", "replace")
    needles: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            if value and all(isinstance(v, int) for v in value):
                needles.extend((json.dumps(value), json.dumps(value, separators=(",", ":"))))
            for v in value:
                walk(v)
        elif isinstance(value, str) and len(value) >= _MIN_SECRET_CHARS:
            needles.append(value)

    walk(sent)
    host, port = sent.get("remote_host"), sent.get("remote_port")
    if isinstance(host, str) and host and port is not None:
        needles.append(f"{host}:{port}")
    return any(n in text for n in needles)


def _prompt_tokens(body: dict[str, Any]) -> int | None:
    usage = body.get("usage")
    value = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return value if type(value) is int and value >= 0 else None


def _wall(t0: float) -> float:
    """The wall-clock time of the monotonic instant ``t0`` (the trace's arrival times)."""
    return time.time() - (time.monotonic() - t0)


def _cached_tokens(body: dict[str, Any]) -> int | None:
    usage = body.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
