"""Memory pressure on a decode node: which retained conversations to drop to admit new work.

Retained blocks are a cache, running requests are not: a victim is only ever a finished request's
retained blocks. Victims go in order of expiry, soonest first: expired holders are garbage already,
and the one expiring next has the least future value under any TTL or lease; among equal expiries
the larger goes first (fewer drops), then the older. :func:`choose_victims` applies the order to a
snapshot; :class:`RetainedPool` keeps it incrementally for callers that hold many entries (the
simulator, the connector) and answers identically.
"""

from __future__ import annotations

from dataclasses import dataclass
import heapq
from typing import Hashable, Iterable, Iterator, Sequence


@dataclass(frozen=True, slots=True)
class BlockHolder:
    key: Hashable
    blocks: int
    expires_at: float  # math.inf for running requests or infinite retention
    running: bool = False


@dataclass(frozen=True, slots=True)
class VictimChoice:
    victims: tuple[Hashable, ...]
    freed_blocks: int
    sufficient: bool  # free + freed >= needed; False means the caller must queue, preempt or reject


def choose_victims(holders: Sequence[BlockHolder], needed_blocks: int, free_blocks: int, now: float) -> VictimChoice:
    """Name the fewest-by-order retained holders whose drop lets ``needed_blocks`` fit.

    If even dropping every retained holder is not enough, nothing is dropped (``sufficient`` is
    False): evicting reusable KV that does not make room would only lose work.
    """
    if needed_blocks < 0 or free_blocks < 0:
        raise ValueError(f"needed_blocks and free_blocks must be >= 0, got {needed_blocks}, {free_blocks}")
    short = needed_blocks - free_blocks
    if short <= 0:
        return VictimChoice((), 0, True)
    # sorted() is stable, so equal keys keep the snapshot's order (oldest first when it is in age order)
    candidates = sorted((h for h in holders if not h.running and h.blocks > 0), key=victim_order_key)
    return _take_until(((h.key, h.blocks) for h in candidates), short)


def victim_order_key(holder: BlockHolder) -> tuple[float, int]:
    return (holder.expires_at, -holder.blocks)


def _take_until(ordered: Iterable[tuple[Hashable, int]], short: int) -> VictimChoice:
    victims: list[Hashable] = []
    freed = 0
    for key, blocks in ordered:
        victims.append(key)
        freed += blocks
        if freed >= short:
            return VictimChoice(tuple(victims), freed, True)
    return VictimChoice((), 0, False)


class RetainedPool:
    """Retained (finished, reusable) holders on one node, in victim order.

    A heap with lazy deletion: ``add``/``discard`` are O(log n) amortised, and choosing victims
    costs O(k log n) for k victims instead of sorting the whole pool. Running requests never enter.
    A live holder's heap entry is the very tuple ``_live`` maps it to (one tuple per add, and a heap
    entry is live exactly when it is that object: each add's sequence number is its own).
    """

    __slots__ = ("_heap", "_live", "_seq", "blocks")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Hashable]] = []  # (expires_at, -blocks, sequence, key)
        self._live: dict[Hashable, tuple[float, int, int, Hashable]] = {}  # key -> its live heap entry
        self._seq = 0
        self.blocks = 0  # total retained blocks

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._live

    def add(self, key: Hashable, blocks: int, expires_at: float) -> None:
        if blocks <= 0:
            raise ValueError(f"retained blocks must be > 0, got {blocks}")
        if key in self._live:  # a replaced holder (discard's call only then: once per finished turn)
            self.discard(key)
        self._seq += 1
        self._live[key] = entry = (expires_at, -blocks, self._seq, key)
        self.blocks += blocks
        heapq.heappush(self._heap, entry)

    def discard(self, key: Hashable) -> int:
        """Forget ``key``; returns the blocks it held (0 if absent)."""
        entry = self._live.pop(key, None)
        if entry is None:
            return 0
        self.blocks += entry[1]
        if len(self._heap) > 2 * len(self._live) + 64:
            self._compact()
        return -entry[1]

    def blocks_of(self, key: Hashable) -> int:
        entry = self._live.get(key)
        return 0 if entry is None else -entry[1]

    def expiry(self, key: Hashable) -> float | None:
        entry = self._live.get(key)
        return None if entry is None else entry[0]

    def pop_expired(self, now: float) -> list[tuple[Hashable, int]]:
        """Remove and return every holder whose expiry is at or before ``now``."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            entry = heapq.heappop(self._heap)
            key = entry[3]
            if self._live.get(key) is entry:
                del self._live[key]
                self.blocks += entry[1]
                out.append((key, -entry[1]))
        return out

    def next_expiry(self) -> float | None:
        while self._heap:
            entry = self._heap[0]
            if self._live.get(entry[3]) is entry:
                return entry[0]
            heapq.heappop(self._heap)
        return None

    def choose_victims(self, needed_blocks: int, free_blocks: int) -> VictimChoice:
        """Same answer as :func:`choose_victims` on this pool's holders; does not remove them."""
        if needed_blocks < 0 or free_blocks < 0:
            raise ValueError(f"needed_blocks and free_blocks must be >= 0, got {needed_blocks}, {free_blocks}")
        short = needed_blocks - free_blocks
        if short <= 0:
            return VictimChoice((), 0, True)
        if short > self.blocks:
            return VictimChoice((), 0, False)
        return _take_until(self.in_order(), short)

    def in_order(self) -> Iterator[tuple[Hashable, int]]:
        """(key, blocks) of every holder in victim order, walked lazily: the heap is not mutated (a
        small frontier heap of indices), so taking the first k costs O(k log k)."""
        frontier = [(self._heap[0], 0)] if self._heap else []
        while frontier:
            entry, i = heapq.heappop(frontier)
            if self._live.get(entry[3]) is entry:
                yield entry[3], -entry[1]
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(self._heap):
                    heapq.heappush(frontier, (self._heap[child], child))

    def holders(self) -> list[BlockHolder]:
        return [BlockHolder(k, -nb, exp) for k, (exp, nb, _, _) in self._live.items()]

    def _compact(self) -> None:
        self._heap = list(self._live.values())
        heapq.heapify(self._heap)
