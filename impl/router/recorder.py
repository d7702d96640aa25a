"""Step 5 of a turn: deciding what to store once D has answered, and when.

Only a complete, reconstructable turn is stored (see :mod:`impl.router.capture`). Its D params come
from D's notification (vLLM 0.32 + our connector, :mod:`impl.router.notify`) or from the final
chunk / body (vLLM 0.33, or any non-streamed answer): whichever is there when D's stream ends wins,
and when both are there and differ the notification wins and the conflict is counted. If neither is
there yet, a background waiter gives the notification ``notify_wait_s`` more -- the client already
has its whole answer -- and a next turn of the same conversation that arrives meanwhile waits for
that waiter (bounded by the same time) before its lookup, so a fast client still hits.

The entry's expiry is on the router's clock: D's ``remote_blocks_expiry_time`` is D's
``perf_counter`` and is forwarded to P verbatim, never interpreted here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from impl.policy import ConversationEntry
from impl.policy.prefix_check import CHECK_KEY
from impl.router.capture import TurnCapture, decode_params_problem
from impl.router.config import RouterConfig
from impl.router.metrics import RouterMetrics
from impl.router.notify import NOTIFY_KEY, Notification, NotifyHub
from impl.router.request import TurnRequest
from impl.router.stores import RouterStore, StoreUnavailable
from impl.router.upstreams import Upstream

log = logging.getLogger("bidikv.router")

Key = tuple[str, str]


class TurnRecorder:
    def __init__(self, config: RouterConfig, store: RouterStore, hub: NotifyHub, metrics: RouterMetrics,
                 clock: Callable[[], float]) -> None:
        self.config = config
        self.store = store
        self.hub = hub
        self.metrics = metrics
        self.clock = clock
        self._finalizing: dict[Key, asyncio.Future] = {}  # conversations whose update awaits D's notification
        self._background: set[asyncio.Task] = set()

    async def wait_pending(self, key: Key) -> None:
        """Before a lookup: let the previous turn's pending update land (at most ``notify_wait_s``)."""
        pending = self._finalizing.get(key)
        if pending is not None:
            try:
                await asyncio.wait_for(asyncio.shield(pending), self.config.notify_wait_s)
            except asyncio.TimeoutError:
                pass

    async def finish_turn(self, key: Key, turn: TurnRequest, capture: TurnCapture, upstream: Upstream,
                          notify_turn: str | None) -> bool:
        """Store the turn now, or hand it to a background waiter; True if the waiter now owns ``notify_turn``."""
        if not capture.complete:
            self.metrics.turns_not_stored.inc("upstream_error" if capture.error else "incomplete")
            return False
        finished_at = self.clock()
        notification = self.hub.peek(notify_turn) if notify_turn else None
        if notification is not None and notification.kv_params is None and capture.kv_params is None:
            self.metrics.turns_not_stored.inc("not_retained")  # D said it kept nothing: no wait
            return False
        if notification is not None or capture.kv_params is not None:
            await self._store(key, turn, capture, upstream, finished_at, notification)
            return False
        if notify_turn is None or self.config.notify_wait_s <= 0:
            self.metrics.turns_not_stored.inc("no_params")
            return False
        try:
            # a shared store: the next turn may reach another replica, whose lookup waits on this mark
            # as wait_pending does here (set before the client can see [DONE])
            await self.store.mark_pending(key[0], key[1], self.config.notify_wait_s)
        except StoreUnavailable:
            pass
        future = asyncio.get_running_loop().create_future()
        self._finalizing[key] = future
        task = asyncio.get_running_loop().create_task(
            self._await_notification(key, turn, capture, upstream, finished_at, notify_turn, future))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return True

    async def _await_notification(self, key: Key, turn: TurnRequest, capture: TurnCapture, upstream: Upstream,
                                  finished_at: float, notify_turn: str, future: asyncio.Future) -> None:
        try:
            notification = await self.hub.wait(notify_turn, self.config.notify_wait_s)
            if notification is None:
                self.metrics.turns_not_stored.inc("no_params")
            elif notification.kv_params is None:
                self.metrics.turns_not_stored.inc("not_retained")
            else:
                await self._store(key, turn, capture, upstream, finished_at, notification)
        finally:
            self.hub.close(notify_turn)
            try:
                await self.store.clear_pending(key[0], key[1])
            except StoreUnavailable:
                pass  # the mark expires on its own after notify_wait_s
            if self._finalizing.get(key) is future:
                del self._finalizing[key]
            if not future.done():
                future.set_result(None)

    async def _store(self, key: Key, turn: TurnRequest, capture: TurnCapture, upstream: Upstream,
                     finished_at: float, notification: Notification | None) -> None:
        if notification is not None and notification.kv_params is None:
            notification = None  # "kept nothing" is no params: a final chunk's, if any, stand
        if notification is not None:
            params = notification.kv_params
            source = "notify"
            if capture.kv_params is not None and _comparable(capture.kv_params) != _comparable(params):
                self.metrics.params_conflicts.inc()
                log.warning("D %s: final chunk and notification disagree; using the notification", upstream.name)
        else:
            params = capture.kv_params
            source = "final_chunk" if turn.stream else "body"
        problem = decode_params_problem(params)
        if problem is not None:
            self.metrics.turns_not_stored.inc("invalid_params")
            log.warning("D %s returned unusable kv_transfer_params (%s)", upstream.name, problem)
            return
        if CHECK_KEY in params:
            # P verifies token ids against D's checkpoints and pulls only what agrees: any turn can be
            # offered, including ones whose history the router cannot reconstruct (reasoning, tool
            # calls) or that the client or the chat template re-renders. The length is kept all the same:
            # prefill on D bounds a later turn's suffix by what lies beyond it (impl.router.on_d)
            length = 0 if capture.unreconstructable else turn.held_length(capture.answer, capture.output_token_ids)
            held: tuple[int, str | None] | None = (length, None)
        elif capture.unreconstructable:
            self.metrics.turns_not_stored.inc("unreconstructable")
            return
        else:
            held = turn.held_sequence(capture.answer, capture.output_token_ids)
        if held is None:
            self.metrics.turns_not_stored.inc("no_token_ids")
            return
        params = dict(params)
        params.pop(NOTIFY_KEY, None)
        if self.config.rewrite_remote_host:
            params["remote_host"] = upstream.host
        ttl = self.config.decoder_kv_blocks_ttl
        if notification is not None and notification.expires_in_s is not None:
            # the connector's own clock, carried over as a duration from when it arrived
            expires_at = min(finished_at + ttl, notification.received_at + notification.expires_in_s)
        else:
            expires_at = finished_at + ttl
        now = self.clock()
        entry = ConversationEntry(decode_instance=upstream.name, kv_params=params, expires_at=expires_at,
                                  num_tokens=int(params["remote_num_tokens"]), held_len=held[0], held_digest=held[1],
                                  stored_at=now)
        try:
            await self.store.record_success(key[0], key[1], entry, now)
        except StoreUnavailable:  # Redis down: the client has its answer; the next turn recomputes
            self.metrics.turns_not_stored.inc("store_unavailable")
            return
        self.metrics.turns_stored.inc(source)

    async def settle(self) -> None:
        """Wait for every pending background update (tests; graceful shutdown)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


def _comparable(params: dict[str, Any]) -> dict[str, Any]:
    """Params minus what the router itself may rewrite, for the conflict check."""
    return {k: v for k, v in params.items() if k not in ("remote_host", NOTIFY_KEY)}
