"""Which prefill instance last served a conversation: the prefix cache that likely still holds it.

A P that prefilled a conversation's last turn keeps its blocks in vLLM's prefix cache until they are
evicted, so placing the next turn there can save the prompt's recompute (the ``cached_tokens`` input of
:class:`~impl.policy.placement.PlacementRequest`). The router knows only what it sent where, so this
is a hint, not a fact: P may have evicted the blocks since.

Bounded like the conversation store (least recently served forgotten first), so a router that sees
many conversations keeps its memory: a forgotten conversation is placed without the hint.
"""

from __future__ import annotations

import collections
from typing import Hashable


class PrefillAffinity:
    """The P (and the prompt length it prefilled) each conversation was last sent to, for at most
    ``max_entries`` conversations; the least recently served is forgotten first."""

    __slots__ = ("max_entries", "_last")

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._last: collections.OrderedDict[Hashable, tuple[str, int]] = collections.OrderedDict()

    def served(self, key: Hashable, instance: str, tokens: int) -> None:
        """``instance`` prefilled ``tokens`` of the conversation ``key``."""
        last = self._last
        last[key] = (instance, tokens)
        last.move_to_end(key)
        if len(last) > self.max_entries:
            last.popitem(last=False)

    def cached_tokens(self, key: Hashable) -> dict[str, int]:
        """``PlacementRequest.cached_tokens`` for the conversation: ``{instance: tokens}`` or ``{}``."""
        last = self._last.get(key)
        return {last[0]: last[1]} if last is not None else {}

    def __len__(self) -> int:
        return len(self._last)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._last
