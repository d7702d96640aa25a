"""What the router learns from D's response: the answer (for the guard), D's ``kv_transfer_params``
(on vLLM 0.33 in the final SSE chunk; in non-streamed bodies on both versions), and whether the
turn really finished.

A turn is *complete* only if D's stream ended with ``data: [DONE]`` and carried no error event and
no undecodable event. Only a complete turn is stored: a cut stream, an error or garbage leaves the
previous entry untouched (the store is not consumed by a lookup, so the client's retry still
reuses the turn before).

D's block locations are never forwarded to clients: an event or body carrying
``kv_transfer_params`` is re-encoded without it (a client that learnt them could otherwise hand
them back and read another conversation's KV; the router also refuses client-supplied params).

The answer is rebuilt from choice 0's ``delta.content`` (chat) or ``text`` (completions). Deltas
the router cannot turn back into the exact message a client will resend (tool calls, reasoning
fields, other choices) mark the turn *unreconstructable*: it is not stored and the next turn
recomputes -- the same choice as vLLM PR #44838.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# Events are decoded a batch at a time as they arrive: a 90k-token answer is never held as 90k raw events
# (~120 MB with its parse, measured), and the end of a stream decodes at most a batch (a few hundred us)
# instead of pausing the event loop for the whole answer. One parse per batch keeps the per-event cost
# of the client's path a list append.
DECODE_BATCH_EVENTS = 256
_UNRECONSTRUCTABLE_DELTA_KEYS = ("tool_calls", "function_call", "reasoning_content", "reasoning")
_PLAIN_MESSAGE_KEYS = frozenset({"role", "content"})
REQUIRED_DECODE_PARAMS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids")


@dataclass(slots=True)
class TurnCapture:
    chat: bool
    answer_parts: list[str] = field(default_factory=list)
    output_token_ids: list[int] | None = None
    kv_params: dict[str, Any] | None = None
    finish_reason: str | None = None
    done: bool = False
    error: str | None = None  # D reported an error (error event / error body)
    malformed: bool = False  # an event or body that is not a JSON object
    unreconstructable: str | None = None
    events: int = 0
    content_pieces: int = 0  # non-empty streamed content/text pieces of choice 0 (one per token as vLLM streams)
    completion_tokens: int | None = None  # D's usage, when it sent one
    first_token_s: float | None = None  # since the turn arrived (set by the proxy)
    _pending: list[bytes | dict[str, Any]] = field(default_factory=list)

    @property
    def answer(self) -> str:
        return "".join(self.answer_parts)

    @property
    def complete(self) -> bool:
        """Meaningful after :meth:`finish`."""
        return self.done and self.error is None and not self.malformed

    # -- streaming -------------------------------------------------------------------------------
    def on_event(self, data: bytes) -> bytes | None:
        """Account one SSE data payload; returns a replacement payload if it must be rewritten.

        Only the event carrying ``kv_transfer_params`` is decoded here (it must be rewritten before
        it is forwarded); the others are kept raw and decoded a batch at a time
        (:data:`DECODE_BATCH_EVENTS`), which keeps the per-event cost on the client's path to a
        substring test and the memory of a long answer to its text.
        """
        if data == b"[DONE]":
            self.done = True
            return None
        self.events += 1
        if b'"kv_transfer_params"' not in data:
            self._pending.append(data)
            if len(self._pending) >= DECODE_BATCH_EVENTS:
                self._drain()
            return None
        obj = _loads_object(data)
        if obj is None:
            self._pending.append(data)  # garbage: finish() flags it
            return None
        params = obj.get("kv_transfer_params")
        self._pending.append(obj)
        if not isinstance(params, dict) or not params:
            return None  # the name inside a string, or "kv_transfer_params": null -- nothing to hide
        del obj["kv_transfer_params"]
        self.kv_params = params
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")

    def finish(self) -> "TurnCapture":
        """Decode the events still kept raw (at most a batch: see :data:`DECODE_BATCH_EVENTS`)."""
        self._drain()
        return self

    def _drain(self) -> None:
        """Decode the events kept raw: one JSON parse of all of them, event by event only if that fails;
        what the capture needs of them is folded in and the raw bytes dropped."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        raw = [p for p in pending if isinstance(p, bytes)]
        decoded: list[Any] | None = None
        if raw:
            try:
                decoded = json.loads(b"[" + b",".join(raw) + b"]")
            except (ValueError, RecursionError):
                decoded = None
            if not isinstance(decoded, list) or len(decoded) != len(raw):
                decoded = [_loads_object(p) for p in raw]
        it = iter(decoded or ())
        for p in pending:
            obj = next(it) if isinstance(p, bytes) else p
            if not isinstance(obj, dict):
                self.malformed = True
                continue
            if "error" in obj or obj.get("object") == "error":
                self.error = _error_message(obj)
                continue
            self._on_choices(obj.get("choices"), streaming=True)
            if "usage" in obj:
                self._on_usage(obj["usage"])
        if len(self.answer_parts) > 1:  # one string per batch, not one object per token
            self.answer_parts[:] = ["".join(self.answer_parts)]

    # -- non-streaming ---------------------------------------------------------------------------
    def on_body(self, obj: Any) -> Any:
        """Account a whole JSON response; returns the body to send the client (params removed)."""
        if not isinstance(obj, dict):
            self.malformed = True
            return obj
        if "error" in obj or obj.get("object") == "error":
            self.error = _error_message(obj)
            return obj
        self._on_choices(obj.get("choices"), streaming=False)
        self._on_usage(obj.get("usage"))
        params = obj.pop("kv_transfer_params", None)
        if isinstance(params, dict) and params:
            self.kv_params = params
        self.done = True
        return obj

    def _on_usage(self, usage: Any) -> None:
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if type(tokens) is int and tokens >= 0:
            self.completion_tokens = tokens

    @property
    def output_tokens(self) -> int | None:
        """Tokens D generated: its usage, else the token ids it returned, else the pieces it streamed."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        if self.output_token_ids is not None:
            return len(self.output_token_ids)
        return self.content_pieces or None

    def _on_choices(self, choices: Any, streaming: bool) -> None:
        if choices is None:
            return
        if not isinstance(choices, list):
            self.malformed = True
            return
        for choice in choices:
            if not isinstance(choice, dict):
                self.malformed = True
                continue
            if choice.get("index", 0) != 0:
                self.unreconstructable = "several choices"
                continue
            if self.chat:
                part = choice.get("delta" if streaming else "message")
                if isinstance(part, dict):
                    content = part.get("content")
                    if isinstance(content, str):
                        self.answer_parts.append(content)
                        self.content_pieces += streaming and content != ""
                    elif content is not None:
                        self.unreconstructable = "non-text content"
                    if len(part) > 2 or not part.keys() <= _PLAIN_MESSAGE_KEYS:  # rare: look closer
                        for key in _UNRECONSTRUCTABLE_DELTA_KEYS:
                            if part.get(key):
                                self.unreconstructable = key
            else:
                text = choice.get("text")
                if isinstance(text, str):
                    self.answer_parts.append(text)
                    self.content_pieces += streaming and text != ""
            token_ids = choice.get("token_ids")
            if isinstance(token_ids, list):
                if self.output_token_ids is None:
                    self.output_token_ids = []
                self.output_token_ids.extend(token_ids)
            reason = choice.get("finish_reason")
            if reason is not None:
                self.finish_reason = str(reason)


def _loads_object(data: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def _error_message(obj: dict[str, Any]) -> str:
    err = obj.get("error", obj)
    if isinstance(err, dict):
        return str(err.get("message") or err.get("type") or "upstream error")[:500]
    return str(err)[:500]


def decode_params_problem(params: Any) -> str | None:
    """Why D's params cannot be offered to P next turn, or None if they can."""
    if not isinstance(params, dict):
        return "not an object"
    missing = [k for k in REQUIRED_DECODE_PARAMS if params.get(k) in (None, "", [])]
    if missing:
        return "missing " + ",".join(missing)
    blocks = params["remote_block_ids"]
    if not isinstance(blocks, list) or not any(blocks):
        return "no blocks"
    tokens = params.get("remote_num_tokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        return "no remote_num_tokens"
    return None
