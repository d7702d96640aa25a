"""A minimal OpenAI-compatible client for the end-to-end tests (stdlib only).

Two ways to drive a turn: through the router (``chat``), or directly the way vLLM's example proxy
does (``direct_turn``: P with ``max_tokens=1`` and ``do_remote_decode``, then D with P's params,
non-streamed so that D's own ``kv_transfer_params`` come back in the body on 0.32).
"""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

from tests.e2e.deployment import MODEL_NAME
from tests.e2e.tiny_model import generation_logit_bias

# No EOS (every answer has exactly max_tokens tokens), think markers only where the chat template puts
# them, printable ASCII only (see tiny_model.generation_logit_bias).
NO_EOS_BIAS = generation_logit_bias()


@dataclass
class TurnResult:
    text: str
    ttft_s: float | None
    total_s: float
    kv_transfer_params: dict[str, Any] | None = None
    headers: dict[str, str] | None = None  # the router's per-turn X-Bidikv-* headers
    prefill_params: dict[str, Any] | None = None  # direct_turn: what P returned (incl. its reuse report)
    prompt_token_ids: list[int] | None = None  # with return_token_ids (a plain server)
    token_ids: list[int] | None = None


def request_body(messages: list[dict[str, Any]], max_tokens: int, stream: bool, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "logit_bias": NO_EOS_BIAS, "stream": stream}
    body.update(extra)
    return body


def _post(url: str, body: dict[str, Any], timeout: float, api_key: str | None = None):
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    return urllib.request.urlopen(req, timeout=timeout)


def chat_usage(base_url: str, messages: list[dict[str, Any]], max_tokens: int, timeout: float = 120.0,
               **extra: Any) -> tuple[str, int]:
    """One non-streamed chat turn: the answer and the server's ``usage.prompt_tokens``."""
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "stream": False, **extra}
    with _post(base_url + "/v1/chat/completions", body, timeout) as resp:
        obj = json.loads(resp.read())
    return obj["choices"][0]["message"]["content"] or "", int(obj["usage"]["prompt_tokens"])


def chat(base_url: str, messages: list[dict[str, Any]], max_tokens: int = 48, stream: bool = True,
         timeout: float = 180.0, api_key: str | None = None, **extra: Any) -> TurnResult:
    """One chat turn against ``base_url`` (a router or a plain vLLM server)."""
    body = request_body(messages, max_tokens, stream, **extra)
    t0 = time.monotonic()
    if not stream:
        with _post(base_url + "/v1/chat/completions", body, timeout, api_key) as resp:
            obj = json.loads(resp.read())
        total = time.monotonic() - t0
        if "choices" not in obj:
            raise RuntimeError(f"no choices in {obj}")
        choice = obj["choices"][0]
        return TurnResult(choice["message"]["content"] or "", None, total, obj.get("kv_transfer_params"),
                          prompt_token_ids=obj.get("prompt_token_ids"), token_ids=choice.get("token_ids"))
    text, ttft, params = "", None, None
    with _post(base_url + "/v1/chat/completions", body, timeout, api_key) as resp:
        headers = {k: v for k, v in resp.headers.items() if k.lower().startswith("x-bidikv")}
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"error event: {event}")
            if event.get("kv_transfer_params"):
                params = event["kv_transfer_params"]
            for choice in event.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.monotonic() - t0
                    text += piece
    return TurnResult(text, ttft, time.monotonic() - t0, params, headers=headers)


def complete_ids(base_url: str, prompt: list[int] | str, max_tokens: int, timeout: float = 180.0, **extra: Any) -> TurnResult:
    """One non-streamed ``/v1/completions`` turn (token ids or a string); the ids come back (``return_token_ids``)."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "logit_bias": NO_EOS_BIAS, "stream": False, "return_token_ids": True, **extra}
    t0 = time.monotonic()
    with _post(base_url + "/v1/completions", body, timeout) as resp:
        headers = {k: v for k, v in resp.headers.items() if k.lower().startswith("x-bidikv")}
        obj = json.loads(resp.read())
    choice = obj["choices"][0]
    return TurnResult(choice.get("text") or "", None, time.monotonic() - t0, obj.get("kv_transfer_params"),
                      headers=headers, prompt_token_ids=choice.get("prompt_token_ids") or obj.get("prompt_token_ids"),
                      token_ids=choice.get("token_ids"))


def direct_turn(prefill_url: str, decode_url: str, messages: list[dict[str, Any]], max_tokens: int,
                d_params: dict[str, Any] | None, timeout: float = 180.0, **extra: Any) -> TurnResult:
    """P then D like vLLM's proxy; ``d_params`` are D's params of the previous turn (or None)."""
    p_params = dict(d_params) if d_params else {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}
    p_params["do_remote_decode"], p_params["do_remote_prefill"] = True, False
    t0 = time.monotonic()
    body = request_body(messages, 1, False, kv_transfer_params=p_params, **extra)
    with _post(prefill_url + "/v1/chat/completions", body, timeout) as resp:
        p_obj = json.loads(resp.read())
    body = request_body(messages, max_tokens, False, kv_transfer_params=p_obj.get("kv_transfer_params"), **extra)
    with _post(decode_url + "/v1/chat/completions", body, timeout) as resp:
        d_obj = json.loads(resp.read())
    return TurnResult(d_obj["choices"][0]["message"]["content"] or "", None, time.monotonic() - t0,
                      d_obj.get("kv_transfer_params"), prefill_params=p_obj.get("kv_transfer_params"))
