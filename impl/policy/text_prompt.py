"""Continuation guard view for a plain-text prompt (``/v1/completions`` with a string ``prompt``).

A text conversation grows by concatenation: turn n+1's prompt is turn n's prompt + its answer + the
new user text. Splitting the string into items (words, lines) would make the guard depend on a
tokenizer-like rule that the client never promised; instead a text prompt's items are its code
points, and the digest of a prefix of ``n`` items is the digest of that substring as one item.
So ``continues(TextPrompt(new), len(held), TextPrompt(held).prefix_digest(len(held)))`` holds iff
``new.startswith(held)``, through the same :func:`~impl.policy.continuation.continues` as token ids
and chat messages.

The digest is tagged with a marker no canonical chat message can equal (those are JSON objects),
so a text history never passes the guard for a chat conversation stored under the same id.

Known limit (also of the chat view): the guard checks content, not tokens. If retokenising
``prompt + answer`` gives other tokens than D computed (a token merge across the join, a stop string
the server stripped from the text), P can still read KV for a few positions that differ; only a
token-id prompt rules that out.
"""

from __future__ import annotations

from dataclasses import dataclass

from impl.policy.continuation import sequence_digest

TEXT_ITEM_TAG = "\x00text"  # not a JSON object: cannot equal a canonical chat message


@dataclass(frozen=True, slots=True)
class TextPrompt:
    """A string prompt viewed as a sequence of code points (see the module docstring)."""

    text: str

    @property
    def length(self) -> int:
        return len(self.text)

    def prefix_digest(self, n: int) -> str:
        if n < 0 or n > len(self.text):
            raise ValueError(f"prefix of {n} code points requested from a text of {len(self.text)}")
        return sequence_digest((TEXT_ITEM_TAG, self.text[:n]))

    def full_digest(self) -> tuple[int, str]:
        """``(held_len, held_digest)`` for storing this text as the sequence D holds."""
        return len(self.text), self.prefix_digest(len(self.text))
