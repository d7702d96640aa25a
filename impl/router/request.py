"""The client's request, parsed and validated: what the router needs before it touches an upstream.

Validation errors become 400s that name the offending field; anything vLLM itself validates
(sampling parameters, model name, lengths in tokens) is left to vLLM and its 4xx is passed back.

The prompt view -- what the continuation guard compares -- depends on what the prompt is:

* ``/v1/completions`` with ``prompt`` a list of ints: the token ids themselves. The router asks D for
  ``return_token_ids`` so the held sequence is exactly prompt ids + generated ids (D's chunks then
  carry vLLM's ``token_ids``/``prompt_token_ids`` extension fields, which OpenAI clients ignore).
  The only view that is exact at the token level.
* ``/v1/chat/completions``: one canonical string per message
  (:func:`impl.policy.canonical_messages`); D holds the prompt messages + the assistant message
  ``{"role": "assistant", "content": <answer>}``. A client that resends the answer with any other
  keys, other content, or stripped text does not continue it and gets no reuse.
* ``/v1/completions`` with a string ``prompt``: the string as code points
  (:class:`impl.policy.text_prompt.TextPrompt`); D holds prompt + answer text.
* Anything else (batched prompts, ``n``/``best_of`` > 1, beam search, ``echo``, ``suffix``,
  ``continue_final_message``): served, never reused or stored.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from impl.policy import ItemsPrompt, PromptView, canonical_messages, sequence_digest
from impl.policy.continuation import KnownPrefixes
from impl.policy.history_key import (DEFAULT_MAX_CANDIDATES, DIRECTORY_SUFFIX, HistoryKeys, PrefixAnchors,
                                     text_anchors, token_anchors)
from impl.policy.text_prompt import TextPrompt
from impl.router.log_safe import shown

Endpoint = Literal["chat", "completion"]
# How a turn finds the KV of the turn before (header X-Bidikv-Reuse-Match, metric label):
# "id": the client named the conversation; "prompt_cache_key": OpenAI's cache-routing field, taken as
# the conversation's name when no id is sent; "history": neither, looked up by the history it resends
# (impl.policy.history_key); "none": nothing to look up by (a first turn, or a request never reused)
Match = Literal["id", "prompt_cache_key", "history", "none"]
# the conversation part of a prompt_cache_key's store key (ids a client sends cannot start with NUL)
PROMPT_CACHE_KEY_PREFIX = "\x00p:"
# vLLM's cache_salt partitions the prefix cache per user: the keys the router derives (history, anchors,
# prompt_cache_key) end with this and a digest of the salt, so one salt's requests never find another's
SALT_SCOPE = "\x00s:"
MAX_CACHE_SALT_CHARS = 256
_TEXT_ANCHORS = text_anchors()
_TOKEN_ANCHORS = token_anchors()
MAX_TOKEN_ID = 2**31 - 1
# Deepest JSON nesting accepted, enforced before decoding. Real requests stay far below (a tool's
# JSON schema: ~10-20 levels); anything near Python's recursion limit (1,000 frames, shared with
# the router's own calls) would make json.dumps or the guard raise RecursionError later on.
MAX_JSON_DEPTH = 100
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string literal, escapes included
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_CURLY_TO_SQUARE = bytes.maketrans(b"{}", b"[]")


class RequestError(Exception):
    """A client error: ``status`` and a message that names the field (never a stack trace)."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.status = status


@dataclass(slots=True)
class TurnRequest:
    endpoint: Endpoint
    body: dict[str, Any]  # what goes upstream (conversation_id removed)
    conversation_id: str | None
    stream: bool
    view: PromptView | None  # None: this request is never reused nor stored
    unsupported: str | None  # why view is None
    prompt_kind: Literal["tokens", "chat", "text", "other"]
    estimated_tokens: int
    match: Match = "none"
    # with match "history": the store keys to look up, most recent first (empty: a first turn)
    history_candidates: tuple[str, ...] = ()
    _history: HistoryKeys | PrefixAnchors | None = None
    scope: str = ""  # the client's cache_salt, as the suffix of the keys the router derives ("" without one)

    def answers_in_history(self) -> int:
        """How many answers the request resends (a chat request's assistant messages; 0 otherwise): the
        turn's index in its conversation as far as the request itself tells."""
        messages = self.body.get("messages") if self.prompt_kind == "chat" else None
        if not isinstance(messages, list):
            return 0
        return sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")

    @property
    def store_id(self) -> str | None:
        """The conversation part of the key a lookup tries first: the id, or the most recent history key."""
        if self.match == "history":
            return self.history_candidates[0] if self.history_candidates else None
        return self.conversation_id

    def stored_id(self, answer: str, output_token_ids: list[int] | None) -> str | None:
        """The conversation part of the key this turn is stored under once D answered ``answer``."""
        if self.match != "history" or self._history is None:
            return self.conversation_id
        if isinstance(self._history, HistoryKeys):
            return self._history.after_answer(answer) + self.scope
        held = self._held_units(answer, output_token_ids)
        return None if held is None else self._history.stored(held) + self.scope

    @property
    def anchored(self) -> bool:
        """A completion looked up by anchors: its candidates are directories of held lengths."""
        return self.match == "history" and isinstance(self._history, PrefixAnchors)

    def exact_ids(self, lengths: list[int]) -> list[str]:
        """The store keys of this prompt's prefixes of ``lengths`` units (an anchored completion)."""
        return [k + self.scope for k in self._history.exact(self.body["prompt"], lengths)]

    def anchor_directory(self, answer: str, output_token_ids: list[int] | None) -> tuple[str, int] | None:
        """The directory this turn's held sequence is listed in, and its length (an anchored completion)."""
        held = self._held_units(answer, output_token_ids)
        return None if held is None else (self._history.directory(held) + self.scope, len(held))

    def _held_units(self, answer: str, output_token_ids: list[int] | None) -> Any:
        if self.prompt_kind == "text":
            return self.body["prompt"] + answer
        if output_token_ids is None:
            return None
        return list(self.body["prompt"]) + list(output_token_ids)

    def held_length(self, answer: str, output_token_ids: list[int] | None) -> int:
        """The length of what D holds after this turn in :meth:`held_sequence`'s units (messages with the
        answer, code points, token ids), without its digest; 0 when it cannot be told."""
        if self.prompt_kind == "chat":
            return self.view.length + 1 if self.view is not None else 0
        if self.prompt_kind == "text":
            return len(self.body["prompt"]) + len(answer)
        if self.prompt_kind == "tokens":
            return len(self.body["prompt"]) + len(output_token_ids or ())
        return 0

    def held_sequence(self, answer: str, output_token_ids: list[int] | None) -> tuple[int, str] | None:
        """``(held_len, held_digest)`` of what D holds after this turn, or None if it cannot be told."""
        if self.prompt_kind == "chat":
            if isinstance(self._history, HistoryKeys):
                digest, is_guard_digest = self._history.after_answer_digest(answer)
                if is_guard_digest:  # the history keys' pass already hashed exactly these items
                    return self.view.length + 1, digest
            items = list(self.view.items) + canonical_messages([{"role": "assistant", "content": answer}])
            return len(items), sequence_digest(items)
        if self.prompt_kind == "text":
            return TextPrompt(self.body["prompt"] + answer).full_digest()
        if self.prompt_kind == "tokens":
            if output_token_ids is None or not all(_is_token_id(t) for t in output_token_ids):
                return None
            items = list(self.body["prompt"]) + list(output_token_ids)
            return len(items), sequence_digest(items)
        return None


def _too_deep(raw: bytes, limit: int) -> bool:
    """Whether the JSON text ``raw`` nests arrays/objects deeper than ``limit``, without decoding it."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False  # the common case: too few brackets to get there
    skeleton = _JSON_STRING.sub(b"", raw).translate(_CURLY_TO_SQUARE, _NOT_BRACKETS)
    # each pass removes exactly the innermost level (pairs that become adjacent only do next pass)
    for _ in range(limit):
        shorter = skeleton.replace(b"[]", b"")
        if len(shorter) == len(skeleton):
            return False  # nothing left, or unbalanced: the decoder reports that
        skeleton = shorter
    return b"[]" in skeleton


class _NotJSONNumber(ValueError):
    pass


def _refuse_constant(name: str) -> float:
    raise _NotJSONNumber(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: valid JSON grammar, but re-encoded upstream it is "Infinity"
        raise _NotJSONNumber(f"{text} is beyond the float range")
    return value


# built once: json.loads with hooks would build a decoder and its scanner on every call
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)


def parse_json_body(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    if _too_deep(raw, max_depth):
        raise RequestError("body", f"JSON nested deeper than {max_depth} levels")
    # JSON between systems is UTF-8 (RFC 8259 section 8.1), as the OpenAI API takes it. json.loads would
    # also take UTF-16 and UTF-32, which the byte-level checks (kv_transfer_params at any depth) cannot see
    encoding = json.detect_encoding(raw)
    if encoding not in ("utf-8", "utf-8-sig"):
        raise RequestError("body", f"must be UTF-8 JSON (RFC 8259), got {encoding}")
    try:
        body = _DECODER.decode(raw.decode(encoding, "surrogatepass"))
    except UnicodeDecodeError:
        raise RequestError("body", "must be UTF-8 JSON") from None
    except RecursionError:
        raise RequestError("body", "JSON nested too deeply") from None
    except _NotJSONNumber as e:
        raise RequestError("body", f"invalid JSON ({e})") from None
    except ValueError as e:  # JSONDecodeError, or an integer beyond Python's digit limit
        raise RequestError("body", f"invalid JSON ({type(e).__name__})") from None
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    return body


def _is_token_id(x: Any) -> bool:
    return type(x) is int and 0 <= x <= MAX_TOKEN_ID


def _check_encodable(value: str, field: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(field, "contains an unpaired surrogate (not valid Unicode text)") from None


def _optional_int(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int or value < minimum:
        raise RequestError(name, f"must be an integer >= {minimum}")
    return value


def parse_turn(endpoint: Endpoint, body: dict[str, Any], header_conversation_id: str | None, max_id_len: int,
               header_session_id: str | None = None, history_lookups: int = DEFAULT_MAX_CANDIDATES) -> TurnRequest:
    """``history_lookups``: most history keys a request without an id is looked up under (0: none)."""
    conversation_id = _conversation_id(body.pop("conversation_id", None), header_conversation_id, max_id_len)
    # vLLM's own session key (PR #48048: body "session_id", header X-Session-ID) names the conversation
    # too; removed from what goes upstream like conversation_id (vLLM 0.32 predates the field)
    session_id = _conversation_id(body.pop("session_id", None), header_session_id, max_id_len, "session_id", "X-Session-ID")
    if conversation_id is not None and session_id is not None and conversation_id != session_id:
        raise RequestError("session_id", "names another conversation than conversation_id / X-Conversation-Id")
    conversation_id = conversation_id if conversation_id is not None else session_id
    if "kv_transfer_params" in body:
        raise RequestError("kv_transfer_params", "is set by the router; clients must not send it")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream", "must be a boolean")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("model", "must be a string")
    if isinstance(model, str):
        _check_encodable(model, "model")
    _optional_int(body, "max_tokens", 1)
    _optional_int(body, "max_completion_tokens", 1)
    n = _optional_int(body, "n", 1) or 1
    best_of = _optional_int(body, "best_of", 1) or 1
    for flag in ("echo", "use_beam_search", "continue_final_message"):
        if flag in body and not isinstance(body[flag], bool):
            raise RequestError(flag, "must be a boolean")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise RequestError("stream_options", "must be an object")

    if endpoint == "chat":
        kind, view, estimated = _chat_view(body)
    else:
        kind, view, estimated = _completion_view(body)

    unsupported = None
    if n > 1 or best_of > 1:
        unsupported = "n or best_of > 1"
    elif body.get("use_beam_search") or body.get("echo") or body.get("continue_final_message"):
        unsupported = "beam search, echo or continue_final_message"
    elif body.get("suffix") is not None:
        unsupported = "suffix"
    elif kind == "other":
        unsupported = "batched prompt"
    if unsupported is not None:
        view, kind = None, "other"
    turn = TurnRequest(endpoint, body, conversation_id, stream, view, unsupported, kind, estimated)
    if view is None:
        return turn
    if conversation_id is not None:
        turn.match = "id"  # the client named it: its own namespace within the tenant, salt or not
        return turn
    turn.scope = salt_scope(client_cache_salt(body))
    cache_key = body.get("prompt_cache_key")
    if cache_key is not None:
        if not isinstance(cache_key, str):
            raise RequestError("prompt_cache_key", "must be a string")
        turn.conversation_id = (PROMPT_CACHE_KEY_PREFIX + check_conversation_id(cache_key, max_id_len, "prompt_cache_key")
                                + turn.scope)
        turn.match = "prompt_cache_key"
        return turn
    if history_lookups <= 0:
        return turn
    if kind == "chat":
        keys = HistoryKeys(body["messages"], history_lookups, view.items)
        turn.history_candidates = tuple(keys.candidates)
        if keys.guard_digests:
            turn.view = KnownPrefixes(view.items, keys.guard_digests)
        history: HistoryKeys | PrefixAnchors = keys
    else:
        anchors = _TEXT_ANCHORS if kind == "text" else _TOKEN_ANCHORS
        if anchors.max_candidates != history_lookups:
            anchors = (text_anchors if kind == "text" else token_anchors)(max_candidates=history_lookups)
        history = anchors
        units = body["prompt"]
        turn.history_candidates = tuple(anchors.candidates(units))
    if turn.scope:
        turn.history_candidates = tuple(c + turn.scope for c in turn.history_candidates)
    turn.match, turn._history = "history", history
    return turn


def client_cache_salt(body: dict[str, Any]) -> str | None:
    """The client's ``cache_salt`` (vLLM's per-user prefix-cache partition), validated as vLLM takes it."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT_CHARS):
        raise RequestError("cache_salt", f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
    if salt is not None:
        _check_encodable(salt, "cache_salt")
    return salt


def salt_scope(salt: str | None) -> str:
    """The suffix of a salted request's derived keys: a digest of the salt (never the salt itself)."""
    if salt is None:
        return ""
    return SALT_SCOPE + hashlib.blake2b(salt.encode("utf-8"), digest_size=8, person=b"bidikv-salt").hexdigest()


def refuse_nested_kv_params(body: dict[str, Any], raw: bytes) -> None:
    """``kv_transfer_params`` anywhere in the body (``vllm_xargs.kv_transfer_params``, inside a message
    ...): vLLM merges some of those places into what its connector reads, so every one is refused like
    the top-level field. vLLM matches the key exactly, so the raw text can spell it only literally or
    with an escape; without either the walk is skipped (substring searches: ~1 us for 5 KB, where a
    case-insensitive regex took ~50 us)."""
    if b"kv_transfer_params" not in raw and (b"\\" not in raw or b"\\u" not in raw):  # one-byte search first: memchr
        return
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                where = f"{path}.{key}" if path else key
                if key == "kv_transfer_params":
                    raise RequestError(where, "is set by the router; clients must not send it, at any depth")
                if isinstance(value, (dict, list)):
                    stack.append((where, value))
        elif isinstance(node, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(node) if isinstance(v, (dict, list)))


def check_context_budget(turn: "TurnRequest", max_model_len: int) -> None:
    """Refuse what no instance can serve: ``max_tokens`` (or ``max_completion_tokens``) beyond the
    model's context, or token ids that with it exceed the context."""
    prompt_len = len(turn.body["prompt"]) if turn.prompt_kind == "tokens" else 0
    if prompt_len >= max_model_len:
        raise RequestError("prompt", f"{prompt_len} tokens leave no room in the model's context of {max_model_len}")
    for name in ("max_tokens", "max_completion_tokens"):
        value = turn.body.get(name)
        if type(value) is int and prompt_len + value > max_model_len:
            what = f"{value}" if not prompt_len else f"{value} (+ {prompt_len} prompt tokens)"
            raise RequestError(name, f"{what} exceeds the model's context of {max_model_len} tokens")


def _conversation_id(from_body: Any, from_header: str | None, max_len: int, field: str = "conversation_id",
                     header: str = "X-Conversation-Id") -> str | None:
    if from_body is not None and not isinstance(from_body, str):
        raise RequestError(field, "must be a string")
    if from_body is not None and from_header is not None and from_body != from_header:
        raise RequestError(field, f"body field and {header} header disagree")
    cid = from_body if from_body is not None else from_header
    return None if cid is None else check_conversation_id(cid, max_len, field)


def check_conversation_id(cid: str, max_len: int, field: str = "conversation_id") -> str:
    """A conversation id from a body, a header or a URL path: 1..max_len characters of valid Unicode,
    not starting with NUL (the router's own keys do: impl.policy.history_key)."""
    if not cid or len(cid) > max_len:
        raise RequestError(field, f"must be 1..{max_len} characters")
    if cid[0] == "\x00":
        raise RequestError(field, "must not start with a NUL character")
    _check_encodable(cid, field)
    return cid


def shown_id(cid: str) -> str:
    """A store key's conversation part as logs show it: the router's own keys by kind and a digest
    suffix; what the client chose (an id, a prompt_cache_key) escaped and cut (impl.router.log_safe)."""
    if cid.startswith("\x00"):
        cid, scoped, _ = cid.partition(SALT_SCOPE)
        cid = cid.removesuffix(DIRECTORY_SUFFIX)
        kind = {"h": "history", "t": "text", "i": "tokens", "p": "prompt_cache_key"}.get(cid[1:2], "key")
        text = f"{kind}:{shown(cid[-12:])}" if kind != "prompt_cache_key" else f"{kind}:{shown(cid[3:])}"
        return text + (" (salted)" if scoped else "")
    return shown(cid)


def _chat_view(body: dict[str, Any]) -> tuple[str, PromptView | None, int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "must be a non-empty array of messages")
    chars = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}]", "must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(f"messages[{i}].role", "must be a non-empty string")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(f"messages[{i}].content", "must be a string, an array of parts or null")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict):
                    raise RequestError(f"messages[{i}].content[{j}]", "must be an object")
                text = part.get("text")
                if isinstance(text, str):
                    chars += len(text)
    try:
        items = canonical_messages(messages)
    except (TypeError, ValueError, RecursionError):  # values json cannot re-encode
        raise RequestError("messages", "contains values that cannot be re-encoded as JSON") from None
    for i, item in enumerate(items):
        _check_encodable(item, f"messages[{i}]")
    return "chat", ItemsPrompt(items), max(1, chars // 4)


def _completion_view(body: dict[str, Any]) -> tuple[str, PromptView | None, int]:
    if "prompt" not in body:
        raise RequestError("prompt", "is required")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt", "must not be empty")
        _check_encodable(prompt, "prompt")
        return "text", TextPrompt(prompt), max(1, len(prompt) // 4)
    if isinstance(prompt, list) and prompt:
        if all(type(t) is int for t in prompt):
            for i, t in enumerate(prompt):
                if not _is_token_id(t):
                    raise RequestError(f"prompt[{i}]", f"token ids must be integers in 0..{MAX_TOKEN_ID}")
            return "tokens", ItemsPrompt(tuple(prompt)), len(prompt)
        if all(isinstance(p, str) for p in prompt):
            for i, p in enumerate(prompt):
                _check_encodable(p, f"prompt[{i}]")
            return "other", None, max(1, sum(len(p) for p in prompt) // 4)
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
            return "other", None, sum(len(p) for p in prompt)
    raise RequestError("prompt", "must be a string, an array of token ids, an array of strings or an array of token-id arrays")
