"""A router in front of fake P and D instances, all on loopback in the test's event loop, plus a client.

The client parses SSE on its own (split on blank lines, as OpenAI clients do) rather than with the
router's splitter, so the router's stream handling is checked against an independent reader.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from impl.router.app import ROUTER_KEY, Router, build_app, start_site
from impl.router.config import build_config
from impl.router.tenants import Tenants
from tests.async_timeout import ASYNC_TEST_TIMEOUT_S
from tests.router.fakes import FakeVllmUpstream, free_port



class LoopThread:
    """An event loop running in a daemon thread; ``run(coro)`` executes a coroutine there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="router-test-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = ASYNC_TEST_TIMEOUT_S):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        async def cancel_leftovers() -> None:  # e.g. a fake's stalled handler
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(cancel_leftovers(), timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@dataclass
class TurnResult:
    status: int
    events: list[Any] = field(default_factory=list)  # parsed data payloads ([DONE] as the string)
    raw: bytes = b""
    body: Any = None  # non-streamed JSON body
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    @property
    def error(self) -> dict[str, Any] | None:
        for ev in self.events:
            if isinstance(ev, dict) and "error" in ev:
                return ev["error"]
        if isinstance(self.body, dict) and "error" in self.body:
            return self.body["error"]
        return None

    @property
    def answer(self) -> str:
        if self.body is not None:
            choice = self.body["choices"][0]
            return choice["message"]["content"] if "message" in choice else choice["text"]
        parts = []
        for ev in self.events:
            if isinstance(ev, dict):
                for c in ev.get("choices", []):
                    parts.append((c.get("delta") or {}).get("content") or c.get("text") or "")
        return "".join(parts)


def parse_sse(raw: bytes) -> list[Any]:
    events: list[Any] = []
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = [line[5:].lstrip(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
        if not data:
            continue
        payload = b"\n".join(data)
        if payload == b"[DONE]":
            events.append("[DONE]")
            continue
        try:
            events.append(json.loads(payload))
        except ValueError:
            events.append(payload)  # what a client would choke on
    return events


class Deployment:
    """``n_prefill`` P and ``n_decode`` D fakes (plus ``dead_prefill`` refused URLs) behind one router."""

    def __init__(self, n_prefill: int = 1, n_decode: int = 1, style: str = "final_chunk", chunks: int = 4,
                 dead_prefill: int = 0, dead_decode: int = 0, keys: dict[str, str] | None = None, **config: Any) -> None:
        self.prefills = [FakeVllmUpstream(f"p{i}", role="prefill", chunks=chunks) for i in range(n_prefill)]
        self.decodes = [FakeVllmUpstream(f"d{i}", role="decode", style=style, chunks=chunks) for i in range(n_decode)]
        self.dead_prefill_urls = [f"http://127.0.0.1:{free_port()}" for _ in range(dead_prefill)]
        self.dead_decode_urls = [f"http://127.0.0.1:{free_port()}" for _ in range(dead_decode)]
        self.keys = keys
        self.config_overrides = {"health_interval_s": 60.0, "connect_timeout_s": 1.0, "notify_wait_s": 1.0, **config}
        self.client: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""

    @property
    def p(self) -> FakeVllmUpstream:
        return self.prefills[0]

    @property
    def d(self) -> FakeVllmUpstream:
        return self.decodes[0]

    @property
    def router(self) -> Router:
        return self._app[ROUTER_KEY]

    async def __aenter__(self) -> "Deployment":
        for fake in self.prefills + self.decodes:
            await fake.start()
        config = build_config(overrides={
            "prefill": self.dead_prefill_urls + [f.url for f in self.prefills],
            "decode": self.dead_decode_urls + [f.url for f in self.decodes],
            "host": "127.0.0.1", "port": 0, **self.config_overrides})
        environ = {}
        tenants = Tenants.load(None, "KEYS", {"KEYS": ",".join(f"{t}={k}" for t, k in self.keys.items())} if self.keys else {})
        self._app = build_app(config, tenants=tenants, environ=environ)
        self._runner, port = await start_site(self._app, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{port}"
        self.client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.client is not None:
            await self.client.close()
        if self._runner is not None:
            await self._runner.cleanup()
        for fake in self.prefills + self.decodes:
            await fake.stop()

    async def post(self, path: str, body: Any, key: str | None = None, headers: dict[str, str] | None = None,
                   raw: bytes | None = None) -> TurnResult:
        h = dict(headers or {})
        if key is not None:
            h["Authorization"] = f"Bearer {key}"
        data = raw if raw is not None else json.dumps(body).encode()
        h.setdefault("Content-Type", "application/json")
        async with self.client.post(self.url + path, data=data, headers=h) as resp:
            payload = await resp.read()
            if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                return TurnResult(resp.status, parse_sse(payload), payload, headers=dict(resp.headers))
            try:
                obj = json.loads(payload) if payload else None
            except ValueError:
                obj = payload
            return TurnResult(resp.status, raw=payload, body=obj, headers=dict(resp.headers))

    async def chat(self, messages: list[dict[str, Any]], conversation_id: str | None = None, key: str | None = None,
                   stream: bool = True, **extra: Any) -> TurnResult:
        body = {"model": "fake-model", "messages": messages, "stream": stream, "max_tokens": 16, **extra}
        if conversation_id is not None:
            body["conversation_id"] = conversation_id
        return await self.post("/v1/chat/completions", body, key)

    async def completion(self, prompt: Any, conversation_id: str | None = None, key: str | None = None,
                         stream: bool = True, **extra: Any) -> TurnResult:
        body = {"model": "fake-model", "prompt": prompt, "stream": stream, "max_tokens": 16, **extra}
        if conversation_id is not None:
            body["conversation_id"] = conversation_id
        return await self.post("/v1/completions", body, key)

    async def get(self, path: str, key: str | None = None) -> tuple[int, bytes]:
        h = {"Authorization": f"Bearer {key}"} if key else {}
        async with self.client.get(self.url + path, headers=h) as resp:
            return resp.status, await resp.read()

    async def settle(self) -> None:
        """Let background store updates (notification waits) finish."""
        await self.router.proxy.recorder.settle()
        await asyncio.sleep(0)
