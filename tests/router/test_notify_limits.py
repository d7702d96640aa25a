"""/internal/kv_params reads before it can authenticate (the token is in the body): its 1 MiB limit holds
while reading, whatever the framing says, and the bytes all such bodies hold at once are capped."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from impl.router.app import NOTIFY_BYTES_IN_FLIGHT
from impl.router.notify import MAX_NOTIFY_BODY_BYTES
from tests.router.harness import Deployment


async def _chunked(first: bytes, then_wait_s: float):
    """A chunked body (no Content-Length): ``first``, then nothing for ``then_wait_s``, then more."""
    yield first
    await asyncio.sleep(then_wait_s)
    yield b" " * 1024


async def test_a_chunked_notification_over_the_limit_is_refused_while_it_is_still_arriving():
    async with Deployment() as dep:
        started = time.monotonic()
        body = b'{"turn": "t", "token": "x", "pad": "' + b"a" * (MAX_NOTIFY_BODY_BYTES + 64 * 1024)
        async with aiohttp.ClientSession() as s:
            try:
                async with s.post(dep.url + "/internal/kv_params", data=_chunked(body, 10.0),
                                  headers={"Content-Type": "application/json"}) as r:
                    status = r.status
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                status = None  # the router closed the connection on us mid-upload: refused too
        # answered (or cut off) long before the sender's 10 s pause ends: the router did not wait for the rest
        assert time.monotonic() - started < 5.0
        assert status in (413, None)
        assert 'bidikv_router_notifications_total{result="too_large"} 1' in dep.router.metrics.registry.render()


async def test_the_bytes_of_notifications_being_read_at_once_are_capped():
    async with Deployment() as dep:
        n = NOTIFY_BYTES_IN_FLIGHT // (MAX_NOTIFY_BODY_BYTES - 4096) + 2
        part = b'{"turn": "t", "token": "x", "pad": "' + b"a" * (MAX_NOTIFY_BODY_BYTES - 8192)
        async with aiohttp.ClientSession() as s:
            async def slow_sender() -> int | None:
                try:
                    async with s.post(dep.url + "/internal/kv_params", data=_chunked(part, 3.0),
                                      headers={"Content-Type": "application/json"}) as r:
                        return r.status
                except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                    return None
            statuses = await asyncio.gather(*(slow_sender() for _ in range(n)))
        assert dep.router.notify_bytes.held == 0  # all given back once the bodies ended
        assert dep.router.notify_bytes.refused >= 1 and 503 in statuses, statuses
        assert 'bidikv_router_notifications_total{result="busy"}' in dep.router.metrics.registry.render()
