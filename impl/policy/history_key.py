"""Keys for a conversation whose client sends no id: the digest of the history it resends.

The clients people put in front of an OpenAI endpoint (the ``openai`` SDKs, chat UIs, LangChain,
agent frameworks, vLLM's ``benchmark_serving_multi_turn.py`` without ``--send-conversation-id``)
resend the whole ``messages`` list every turn and name no conversation. A later turn's messages begin
with an earlier turn's messages plus the answer D generated for it, so:

* a finished turn is stored under :meth:`HistoryKeys.after_answer` -- the digest of its prompt's
  messages plus the assistant answer, tenant-scoped like every key;
* a new request is looked up under :attr:`HistoryKeys.candidates` -- the digests of its prefixes that
  end at an assistant message, the most recent first, at most ``max_candidates`` of them.

The digest is over :func:`key_item` of each message, a normal form that forgets what clients and
SDKs change when they resend an answer but that does not change what was said: keys whose value is
null (the SDK's ``message.model_dump()`` writes ``refusal``, ``audio``, ``function_call`` ...),
reasoning (``reasoning_content``, ``reasoning``: most templates drop earlier thinking), annotations,
the streaming ``index`` of a tool call, and the spelling of a tool call's JSON arguments. For a plain
``{"role", "content"}`` message it is exactly :func:`~impl.policy.continuation.canonical_messages`'s
string, so the usual chat history costs no second pass.

What a false match costs: the key only finds an entry; whether its KV is reused is decided as for an
explicit id -- the router's continuation guard where D publishes no checkpoints, else P comparing
token ids against D's checkpoints (:mod:`impl.policy.prefix_check`) and pulling only the prefix that
agrees. A history that matches in normal form but renders to other tokens (reasoning a template keeps,
re-serialised arguments) therefore costs P one verification (a dozen hashes) and at worst recomputes
what disagrees, never serves other KV. The lookup costs at most ``max_candidates`` store reads; the
digests are one pass over the history (:class:`~impl.policy.continuation.RunningDigest`).

Completions (``/v1/completions``) have no message boundaries: the held sequence (prompt + answer, as
code points or token ids) of ``n`` units is stored under its *exact* key, the digest of all ``n``
units, and its length is added to the *directory* of its anchor -- its length rounded down to a
multiple of ``chunk`` units -- which lists the lengths of the held sequences stored beneath it. A new
prompt of ``m`` units reads the directories of the anchors at or below ``m``, the longest first, and
tries the exact keys of its own prefixes of the lengths listed there (at most ``max_lengths`` per
directory, the most recently stored first). So conversations that share a long few-shot or system
prefix -- whose anchors all fall inside it -- are told apart by what follows it, the earlier answer
included: each finds only the held sequence its own prompt continues. What still collides: two held
sequences that are equal as a whole (a regenerated answer identical to the first: the later one is
kept), and more than ``max_lengths`` different lengths under one anchor between two turns of a
conversation (the oldest length is forgotten: that turn recomputes). An answer plus a new user text
longer than ``chunk * max_candidates`` units is not found (the next turn recomputes).

A history entry is single-use: P's read frees D's blocks (vLLM's ``request_finished`` delays the free
only until the read completes), so the router takes the entry it offers instead of leaving it for a
regenerated turn to find again.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any, Callable, Mapping, Sequence

from impl.policy.continuation import RunningDigest, canonical_messages

# A stored key's conversation part. Client ids cannot start with NUL (impl.router.request refuses
# it), so a history key never meets an id a client chose.
HISTORY_PREFIX = "\x00h:"
TEXT_PREFIX = "\x00t"
TOKENS_PREFIX = "\x00i"
DEFAULT_MAX_CANDIDATES = 8
# A completion anchor's directory: its key is the anchor's + this; it lists held lengths under ANCHOR_LENGTHS_KEY
DIRECTORY_SUFFIX = "\x00d"
ANCHOR_LENGTHS_KEY = "bidikv_anchor_lengths"
DEFAULT_MAX_LENGTHS = 8
# Anchor spacing for completions: 8 candidates reach 2,048 code points / 512 tokens back from the end
# of a prompt, which covers an answer plus the next user turn of a typical completion-style chat.
DEFAULT_TEXT_CHUNK = 256
DEFAULT_TOKEN_CHUNK = 64

# Not part of what was said: dropped from the normal form (with every null value)
_DROPPED_KEYS = frozenset({"reasoning_content", "reasoning", "annotations", "refusal", "audio"})
_encode = json.JSONEncoder(ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode


def _tool_call(call: Any) -> Any:
    if not isinstance(call, Mapping):
        return call
    out = {k: v for k, v in call.items() if v is not None and k != "index"}
    function = out.get("function")
    if isinstance(function, Mapping):
        function = {k: v for k, v in function.items() if v is not None}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:  # {"a": 1} and {"a":1} are one call; the template renders its own spelling
                function["arguments"] = _encode(json.loads(arguments))
            except (ValueError, RecursionError):
                pass  # not JSON: compared as sent
        out["function"] = function
    return out


def key_item(message: Mapping[str, Any]) -> str:
    """The normal form of one chat message for history keys (see the module docstring)."""
    if type(message) is dict and len(message) == 2 and type(message.get("content")) is str \
            and type(message.get("role")) is str:
        return canonical_messages((message,))[0]  # the common case, and the guard's own string
    out = {k: v for k, v in message.items() if v is not None and k not in _DROPPED_KEYS}
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        if calls:
            out["tool_calls"] = [_tool_call(c) for c in calls]
            if out.get("content") == "":
                del out["content"]  # a tool-call message: "" and null content are sent alike
        else:
            del out["tool_calls"]
    if isinstance(out.get("function_call"), Mapping):
        out["function_call"] = _tool_call({"function": out["function_call"]})["function"]
    if len(out) == 2 and type(out.get("content")) is str and type(out.get("role")) is str:
        return canonical_messages((out,))[0]
    return _encode(out)


class HistoryKeys:
    """The history keys of one chat request: where to look it up, and where its turn is stored."""

    __slots__ = ("candidates", "guard_digests", "_state", "_plain")

    def __init__(self, messages: Sequence[Mapping[str, Any]], max_candidates: int = DEFAULT_MAX_CANDIDATES,
                 items: Sequence[str] | None = None) -> None:
        """``items``: the messages' :func:`canonical_messages` strings if the caller has them (reused
        for plain messages, whose normal form they are)."""
        running = RunningDigest()
        ends: list[str] = []
        # While every message so far is plain, the running digest is also the continuation guard's
        # digest of that prefix (sequence_digest of the canonical strings): kept, the guard need not hash
        self.guard_digests: dict[int, str] = {}
        plain_so_far = items is not None
        update = running.update
        for i, message in enumerate(messages):
            role = message.get("role")
            if plain_so_far and type(message) is dict and len(message) == 2 and type(role) is str \
                    and type(message.get("content")) is str:
                update(items[i])  # type: ignore[index]
            else:
                plain_so_far = False
                update(key_item(message))
            if role == "assistant":
                digest = running.hexdigest()
                ends.append(digest)
                if plain_so_far:
                    self.guard_digests[i + 1] = digest
        self.candidates = [HISTORY_PREFIX + d for d in reversed(ends[-max_candidates:])] if max_candidates > 0 else []
        self._state = running
        self._plain = plain_so_far

    def after_answer(self, answer: str) -> str:
        """The key of the history D holds once it has answered ``answer`` to these messages."""
        return HISTORY_PREFIX + self.after_answer_digest(answer)[0]

    def after_answer_digest(self, answer: str) -> tuple[str, bool]:
        """The digest behind :meth:`after_answer`, and whether it is also the guard's digest of the
        held sequence (every message plain: the key's normal form is the canonical string)."""
        running = self._state.copy()
        running.update(key_item({"role": "assistant", "content": answer}))
        return running.hexdigest(), self._plain


def _text_bytes(text: Any, start: int, end: int) -> bytes:
    return text[start:end].encode("utf-8", "surrogatepass")


def _token_bytes(ids: Any, start: int, end: int) -> bytes:
    return struct.pack(f"<{end - start}I", *ids[start:end])


class PrefixAnchors:
    """Anchor keys of a sequence of units (code points or token ids), one every ``chunk`` units."""

    __slots__ = ("prefix", "chunk", "max_candidates", "_encode")

    def __init__(self, prefix: str, chunk: int, max_candidates: int,
                 encode: Callable[[Any, int, int], bytes]) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.prefix, self.chunk, self.max_candidates, self._encode = prefix, chunk, max_candidates, encode

    def lengths(self, n: int) -> list[int]:
        """The anchors a prompt of ``n`` units tries, the longest first."""
        top = n - n % self.chunk
        return [a for a in range(top, top - self.chunk * self.max_candidates, -self.chunk) if a >= 0]

    def _keys(self, units: Any, lengths: Sequence[int]) -> list[str]:
        """Keys of the prefixes of ``lengths`` units, in the order given: one pass over the units."""
        h = hashlib.blake2b(digest_size=16, person=self.prefix.encode("utf-8"))
        done = 0
        keys = {}
        for n in sorted(lengths):
            h.update(self._encode(units, done, n))
            done = n
            keys[n] = f"{self.prefix}{n}:{h.hexdigest()}"
        return [keys[n] for n in lengths]

    def candidates(self, units: Any) -> list[str]:
        """The directories a prompt reads, the longest anchor first."""
        return [k + DIRECTORY_SUFFIX for k in self._keys(units, self.lengths(len(units)))]

    def exact(self, units: Any, lengths: Sequence[int]) -> list[str]:
        """The exact keys of the prefixes of ``lengths`` units (each at most ``len(units)``)."""
        return self._keys(units, lengths)

    def stored(self, held: Any) -> str:
        """The key a held sequence is stored under: the digest of all of it."""
        return self._keys(held, [len(held)])[0]

    def directory(self, held: Any) -> str:
        """The directory a held sequence's length goes into: its anchor's (length rounded down to ``chunk``)."""
        n = len(held)
        return self._keys(held, [n - n % self.chunk])[0] + DIRECTORY_SUFFIX


def anchor_lengths(params: Any, at_most: int, max_lengths: int = DEFAULT_MAX_LENGTHS) -> list[int]:
    """The held lengths a directory's params list, most recent first, those above ``at_most`` left out
    (anything that is not a list of lengths -- a damaged or foreign entry -- lists none)."""
    lengths = params.get(ANCHOR_LENGTHS_KEY) if isinstance(params, Mapping) else None
    if not isinstance(lengths, list):
        return []
    return [n for n in lengths[:max_lengths] if type(n) is int and 0 < n <= at_most]


def add_anchor_length(params: Any, n: int, max_lengths: int = DEFAULT_MAX_LENGTHS) -> dict[str, list[int]]:
    """A directory's params once a held sequence of ``n`` units is stored beneath it: ``n`` first, the
    other lengths after it, at most ``max_lengths``."""
    rest = [m for m in anchor_lengths(params, 2**63) if m != n]
    return {ANCHOR_LENGTHS_KEY: [n] + rest[:max_lengths - 1]}


def text_anchors(chunk: int = DEFAULT_TEXT_CHUNK, max_candidates: int = DEFAULT_MAX_CANDIDATES) -> PrefixAnchors:
    """Anchors of a completion prompt given as text (units: code points)."""
    return PrefixAnchors(TEXT_PREFIX, chunk, max_candidates, _text_bytes)


def token_anchors(chunk: int = DEFAULT_TOKEN_CHUNK, max_candidates: int = DEFAULT_MAX_CANDIDATES) -> PrefixAnchors:
    """Anchors of a completion prompt given as token ids."""
    return PrefixAnchors(TOKENS_PREFIX, chunk, max_candidates, _token_bytes)
