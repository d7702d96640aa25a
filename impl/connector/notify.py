"""The connector's half of the router notification contract (:mod:`impl.router.notify`, version 1).

On vLLM 0.32 a streamed response carries no ``kv_transfer_params``, so the router cannot learn from
D's stream where D keeps a finished turn's blocks. The router puts ``bidikv_notify`` (``url``,
``turn``, ``token``) in the params it sends D; when D's scheduler finishes such a request *and
retains its blocks*, :class:`Notifier` POSTs ``{"turn", "token", "kv_transfer_params",
"expires_in_s"}`` to that URL, plus ``heartbeat_url`` when D runs a heartbeat listener
(:mod:`impl.connector.heartbeat`): where the router relays the conversation's heartbeats. When it
retains nothing it POSTs ``{"turn", "token", "retained": false}``, so the router stops waiting.

Never on the engine's critical path: ``submit`` only validates the field, encodes the body and puts it
on a bounded queue (a full queue drops the notification and counts it); one daemon thread does the
HTTP. Each POST has a short timeout and is retried at most once, and only on a connection error
(never after the router answered): a lost notification costs one turn's reuse, never correctness.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import urlsplit

from impl.router.notify import CONTRACT_VERSION, NOTIFY_KEY

log = logging.getLogger("bidikv.connector.notify")

__all__ = ["NOTIFY_KEY", "NotifyTarget", "Notifier", "parse_notify_field"]


@dataclass(frozen=True, slots=True)
class NotifyTarget:
    url: str
    turn: str
    token: str


def parse_notify_field(value: Any) -> NotifyTarget | None:
    """The router's ``bidikv_notify`` field, or None if it is absent; ValueError if malformed."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"{NOTIFY_KEY} must be an object")
    if value.get("v") != CONTRACT_VERSION:
        raise ValueError(f"{NOTIFY_KEY}.v must be {CONTRACT_VERSION}, got {value.get('v')!r}")
    url, turn, token = value.get("url"), value.get("turn"), value.get("token")
    if not isinstance(url, str) or urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).netloc:
        raise ValueError(f"{NOTIFY_KEY}.url must be an http(s) URL, got {url!r}")
    if not isinstance(turn, str) or not turn or len(turn) > 128:
        raise ValueError(f"{NOTIFY_KEY}.turn must be a non-empty string of at most 128 characters")
    if not isinstance(token, str) or not token or len(token) > 256:
        raise ValueError(f"{NOTIFY_KEY}.token must be a non-empty string")
    return NotifyTarget(url, turn, token)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _post(url: str, body: bytes, timeout_s: float) -> int:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status
    except urllib.error.HTTPError as e:  # the router answered: a status, not a connection error
        return e.code


@dataclass
class NotifierStats:
    submitted: int = 0
    delivered: int = 0  # 204
    rejected: int = 0  # any other status (late turn, bad token, duplicate ...)
    failed: int = 0  # no answer after the retry
    dropped: int = 0  # after close
    queue_full: int = 0  # queue full: submitted but never attempted
    statuses: dict[int, int] = field(default_factory=dict)


class Notifier:
    """One background thread posting notifications in submission order."""

    def __init__(self, timeout_s: float = 1.0, max_queue: int = 4096,
                 post: Callable[[str, bytes, float], int] = _post) -> None:
        self.timeout_s = timeout_s
        self.stats = NotifierStats()
        self._post = post
        self._queue: queue.Queue[tuple[NotifyTarget, bytes] | None] = queue.Queue(max_queue)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, target: NotifyTarget, kv_params: dict[str, Any] | None, expires_in_s: float | None,
               heartbeat_url: str | None = None) -> bool:
        """Queue one notification; never blocks. False if it was dropped. ``kv_params`` None says D kept
        nothing for a later turn (``"retained": false``), so the router need not wait for params."""
        body: dict[str, Any] = {"turn": target.turn, "token": target.token}
        if kv_params is None:
            body["retained"] = False
            expires_in_s = heartbeat_url = None
        else:
            body["kv_transfer_params"] = _jsonable(kv_params)
        if expires_in_s is not None and math.isfinite(expires_in_s):
            body["expires_in_s"] = max(0.0, float(expires_in_s))
        if heartbeat_url is not None:
            body["heartbeat_url"] = heartbeat_url
        payload = json.dumps(body, separators=(",", ":")).encode()
        with self._lock:
            if self._closed:
                self.stats.dropped += 1
                return False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="bidikv-notify", daemon=True)
                self._thread.start()
            self.stats.submitted += 1
        try:
            self._queue.put_nowait((target, payload))
        except queue.Full:
            with self._lock:
                self.stats.queue_full += 1
            log.warning("bidikv notification queue full: turn %s loses its reuse", target.turn)
            return False
        return True

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            target, payload = item
            status = None
            for attempt in (1, 2):
                try:
                    status = self._post(target.url, payload, self.timeout_s)
                    break
                except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
                    if attempt == 2 or not _is_connection_error(e):
                        log.warning("bidikv notification for turn %s not delivered: %s", target.turn, e)
                        break
            with self._lock:
                if status is None:
                    self.stats.failed += 1
                else:
                    self.stats.statuses[status] = self.stats.statuses.get(status, 0) + 1
                    if status == 204:
                        self.stats.delivered += 1
                    else:
                        self.stats.rejected += 1
            if status not in (None, 204):
                log.info("router answered %s to the notification of turn %s", status, target.turn)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued notification was attempted (tests and shutdown); False on timeout."""
        end = time.monotonic() + timeout_s
        while True:
            with self._lock:
                s = self.stats
                queued = s.submitted - s.queue_full
                if s.delivered + s.rejected + s.failed >= queued:
                    return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.005)

    def close(self, timeout_s: float = 2.0) -> None:
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            try:
                self._queue.put_nowait(None)
            except queue.Full:
                return  # daemon thread: it dies with the process
            thread.join(timeout_s)


def _is_connection_error(e: BaseException) -> bool:
    """Connection refused/reset/unreachable: the request never reached the router, so retrying is safe."""
    reason = e.reason if isinstance(e, urllib.error.URLError) else e
    if isinstance(reason, (TimeoutError,)):
        return False  # it may have reached the router: do not post twice
    return isinstance(reason, (ConnectionError, OSError)) and not isinstance(reason, TimeoutError)
