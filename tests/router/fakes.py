"""Scripted stand-ins for vLLM P and D instances, for faults a real server cannot produce on demand.

``FakeVllmUpstream`` speaks the slice of vLLM's OpenAI API the router uses: P answers JSON with its
``kv_transfer_params``; D streams ``chunks`` SSE events and, depending on ``style``, puts its params
on the final chunk (vLLM 0.33), posts them to the router's ``bidikv_notify`` URL (vLLM 0.32 + our
connector), both, or neither (plain 0.32). Answers and D's request ids are derived from the prompt
(:func:`prompt_tag`), so a test can tell which conversation and turn every byte and every param
belongs to. Faults are switched per instance with :attr:`FakeVllmUpstream.fault`.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

D_TTL_S = 480.0


def prompt_tag(body: dict[str, Any]) -> str:
    """A short digest of the prompt a request carries (messages or prompt)."""
    source = body.get("messages") if "messages" in body else body.get("prompt")
    return hashlib.blake2b(json.dumps(source, sort_keys=True).encode(), digest_size=4).hexdigest()


def expected_answer(body: dict[str, Any], chunks: int) -> str:
    """What a fake D answers to this request: deterministic per prompt."""
    tag = prompt_tag(body)
    return "".join(f"<{tag}:{i}>" for i in range(chunks))


def free_port() -> int:
    """A port nothing listens on (bound then released): connecting to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Received:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class FakeVllmUpstream:
    name: str
    role: str = "both"  # "prefill" answers max_tokens=1 non-streamed requests with P params; "decode" the rest
    # final_chunk | notify | both | none | conflict | kept_nothing (our connector in a D that keeps nothing:
    # bidirectional OFF; posts "retained": false)
    style: str = "final_chunk"
    chunks: int = 4
    chunk_delay_s: float = 0.0
    # kill_mid_stream | no_done | malformed_final | error_event | stall (D, mid-stream);
    # http_500 | http_500_on_pull | http_400 | slow (before answering)
    # leaky (what must never reach a client): inject_events (D streams the raw payloads of ``inject`` before [DONE]),
    # inject_json (D's JSON answer gets ``inject``'s fields in its choice), http_4xx_body (answers
    # ``inject`` = (status, raw body))
    fault: str | None = None
    inject: Any = None
    fault_after: int = 2  # content chunks sent before a mid-stream fault
    slow_s: float = 5.0  # how long "slow"/"stall" take
    notify_delay_s: float = 0.0
    notify_token_override: str | None = None
    healthy: bool = True
    max_model_len: int | None = None  # reported by /v1/models, as vLLM does
    drop_reused: int = 0  # close this many requests that arrive on an already used connection, unanswered
    # token-exact reuse (impl.policy.prefix_check): D publishes a check with its params, P answers an
    # offer with a report verifying ``verified_share`` of it; ``reasoning``: D's answer carries reasoning_content
    publish_check: bool = False
    verified_share: float = 0.5
    reasoning: bool = False
    _peers: set = field(default_factory=set)
    received: list[Received] = field(default_factory=list)
    notify_replies: list[int] = field(default_factory=list)
    issued_d_params: dict[str, str] = field(default_factory=dict)  # D remote_request_id -> prompt tag
    port: int = 0
    _runner: web.AppRunner | None = None
    _session: aiohttp.ClientSession | None = None
    _ids: Any = field(default_factory=lambda: itertools.count(1))
    _tasks: set = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> "FakeVllmUpstream":
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self._session = aiohttp.ClientSession()
        return self

    async def stop(self) -> None:
        """Stop listening (the instance is 'down'; the port is kept for :meth:`start` to come back)."""
        for t in list(self._tasks):
            t.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- handlers ---------------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, request: web.Request) -> web.Response:
        model: dict[str, Any] = {"id": "fake-model", "object": "model"}
        if self.max_model_len is not None:
            model["max_model_len"] = self.max_model_len
        return web.json_response({"object": "list", "data": [model]})

    def _is_prefill_request(self, body: dict[str, Any]) -> bool:
        params = body.get("kv_transfer_params") or {}
        return body.get("max_tokens") == 1 and body.get("stream") is False and params.get("do_remote_decode") is True \
            and not params.get("do_remote_prefill")

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        peer = request.transport.get_extra_info("peername")
        if self.drop_reused and peer in self._peers:
            # what a keep-alive race looks like: the server closed an idle connection the client reused
            self.drop_reused -= 1
            request.transport.close()
            return web.Response()
        self._peers.add(peer)
        self.received.append(Received(request.path, body, dict(request.headers)))
        if self.fault == "http_500" or (self.fault == "http_500_on_pull"
                                        and (body.get("kv_transfer_params") or {}).get("remote_block_ids")):
            return web.json_response({"error": {"message": "boom", "code": 500}}, status=500)
        if self.fault == "http_4xx_body":
            status, raw = self.inject
            return web.Response(status=status, body=raw, headers={"Content-Type": "application/json"})
        if self.fault == "http_400_echo":  # vLLM-style error quoting what it was sent (KV locations, notify token)
            quoted = json.dumps(body.get("kv_transfer_params"))
            return web.json_response({"object": "error", "message": f"invalid kv_transfer_params {quoted}",
                                      "type": "BadRequestError", "param": None, "code": 400}, status=400)
        if self.fault == "http_400":
            return web.json_response({"error": {"message": "bad prompt", "type": "BadRequestError", "code": 400}}, status=400)
        if self.fault == "slow":
            await asyncio.sleep(self.slow_s)
        if self.role == "prefill" or (self.role == "both" and self._is_prefill_request(body)):
            return self._prefill_response(request, body)
        if body.get("stream"):
            return await self._stream(request, body)
        return self._decode_json(body)

    def _prefill_response(self, request: web.Request, body: dict[str, Any]) -> web.Response:
        chat = "messages" in body
        choice = {"index": 0, "finish_reason": "length"}
        choice.update({"message": {"role": "assistant", "content": "x"}} if chat else {"text": "x"})
        params = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
            "remote_engine_id": f"P-{self.name}", "remote_request_id": f"p-{next(self._ids)}-{prompt_tag(body)}",
            "remote_host": "localhost", "remote_port": 5600, "tp_size": 1, "remote_num_tokens": 48,
            "remote_blocks_expiry_time": None, "transfer_mode": "pull",
        }
        # vLLM with --enable-prompt-tokens-details reports the prompt tokens it did not compute
        offered = (body.get("kv_transfer_params") or {}).get("remote_num_tokens") or 0
        if "bidikv_prefix_check" in (body.get("kv_transfer_params") or {}):
            verified = int(offered * self.verified_share)
            params["bidikv_reuse"] = {"path": "d_to_p", "offered": offered, "verified": verified, "pulled": verified,
                                      "reason": "full" if verified == offered else "partial"}
        usage = {"prompt_tokens": 100, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": offered}}
        return web.json_response({"id": "cmpl-p", "object": "chat.completion" if chat else "text_completion",
                                  "model": "fake-model", "choices": [choice], "kv_transfer_params": params,
                                  "usage": usage})

    def _d_params(self, body: dict[str, Any]) -> dict[str, Any]:
        rid = f"d-{self.name}-{next(self._ids)}-{prompt_tag(body)}"
        self.issued_d_params[rid] = prompt_tag(body)
        return {
            "do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [[7, 8, 9, 10]],
            "remote_engine_id": f"D-{self.name}", "remote_request_id": rid, "remote_host": "localhost",
            "remote_port": 5700, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 64 + self.chunks,
            "remote_blocks_expiry_time": time.perf_counter() + D_TTL_S, "transfer_mode": "pull",
            **({"bidikv_prefix_check": {"v": 1, "scheme": "0" * 16, "bs": 16, "n": 64 + self.chunks, "cp": []}}
               if self.publish_check else {}),
        }

    def _decode_json(self, body: dict[str, Any]) -> web.Response:
        chat = "messages" in body
        answer = expected_answer(body, self.chunks)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
        choice.update({"message": {"role": "assistant", "content": answer}} if chat else {"text": answer})
        if body.get("return_token_ids"):
            choice["token_ids"] = [1000 + i for i in range(self.chunks)]
        if self.fault == "inject_json":
            choice.update(self.inject)
        out: dict[str, Any] = {"id": "cmpl-d", "object": "chat.completion" if chat else "text_completion",
                               "model": "fake-model", "choices": [choice],
                               "usage": {"prompt_tokens": 100, "completion_tokens": self.chunks,
                                         "total_tokens": 100 + self.chunks}}
        params = self._d_params(body)
        out["kv_transfer_params"] = params  # 0.32 and 0.33 both put them in non-streamed bodies
        if self.style in ("notify", "both", "conflict", "kept_nothing"):
            self._spawn(self._notify(body, params))
        return web.json_response(out)

    def _chunk(self, chat: bool, text: str, index: int, finish: str | None = None, **extra: Any) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        chunk = {"id": "cmpl-d", "object": "chat.completion.chunk" if chat else "text_completion", "model": "fake-model",
                 "choices": [choice]}
        chunk.update(extra)
        return chunk

    async def _stream(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        chat = "messages" in body
        tag = prompt_tag(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        params = self._d_params(body)

        async def send(obj: Any) -> None:
            raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
            await resp.write(b"data: " + raw + b"\n\n")

        if chat:
            await send({"id": "cmpl-d", "object": "chat.completion.chunk", "model": "fake-model",
                        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        await resp.write(b": keep-alive\n\n")
        for i in range(self.chunks):
            if self.fault in ("kill_mid_stream", "stall", "error_event", "no_done") and i == self.fault_after:
                return await self._mid_stream_fault(request, resp, send)
            if self.chunk_delay_s:
                await asyncio.sleep(self.chunk_delay_s)
            last = i == self.chunks - 1
            extra: dict[str, Any] = {}
            if body.get("return_token_ids"):
                extra["token_ids"] = [1000 + i]
            chunk = self._chunk(chat, f"<{tag}:{i}>", i, "stop" if last else None)
            chunk["choices"][0].update(extra)
            if chat and self.reasoning and i == 0:
                chunk["choices"][0]["delta"]["reasoning_content"] = "let me think"
            if last and self.style == "conflict":
                await self._notify(body, params)  # the notification is there before the final chunk
            if last and self.style in ("final_chunk", "both", "conflict"):
                chunk["kv_transfer_params"] = params if self.style != "conflict" else dict(params, remote_block_ids=[[99]])
            if last and self.fault == "malformed_final":
                await send(b'{"choices": [{"index": 0, "text": "trunc')  # not JSON
                continue
            await send(chunk)
        if self.style in ("notify", "both", "kept_nothing"):
            self._spawn(self._notify(body, params))
        if self.fault == "inject_events":
            for raw in self.inject:
                await resp.write(raw + b"\n\n" if raw.startswith(b":") else b"data: " + raw + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _mid_stream_fault(self, request: web.Request, resp: web.StreamResponse, send) -> web.StreamResponse:
        if self.fault == "kill_mid_stream":
            await resp.write(b'data: {"choices": [{"index": 0, "te')  # half an event, then the process "dies"
            request.transport.close()
            return resp
        if self.fault == "stall":
            await asyncio.sleep(self.slow_s)
            return resp
        if self.fault == "error_event":
            await send({"error": {"message": "engine died", "type": "InternalServerError", "code": 500}})
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()  # no_done: a clean end without [DONE]
        return resp

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _notify(self, body: dict[str, Any], params: dict[str, Any]) -> None:
        """What our connector does inside D on vLLM 0.32: post the params to the router."""
        spec = (body.get("kv_transfer_params") or {}).get("bidikv_notify")
        if not spec:
            return
        if self.notify_delay_s:
            await asyncio.sleep(self.notify_delay_s)
        payload = {"turn": spec["turn"], "token": self.notify_token_override or spec["token"],
                   "kv_transfer_params": params, "expires_in_s": D_TTL_S}
        if self.style == "kept_nothing":
            payload = {"turn": spec["turn"], "token": payload["token"], "retained": False}
        try:
            async with self._session.post(spec["url"], json=payload, timeout=aiohttp.ClientTimeout(total=2)) as r:
                self.notify_replies.append(r.status)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            self.notify_replies.append(-1)

    # -- what tests inspect ---------------------------------------------------------------------
    def prefill_requests(self) -> list[dict[str, Any]]:
        return [r.body for r in self.received if self._is_prefill_request(r.body)]

    def decode_requests(self) -> list[dict[str, Any]]:
        return [r.body for r in self.received if not self._is_prefill_request(r.body)]


@dataclass
class FakeHeartbeatDecode(FakeVllmUpstream):
    """A fake D that also runs a heartbeat listener on a port of its own, as the connector does; a
    subclass answers in ``_heartbeat`` (impl.connector.heartbeat's protocol, not its code) and records
    in ``held`` the expiry of each request it holds, on its own clock."""

    heartbeats: list[dict[str, Any]] = field(default_factory=list)
    held: dict[str, float] = field(default_factory=dict)  # D request id -> expiry on D's clock
    hb_port: int = 0
    _hb_runner: web.AppRunner | None = None

    async def start(self, port: int = 0) -> "FakeHeartbeatDecode":
        await super().start(port)
        app = web.Application()
        app.router.add_post("/bidikv/heartbeat", self._heartbeat)
        self._hb_runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._hb_runner.setup()
        site = web.TCPSite(self._hb_runner, "127.0.0.1", 0)
        await site.start()
        self.hb_port = site._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        await self.stop_listener()
        await super().stop()

    async def stop_listener(self) -> None:
        if self._hb_runner is not None:
            await self._hb_runner.cleanup()
            self._hb_runner = None

    async def _heartbeat(self, request: web.Request) -> web.Response:
        raise NotImplementedError
