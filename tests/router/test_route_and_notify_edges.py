"""Leftovers of the earlier hardening passes: a notifier that leaves mid-body is one debug line and a
count (no ERROR, no traceback), and a conversation id with braces can be heartbeated like any other."""

from __future__ import annotations

import asyncio
import logging

from impl.router.app import NOTIFY_PATH
from tests.router.harness import Deployment
from tests.router.test_heartbeat import first_turn, heartbeat, lease_deployment


async def test_a_notifier_leaving_mid_body_is_one_debug_line_and_counted(caplog):
    caplog.set_level(logging.DEBUG)
    async with Deployment() as dep:
        host, port = dep.url.removeprefix("http://").split(":")
        for _ in range(3):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(f"POST {NOTIFY_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         "Content-Length: 5000\r\n\r\n{\"turn\": ".encode())
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.transport.abort()  # RST mid-body
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.2)
        assert (await dep.chat([{"role": "user", "content": "still serving"}])).status == 200
        assert 'bidikv_router_notifications_total{result="client_gone"} 3' in dep.router.metrics.registry.render()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], \
        [(r.name, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [r for r in caplog.records if r.exc_info]


async def test_a_conversation_id_with_braces_can_be_heartbeated():
    cid = "{3F2504E0-4F89-11D3-9A0C-0305E82C3301}"
    async with lease_deployment() as dep:
        await first_turn(dep, cid)
        for path_id in ("%7B3F2504E0-4F89-11D3-9A0C-0305E82C3301%7D", cid):
            r = await heartbeat(dep, path_id)
            assert r.status == 200, (path_id, r.status, r.body)
            assert r.body["conversation_id"] == cid and r.body["renewed"] is True
