"""D's heartbeat listener: how a client's heartbeat, relayed by the router, reaches the lease on D.

The retention policy (``impl.policy.HeartbeatLease``) and the scheduler's :meth:`renew` live on the
engine core's scheduler thread; the router lives in another process, usually on another node. This
is the transport between them, chosen for how little it adds to the engine-core process:

* **stdlib HTTP on its own port** (``bidikv_heartbeat_port``). Request/response, because the router
  must learn the renewed expiry (it updates the stored ``remote_blocks_expiry_time`` P checks before
  reading); HTTP, because the router already speaks it (aiohttp) and an operator can ``curl`` it.
  A UDP datagram would need its own reply, retry and timeout logic for the same answer. No vLLM or
  asyncio dependency: vLLM's API server is another process and the engine core runs no event loop.
* **the listener never touches scheduler state.** A handler thread puts the renewal on a queue and
  waits (at most ``answer_timeout_s``) for the scheduler thread to apply it: vLLM's scheduler is
  single-threaded and its ``_reqs_need_send`` (the deadlines the worker enforces) is swapped out
  every step, so a write from another thread could be lost or land in a dict already handed over.
  The scheduler drains the queue at every step and during its idle wait (polled every 5 ms, see
  scheduler.py), so an answer takes milliseconds even on an idle D.
* **a request D does not hold is answered at once**, from a membership test of the scheduler's
  retained-request map (one C-level dict lookup, atomic under the GIL): a D that holds nothing does
  not step at all (vLLM's engine core then blocks on its input queue), so waiting for a drain there
  would only ever time out.
* **bounded**: at most ``max_pending`` heartbeats wait at once (more get 503 "busy"), bodies are at
  most 4 KiB, and each connection has a socket timeout; one request per connection (HTTP/1.0), so
  handler threads live only as long as one answer.

Trust: like NIXL's side channel (which serves the KV blocks themselves, unauthenticated), the port
belongs on the cluster's internal network. A forged heartbeat can at most keep a request's blocks
until the lease's ``max_hold_s``; it cannot read or redirect anything.

Protocol (version 1)::

    POST /bidikv/heartbeat   {"request_id": "<remote_request_id>", "engine_id": "<remote_engine_id>"}

    200 {"status": "held", "renewed": true|false, "retention": "lease"|"ttl"|"gap_quantile",
         "expiry_time": <D's clock, the basis of remote_blocks_expiry_time>,
         "expires_in_s": <seconds from D's answer>, "heartbeat_interval_s": <lease only>}
    200 {"status": "not_held", "reason": "unknown"|"expired"|"other_engine"|"given_back"}
    400 {"error": "<field>: <problem>"}      503 {"status": "busy"}      404 other paths
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from impl.router.config import url_host

log = logging.getLogger("bidikv.connector.heartbeat")

HEARTBEAT_PATH = "/bidikv/heartbeat"
MAX_BODY_BYTES = 4096
MAX_ID_LEN = 512


@dataclass(slots=True)
class PendingRenewal:
    request_id: str
    done: threading.Event = field(default_factory=threading.Event)
    answer: dict[str, Any] | None = None


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a handler blocked on a dead engine must not keep the process alive
    allow_reuse_address = True  # a restarted engine gets its port back despite TIME_WAIT

    def __init__(self, address: tuple[str, int], listener: "HeartbeatListener") -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.listener = listener
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = 5.0  # socket timeout: a client that stops sending cannot pin a handler thread
    server_version = "bidikv-heartbeat/1"

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.split("?", 1)[0] != HEARTBEAT_PATH:
            self._reply(404, {"error": "not found"})
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit() or int(length) > MAX_BODY_BYTES:
            self._reply(400, {"error": f"body: a Content-Length of at most {MAX_BODY_BYTES} bytes is required"})
            return
        try:
            status, answer = self.server.listener.handle(self.rfile.read(int(length)))
        except Exception:  # never a traceback to the peer, never a dead listener
            log.exception("heartbeat handling failed")
            status, answer = 500, {"error": "internal error"}
        self._reply(status, answer)

    def do_GET(self) -> None:  # noqa: N802
        self._reply(404 if self.path != HEARTBEAT_PATH else 405, {"error": "POST a heartbeat"})

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        raw = json.dumps(body, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, format: str, *args: Any) -> None:  # http.server logs every request to stderr
        log.debug("heartbeat %s: " + format, self.client_address[0], *args)


def parse_heartbeat(raw: bytes) -> tuple[str, str | None]:
    """``(request_id, engine_id or None)`` of a heartbeat body; ValueError naming the field."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise ValueError("body: must be a JSON object") from None
    if not isinstance(body, dict):
        raise ValueError("body: must be a JSON object")
    request_id, engine_id = body.get("request_id"), body.get("engine_id")
    if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_ID_LEN:
        raise ValueError(f"request_id: must be a non-empty string of at most {MAX_ID_LEN} characters")
    if engine_id is not None and (not isinstance(engine_id, str) or len(engine_id) > MAX_ID_LEN):
        raise ValueError(f"engine_id: must be a string of at most {MAX_ID_LEN} characters")
    return request_id, engine_id


class HeartbeatListener:
    """Accepts heartbeats on a thread; :meth:`drain` applies them on the scheduler's thread."""

    def __init__(self, host: str, port: int, engine_id: str, is_held: Callable[[str], bool], *,
                 advertised_host: str | None = None, answer_timeout_s: float = 2.0, max_pending: int = 64,
                 was_given_back: Callable[[str], bool] | None = None) -> None:
        self.engine_id = engine_id
        self._is_held = is_held
        # give_back: a request D freed under pressure, answered as such at once (also a GIL-atomic lookup)
        self._was_given_back = was_given_back
        self.answer_timeout_s = answer_timeout_s
        self._slots = threading.BoundedSemaphore(max_pending)
        self._queue: queue.SimpleQueue[PendingRenewal] = queue.SimpleQueue()
        self._server = _Server((host, port), self)  # binds now: a taken port fails the engine's start
        self.port = self._server.server_address[1]
        shown = advertised_host if advertised_host and host in ("0.0.0.0", "::", "") else host
        self.url = f"http://{url_host(shown)}:{self.port}{HEARTBEAT_PATH}"
        self.stats = {"received": 0, "answered_not_held": 0, "applied": 0, "busy": 0, "timed_out": 0}
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="bidikv-heartbeat", daemon=True)
        self._thread.start()

    # -- listener threads ------------------------------------------------------------------------
    def handle(self, raw: bytes) -> tuple[int, dict[str, Any]]:
        try:
            request_id, engine_id = parse_heartbeat(raw)
        except ValueError as e:
            return 400, {"error": str(e)}
        self.stats["received"] += 1
        if engine_id is not None and engine_id != self.engine_id:
            self.stats["answered_not_held"] += 1
            return 200, {"status": "not_held", "reason": "other_engine"}
        if not self._is_held(request_id):
            self.stats["answered_not_held"] += 1
            given_back = self._was_given_back is not None and self._was_given_back(request_id)
            return 200, {"status": "not_held", "reason": "given_back" if given_back else "unknown"}
        if not self._slots.acquire(blocking=False):
            self.stats["busy"] += 1
            return 503, {"status": "busy"}
        try:
            pending = PendingRenewal(request_id)
            self._queue.put(pending)
            if not pending.done.wait(self.answer_timeout_s):
                # still applied when the scheduler gets to it; the router keeps its old expiry meanwhile
                self.stats["timed_out"] += 1
                return 503, {"status": "busy"}
            return 200, pending.answer
        finally:
            self._slots.release()

    # -- the scheduler's thread ------------------------------------------------------------------
    def pending(self) -> bool:
        return not self._queue.empty()

    def drain(self, apply: Callable[[str], dict[str, Any]]) -> int:
        """Apply every queued renewal with ``apply(request_id) -> answer``; returns how many."""
        n = 0
        while True:
            try:
                pending = self._queue.get_nowait()
            except queue.Empty:
                return n
            try:
                pending.answer = apply(pending.request_id)
            except Exception:
                log.exception("applying the heartbeat of %s failed", pending.request_id)
                pending.answer = {"status": "not_held", "reason": "error"}
            pending.done.set()
            self.stats["applied"] += 1
            n += 1

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(2.0)


__all__ = ["HEARTBEAT_PATH", "HeartbeatListener", "parse_heartbeat"]
