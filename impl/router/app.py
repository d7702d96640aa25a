"""The aiohttp application: routes, authentication, error mapping, lifecycle.

HTTP stack, chosen by benchmarks/router_overhead.py against the router's overhead budget (<= 0.6 ms of router
CPU per turn, <= 1 ms added p99 TTFT at c=1, no collapse at 500 concurrent clients). Clients are
served by aiohttp (C parser; vLLM's example proxy on FastAPI + httpx spends 2.9-3.2 ms per request,
and at c=500 httpcore's pool scans queued requests x connections on every event). P and D are called
through impl.router.upstream_http, the router's own keep-alive HTTP/1.1 client: aiohttp's client
costs ~136 us a call and a turn makes two (a bare asyncio exchange: ~49 us). aiohttp's ClientSession
still serves the health probes and /v1/models, off a turn's path. What the router costs per turn, and
the command that measures it: docs/results/router.md. Startup objects are frozen out of the GC (``serve``).

Routes::

    POST /v1/completions, /v1/chat/completions   tenant API key (Bearer), see impl.router.tenants
    GET  /v1/models                               tenant API key; answered by a healthy instance
    GET  /health                                  open; 503 unless >= 1 healthy P and D
    GET  /metrics                                 Bearer $BIDIKV_METRICS_TOKEN if set; else open without API
                                                  keys, refused (403) with them unless open_metrics
    POST /internal/kv_params                      per-request token of impl.router.notify
    POST /v1/conversations/{id}/heartbeat         tenant API key; relayed to D's lease, see impl.router.heartbeat

Clients never see a stack trace: validation errors are 400s naming the field, anything unexpected
is logged here and answered with a bare 500.

vLLM settings the router relies on (P and D run NixlConnector with ``bidirectional_kv_xfer: true``):
P with ``kv_load_failure_policy: "recompute"`` (a declined or failed pull then falls back to local
compute instead of failing the turn), D's ``decoder_kv_blocks_ttl`` equal to the router's
``decoder_kv_blocks_ttl``, and ``VLLM_NIXL_SIDE_CHANNEL_HOST`` reachable under the instance's HTTP
host unless ``rewrite_remote_host`` is turned off.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import os
import random
import signal
import socket
import time
from typing import Awaitable, Callable, Mapping

import aiohttp
from aiohttp import web

from impl.router.config import RouterConfig, url_host
from impl.router.connections import (BodyBudgetFull, BodyTimeout, ByteBudget, ClientConnections, GuardedTCPSite,
                                     raise_fd_limit)
from impl.router.heartbeat import HEARTBEAT_ROUTE, HeartbeatRelay
from impl.router.host_tier import HostTierRouter
from impl.router.metrics import RouterMetrics
from impl.router.on_d import OnDRouting
from impl.router.notify import MAX_NOTIFY_BODY_BYTES, Delivery, NotifyError, NotifyHub, parse_notification
from impl.router.proxy import TurnProxy, body_too_large_response, error_response, unauthenticated_response
from impl.router.request import (Endpoint, RequestError, check_context_budget, client_cache_salt, parse_json_body,
                                 parse_turn, refuse_nested_kv_params)
from impl.router.store_open import open_store
from impl.router.stores import MemoryStore, StoreUnavailable
from impl.router.scrub import scrub_body
from impl.router.tenants import Tenants, cache_salt_for
from impl.policy.return_time import LearntRetentionSettings
from impl.router.retention import RouterRetention
from impl.router.trace_writer import TraceLineage, TraceWriter, TurnTracer
from impl.router.upstreams import HealthProber, UpstreamPool, make_placement

# notification bodies being read at once, before their token is checked: 16 at the endpoint's limit
NOTIFY_BYTES_IN_FLIGHT = 16 * MAX_NOTIFY_BODY_BYTES

log = logging.getLogger("bidikv.router")

NOTIFY_PATH = "/internal/kv_params"
ROUTER_KEY: web.AppKey["Router"] = web.AppKey("bidikv_router")


class Router:
    """Everything one router process holds; the aiohttp handlers are its methods."""

    def __init__(self, config: RouterConfig, tenants: Tenants, environ: Mapping[str, str]) -> None:
        config.require_upstreams()
        self.config = config
        self.tenants = tenants
        self.metrics_token = environ.get(config.metrics_token_env) or None
        upstream_key = environ.get(config.upstream_api_key_env)
        self.upstream_headers = {"Content-Type": "application/json"}
        if upstream_key:
            self.upstream_headers["Authorization"] = f"Bearer {upstream_key}"
        self.metrics = RouterMetrics()
        self.conversations = open_store(config, environ)  # in this process, or Redis shared by replicas
        # the in-process store itself, for admin views and tests (None when the store is shared)
        self.store = self.conversations.store if isinstance(self.conversations, MemoryStore) else None
        self.hub = NotifyHub()
        self.model_limits: dict[str, int] = {}  # model id -> max_model_len, learnt (config.max_model_len: 0)
        self._limits_task: asyncio.Task | None = None
        # what clients see in X-Bidikv-Prefill/-Decode instead of internal URLs (unless expose_upstream_urls)
        self.public_names = {url: f"{role}-{i}" for role, urls in (("prefill", config.prefill), ("decode", config.decode))
                             for i, url in enumerate(urls)}
        # notification bodies being read at once (before their token is checked): 16 at the endpoint's limit
        self.notify_bytes = ByteBudget(NOTIFY_BYTES_IN_FLIGHT)
        self.connections = ClientConnections(config.client_header_timeout_s, config.client_body_timeout_s,
                                             config.client_idle_timeout_s, config.max_client_connections,
                                             on_close=self.metrics.client_closed.inc,
                                             write_timeout_s=config.client_write_timeout_s)
        self.metrics.client_connections.read = lambda: {(): float(len(self.connections.live))}
        self.heartbeats = HeartbeatRelay(config, tenants, self.conversations, self.metrics)
        self.heartbeats.connections = self.connections
        rng = random.Random(config.seed)
        self.prefill = UpstreamPool("prefill", config.prefill, make_placement(config.placement), rng)
        self.decode = UpstreamPool("decode", config.decode, make_placement(config.placement), rng)
        self.notify_url: str | None = config.notify_url
        self.session: aiohttp.ClientSession | None = None
        self.prober: HealthProber | None = None
        self.proxy: TurnProxy | None = None
        self.trace: TraceWriter | None = None
        self.lineage: TraceLineage | None = None
        if config.trace_out:
            salt_text = environ.get(config.trace_salt_env)
            if not salt_text:
                log.warning("trace: $%s is not set: a random salt for this process (its files cannot be joined "
                            "with other replicas' or a restart's)", config.trace_salt_env)
            salt = salt_text.encode() if salt_text else os.urandom(32)
            self.trace = TraceWriter(config.trace_out, salt, sample_rate=config.trace_sample_rate,
                                     max_file_bytes=config.trace_max_file_bytes, rotate_s=config.trace_rotate_s,
                                     max_files=config.trace_max_files, router_name=f"{socket.gethostname()}:{config.port}")
            self.lineage = TraceLineage(salt, config.max_conversations)
            trace = self.trace
            self.metrics.trace_lines.read = lambda: {("written",): float(trace.written),
                                                     ("dropped_queue_full",): float(trace.dropped_full),
                                                     ("dropped_write_error",): float(trace.dropped_error)}
        m = self.metrics
        m.store_entries.read = lambda: {(): float(len(self.conversations))}
        m.store_bytes.read = lambda: {(): float(self.store.bytes if self.store is not None else 0)}
        m.store_evictions.read = lambda: {(): float(self.conversations.evictions)}  # Redis: this replica's evictions
        m.upstream_healthy.read = lambda: {(u.name, u.role): float(u.healthy) for p in (self.prefill, self.decode) for u in p}
        m.upstream_in_flight.read = lambda: {(u.name, u.role): float(u.in_flight) for p in (self.prefill, self.decode) for u in p}

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        claim = getattr(self.conversations, "claim_tenancy", None)  # a store shared by replicas
        if claim is not None:
            try:
                await claim("open" if self.tenants.open else "keyed", self.tenants.key_map())
            except StoreUnavailable:
                log.warning("conversation store unreachable at start-up: this replica's tenancy (API keys or none) "
                            "is not checked against the fleet's")
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=self.config.upstream_max_connections,
                                         keepalive_timeout=self.config.upstream_keepalive_s, ttl_dns_cache=300)
        # no cookies, no automatic headers, no decompression (vLLM never compresses): each is measurable
        # per-request work in aiohttp's client (194 -> 136 us per P call on this machine)
        self.session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                             cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
                                             skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"))
        self.proxy = TurnProxy(self.config, self.session, self.prefill, self.decode, self.conversations, self.hub, self.metrics,
                               self.upstream_headers, lambda: self.notify_url)
        self.proxy.renew_for_read = self.heartbeats.renew_for_read
        if self.config.prefill_on_d != "off":
            self.proxy.on_d = OnDRouting(self.config.prefill_on_d_policy(), self.prefill, self.decode, self.proxy.clock)
        if self.trace is not None:
            self.proxy.tracer = TurnTracer(self.trace, self.lineage, self.metrics, self.public_names)
        if self.config.learnt_retention_budget_tokens > 0:
            c = self.config
            self.proxy.retention = RouterRetention(
                LearntRetentionSettings(budget_size=c.learnt_retention_budget_tokens, fallback_s=c.learnt_retention_fallback_s,
                                        margin_s=c.expiry_margin_s, max_open=c.max_conversations,
                                        min_returns=c.learnt_retention_min_returns),
                self.metrics, self.proxy.clock, c.max_conversations, c.decoder_kv_blocks_ttl)
        if self.config.host_tier_capacity_tokens > 0:
            c = self.config
            self.proxy.host_tier = HostTierRouter(c.host_tier_capacity_tokens, c.host_tier_p2p_port,
                                                  c.min_cached_token_delta, c.max_conversations, self.metrics)
        self.prober = HealthProber((self.prefill, self.decode), self.session, self.config.health_interval_s,
                                   self.config.health_timeout_s, self.config.health_failures_to_down)
        self.prober.start()
        await self.heartbeats.start()
        if not self.config.max_model_len:
            self._limits_task = asyncio.get_running_loop().create_task(self._learn_model_limits())

    def context_limit(self, model: object) -> int:
        """The context length a request for ``model`` must fit in; 0 while unknown (vLLM then checks)."""
        if self.config.max_model_len:
            return self.config.max_model_len
        limits = self.model_limits
        if not limits:
            return 0
        known = limits.get(model) if isinstance(model, str) else None
        return known if known is not None else min(limits.values())  # an unknown name: vLLM will refuse it anyway

    async def _learn_model_limits(self) -> None:
        """Each model's max_model_len from an instance's /v1/models, retried until one answers (an
        answer without the field -- not vLLM -- ends it too: vLLM's own check is all there is then)."""
        while True:
            for upstream in [u for pool in (self.decode, self.prefill) for u in pool if u.healthy]:
                try:
                    async with self.session.get(upstream.base_url + "/v1/models", headers=self.upstream_headers,
                                                timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s)) as resp:
                        listing = await resp.json(content_type=None) if resp.status == 200 else None
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    continue
                models = listing.get("data") if isinstance(listing, dict) else None
                if not isinstance(models, list):
                    continue
                for model in models:
                    if isinstance(model, dict) and isinstance(model.get("id"), str) \
                            and type(model.get("max_model_len")) is int and model["max_model_len"] > 0:
                        self.model_limits[model["id"]] = model["max_model_len"]
                if self.model_limits:
                    log.info("context limits from %s: %s", upstream.name, self.model_limits)
                else:
                    log.info("%s reports no max_model_len: context limits are left to the instances", upstream.name)
                return
            await asyncio.sleep(self.config.health_interval_s)

    async def stop(self) -> None:
        if self._limits_task is not None:
            self._limits_task.cancel()
        await self.heartbeats.stop()
        if self.prober is not None:
            await self.prober.stop()
        if self.proxy is not None:
            await self.proxy.close()
        if self.session is not None:
            await self.session.close()
        await self.conversations.close()
        if self.trace is not None:
            self.trace.close()

    async def name_upstreams(self, request: web.Request, response: web.StreamResponse) -> None:
        """Internal URLs out of the turn's headers: the proxy names instances by URL, clients get names."""
        headers = response.headers
        for header in ("X-Bidikv-Prefill", "X-Bidikv-Decode"):
            url = headers.get(header)
            if url is not None:
                headers[header] = self.public_names.get(url, "unknown")

    def set_bound_port(self, host: str, port: int) -> None:
        """Derive the notify URL once the listening port is known (unless configured)."""
        if self.config.notify_url:
            return
        if host in ("", "0.0.0.0", "::"):
            host = socket.gethostname()
        self.notify_url = f"http://{url_host(host)}:{port}{NOTIFY_PATH}"

    # -- handlers ---------------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, "chat", "/v1/chat/completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, "completion", "/v1/completions")

    async def _turn(self, request: web.Request, endpoint: Endpoint, route: str) -> web.StreamResponse:
        t0 = time.monotonic()
        try:
            tenant = self.tenants.tenant_for(request.headers.get("Authorization"))
            if tenant is None:
                response = unauthenticated_response()
            else:
                raw = await self.connections.read_body(request)
                body = parse_json_body(raw)
                refuse_nested_kv_params(body, raw)
                turn = parse_turn(endpoint, body, request.headers.get("X-Conversation-Id"), self.config.max_conversation_id_len,
                                  header_session_id=request.headers.get("X-Session-ID"),
                                  history_lookups=self.config.history_lookups)
                limit = self.context_limit(turn.body.get("model"))
                if limit:
                    check_context_budget(turn, limit)
                if self.config.tenant_cache_salt and not self.tenants.open:
                    turn.body["cache_salt"] = cache_salt_for(tenant, client_cache_salt(turn.body))
                response = await self.proxy.handle(request, turn, tenant, t0)
        except RequestError as e:
            response = error_response(e.status, e.message, "invalid_request_error", e.field)
        except web.HTTPRequestEntityTooLarge:
            response = body_too_large_response(self.config.max_body_bytes)
        except BodyTimeout:
            response = self.connections.body_timeout_response()
        except ConnectionResetError:
            # the client left (mid-body, usually): its doing, not ours; nobody is there to read an answer
            log.debug("client went away on %s", route)
            response = web.Response(status=499)  # nginx's "client closed request", for the count
        except RecursionError:
            # only a client's deeply nested JSON recurses this far; parse_json_body's bound should stop it first
            response = error_response(400, "JSON nested too deeply", "invalid_request_error", "body")
        except Exception:
            log.exception("unhandled error on %s", route)
            response = error_response(500, "internal router error", "internal_error")
        response = withhold_kv_locations(response)
        self.metrics.requests.inc(route, str(response.status))
        return response

    async def models(self, request: web.Request) -> web.StreamResponse:
        if self.tenants.tenant_for(request.headers.get("Authorization")) is None:
            response = unauthenticated_response()
        else:
            response = withhold_kv_locations(await self._models_from_upstream())
        self.metrics.requests.inc("/v1/models", str(response.status))
        return response

    async def _models_from_upstream(self) -> web.Response:
        for upstream in [u for pool in (self.decode, self.prefill) for u in pool if u.healthy]:
            try:
                async with self.session.get(upstream.base_url + "/v1/models", headers=self.upstream_headers,
                                            timeout=aiohttp.ClientTimeout(total=max(5.0, 2 * self.config.health_timeout_s))) as resp:
                    raw = await resp.read()
                    if resp.status == 200:
                        return web.Response(body=raw, headers={"Content-Type": "application/json"})
            except (aiohttp.ClientError, asyncio.TimeoutError):
                self.metrics.upstream_errors.inc(upstream.name, upstream.role, "models")
        return error_response(503, "no instance answered /v1/models", "service_unavailable")

    async def health(self, request: web.Request) -> web.Response:
        p, d = self.prefill.healthy_count, self.decode.healthy_count
        ok = p > 0 and d > 0
        state = {
            "status": "ok" if ok else "unavailable",
            "prefill": {"healthy": p, "total": len(self.prefill.instances)},
            "decode": {"healthy": d, "total": len(self.decode.instances)},
        }
        if self.tenants.open:  # with tenants, the count would show one tenant when others start conversations
            state["conversations"] = len(self.conversations)
        response = web.json_response(state, status=200 if ok else 503)
        self.metrics.requests.inc("/health", str(response.status))
        return response

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        if self.metrics_token is not None:
            presented = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(presented, f"Bearer {self.metrics_token}".encode("utf-8", "surrogateescape")):
                self.metrics.requests.inc("/metrics", "401")
                return error_response(401, "metrics token required", "authentication_error")
        elif not self.tenants.open and not self.config.open_metrics:
            self.metrics.requests.inc("/metrics", "403")
            return error_response(403, f"with API keys, /metrics needs its own token: set ${self.config.metrics_token_env} "
                                       "(or --open-metrics to serve them to anyone)", "permission_error")
        self.metrics.requests.inc("/metrics", "200")
        return web.Response(text=self.metrics.registry.render(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def kv_params(self, request: web.Request) -> web.Response:
        """D's connector posts its kv_transfer_params here (contract: impl.router.notify)."""
        if request.content_length is not None and request.content_length > MAX_NOTIFY_BODY_BYTES:
            return self._notify_result("too_large", error_response(413, "notification too large", "invalid_request_error", "body"))
        try:
            # unauthenticated until its token is read: the endpoint's own limit while reading, and a cap on
            # the bytes all notifications being read may hold at once
            raw = await self.connections.read_body(request, MAX_NOTIFY_BODY_BYTES, self.notify_bytes)
            turn, token, notification = parse_notification(parse_json_body(raw))
        except web.HTTPRequestEntityTooLarge:
            response = error_response(413, "notification too large", "invalid_request_error", "body")
            response.force_close()  # the rest of the body is not read
            return self._notify_result("too_large", response)
        except BodyBudgetFull:
            response = error_response(503, "too many notification bytes in flight; retry", "service_unavailable")
            response.force_close()
            return self._notify_result("busy", response)
        except BodyTimeout:
            return self._notify_result("body_timeout", self.connections.body_timeout_response())
        except ConnectionResetError:
            # the sender left mid-body: nobody to answer, nothing of ours failed (one debug line, counted)
            log.debug("notification sender went away mid-body on %s", NOTIFY_PATH)
            return self._notify_result("client_gone", web.Response(status=499))
        except (RequestError, NotifyError) as e:
            return self._notify_result("malformed", error_response(400, str(e), "invalid_request_error", e.field))
        result = self.hub.deliver(turn, token, notification)
        if result is Delivery.ACCEPTED:
            if notification.kv_params is not None:
                self.heartbeats.learn(notification)  # where this D takes heartbeats, if it listens
            return self._notify_result("accepted", web.Response(status=204))
        messages = {Delivery.BAD_TOKEN: "wrong token", Delivery.UNKNOWN_TURN: "unknown or finished turn",
                    Delivery.DUPLICATE: "already notified"}
        return self._notify_result(result.name.lower(), error_response(result.value, messages[result], "notify_error"))

    def _notify_result(self, result: str, response: web.Response) -> web.Response:
        self.metrics.notifications.inc(result)
        self.metrics.requests.inc(NOTIFY_PATH, str(response.status))
        return response


def withhold_kv_locations(response: web.StreamResponse) -> web.StreamResponse:
    """The last check on a whole body before it leaves (D's JSON answer, P's and D's 4xx passed on):
    whatever spelling of KV locations it holds is removed, and a body that could hold one but cannot
    be parsed is withheld. Streamed answers were checked event by event (impl.router.sse)."""
    if type(response) is not web.Response:
        return response
    body = response.body
    if not isinstance(body, bytes):
        return response
    clean = scrub_body(body)
    if clean is None:
        return error_response(502, "an upstream answer could not be checked for KV locations; withheld", "upstream_error")
    if clean is not body:
        response.body = clean
    return response


def build_app(config: RouterConfig, tenants: Tenants | None = None, environ: Mapping[str, str] | None = None) -> web.Application:
    environ = os.environ if environ is None else environ
    if tenants is None:
        tenants = Tenants.load(config.api_keys_file, config.api_keys_env, environ)
    router = Router(config, tenants, environ)
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[router.connections.middleware])
    app[ROUTER_KEY] = router
    app.router.add_post("/v1/chat/completions", router.chat_completions)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.metrics_endpoint)
    app.router.add_post(NOTIFY_PATH, router.kv_params)
    app.router.add_post(HEARTBEAT_ROUTE, router.heartbeats.handle)
    if not config.expose_upstream_urls:
        app.on_response_prepare.append(router.name_upstreams)

    async def lifecycle(_app: web.Application):
        await router.start()
        yield
        await router.stop()

    app.cleanup_ctx.append(lifecycle)
    return app


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start serving ``app``; returns the runner and the bound port (``port=0`` picks one)."""
    router: Router = app[ROUTER_KEY]
    config = router.config
    # aiohttp's own keep-alive close is only a backstop behind ClientConnections' clocks
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0,
                           keepalive_timeout=config.client_idle_timeout_s + config.client_header_timeout_s)
    await runner.setup()
    site = GuardedTCPSite(runner, host, port, router.connections, backlog=2048)
    await site.start()
    bound = site.port
    app[ROUTER_KEY].set_bound_port(host, bound)
    return runner, bound


async def serve(config: RouterConfig, ready: Callable[[int], Awaitable[None] | None] | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or cancellation), then drain and close upstream connections."""
    # each client connection is a descriptor, and so is each upstream connection and the listener
    needed = config.max_client_connections + 1024
    if raise_fd_limit(needed) < needed:
        log.warning("file-descriptor limit below %d: max_client_connections=%d may not all be served",
                    needed, config.max_client_connections)
    app = build_app(config)
    runner, port = await start_site(app, config.host, config.port)
    # Everything allocated so far (modules, aiohttp's tables, the app) lives as long as the process:
    # frozen, full collections stop re-traversing ~40k objects (a ~5-9 ms pause each on this machine)
    gc.collect()
    gc.freeze()
    log.info("router listening on %s:%d (P: %s; D: %s; placement %s; notify %s)", config.host, port,
             ", ".join(config.prefill), ", ".join(config.decode), config.placement, app[ROUTER_KEY].notify_url)
    if app[ROUTER_KEY].tenants.open:
        log.warning("no API keys configured: every request is tenant 'default' and unauthenticated")
    elif app[ROUTER_KEY].metrics_token is None and not config.open_metrics:
        log.warning("API keys configured and $%s unset: /metrics answers 403", config.metrics_token_env)
    if ready is not None:
        maybe = ready(port)
        if maybe is not None:
            await maybe
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            pass
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def run(config: RouterConfig) -> None:
    """Blocking entry point with the configured event loop."""
    use_uvloop = config.loop == "uvloop"
    if config.loop == "auto":
        try:
            import uvloop  # noqa: F401
            use_uvloop = True
        except ImportError:
            use_uvloop = False
    if use_uvloop:
        import uvloop
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    else:
        runner = asyncio.Runner()
    with runner:
        try:
            runner.run(serve(config))
        except KeyboardInterrupt:
            pass
