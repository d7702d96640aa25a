"""Continuation guard: does a new prompt really continue the sequence whose KV a decode node holds?

Upstream checks nothing (vLLM #43094, #44838): a client that rewrites history (strips reasoning,
edits an answer) gets the old KV for the new text. The store keeps ``(held_len, held_digest)`` of the
sequence D holds and reuses KV only if the new prompt's first ``held_len`` items hash the same.
Items are token ids when the caller has them, else canonical message strings (see
:func:`canonical_messages`); both go through one digest.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Protocol, Sequence


class PromptView(Protocol):
    """What the guard needs of a prompt: its length in items and the digest of any prefix."""

    @property
    def length(self) -> int: ...

    def prefix_digest(self, n: int) -> str: ...


class RunningDigest:
    """:func:`sequence_digest` item by item: the digest of every prefix in one pass over the items."""

    __slots__ = ("_h",)

    def __init__(self) -> None:
        self._h = hashlib.blake2b(digest_size=16)

    def update(self, item: int | str) -> None:
        if type(item) is str:  # a message (the router's every turn): one call into the hash
            data = item.encode("utf-8")
            self._h.update(b"s" + len(data).to_bytes(4, "little") + data)
            return
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise TypeError(f"sequence items must be int token ids or str, got {type(item).__name__}")
        data = item.encode("utf-8") if isinstance(item, str) else str(item).encode("ascii")
        self._h.update((b"s" if isinstance(item, str) else b"i") + len(data).to_bytes(4, "little") + data)

    def copy(self) -> "RunningDigest":
        other = RunningDigest.__new__(RunningDigest)
        other._h = self._h.copy()
        return other

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def sequence_digest(items: Iterable[int | str]) -> str:
    """Collision-resistant digest of a token-id or message sequence (length-prefixed, so no two differ)."""
    running = RunningDigest()
    for item in items:
        running.update(item)
    return running.hexdigest()


@dataclass(frozen=True, slots=True)
class ItemsPrompt:
    """A prompt given as its items (token ids or canonical messages)."""

    items: Sequence[int | str]

    @property
    def length(self) -> int:
        return len(self.items)

    def prefix_digest(self, n: int) -> str:
        if n > len(self.items):
            raise ValueError(f"prefix of {n} items requested from a prompt of {len(self.items)}")
        return sequence_digest(self.items[:n])


@dataclass(frozen=True, slots=True)
class KnownPrefixes:
    """A prompt given as its items, with the digests of some prefixes already known (computed in the
    same pass that made the history keys: impl.policy.history_key), so the guard does not hash again."""

    items: Sequence[int | str]
    known: Mapping[int, str]

    @property
    def length(self) -> int:
        return len(self.items)

    def prefix_digest(self, n: int) -> str:
        digest = self.known.get(n)
        if digest is not None:
            return digest
        if n > len(self.items):
            raise ValueError(f"prefix of {n} items requested from a prompt of {len(self.items)}")
        return sequence_digest(self.items[:n])


_encode_str = json.JSONEncoder(ensure_ascii=False).encode


def canonical_messages(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """One canonical string per chat message (role + content, keys sorted), for the digest.

    Content parts are kept as JSON so a list of parts and the equivalent string do not collide.
    """
    out = []
    for i, message in enumerate(messages):
        if type(message) is dict and len(message) == 2 and type(message.get("role")) is str \
                and type(message.get("content")) is str:
            # the router's hot path (a plain text message, every turn): the same string the general
            # case builds, without sorting and walking a dict (about 2x faster)
            out.append('{"content":' + _encode_str(message["content"]) + ',"role":' + _encode_str(message["role"]) + "}")
            continue
        if not isinstance(message, Mapping) or "role" not in message:
            raise ValueError(f"messages[{i}] must be an object with a 'role'")
        out.append(json.dumps(dict(message), sort_keys=True, ensure_ascii=False, separators=(",", ":")))
    return out


def continues(prompt: PromptView, held_len: int, held_digest: str) -> bool:
    """True iff ``prompt`` starts with exactly the ``held_len`` items digested as ``held_digest``."""
    return held_len <= prompt.length and prompt.prefix_digest(held_len) == held_digest
