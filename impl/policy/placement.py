"""Placement: which prefill (P) and decode (D) instance serves a turn, from load snapshots.

vLLM's example proxy round-robins. ``LeastLoaded`` follows the load the router can see; ``KVAwareCost``
prices each instance the way Dynamo's KV router does (prefill work still to do there, plus the
work already queued or the blocks already active), so a P whose prefix cache holds the conversation
wins unless it is much busier. Ties go to a random choice from the caller's ``rng``.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    name: str
    healthy: bool = True
    queued_prefill_tokens: int = 0  # prompt tokens waiting or in prefill
    running_requests: int = 0
    used_blocks: int = 0  # KV blocks held by running requests
    retained_blocks: int = 0  # KV blocks held for later turns (reclaimable)
    total_blocks: int = 1

    def __post_init__(self) -> None:
        if self.total_blocks < 1:
            raise ValueError(f"instance {self.name!r}: total_blocks must be >= 1, got {self.total_blocks}")


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    prompt_tokens: int
    # tokens of this prompt each instance's prefix cache is known (or believed) to hold
    cached_tokens: Mapping[str, int] = field(default_factory=dict)
    # tokens that will be pulled from a peer wherever the turn runs
    remote_reusable_tokens: int = 0
    new_blocks: int = 0  # blocks the turn will occupy on a decode instance


class PlacementPolicy(Protocol):
    def pick(self, instances: Sequence[InstanceLoad], request: PlacementRequest, rng: random.Random) -> str | None:
        """Name of the chosen healthy instance, or None when none is healthy."""
        ...


def _argmin(instances: Sequence[InstanceLoad], cost, rng: random.Random) -> str | None:
    best: list[str] = []
    best_cost = None
    for inst in instances:
        if not inst.healthy:
            continue
        c = cost(inst)
        if best_cost is None or c < best_cost:
            best, best_cost = [inst.name], c
        elif c == best_cost:
            best.append(inst.name)
    if not best:
        return None
    return best[0] if len(best) == 1 else best[rng.randrange(len(best))]


@dataclass(slots=True)
class RoundRobin:
    """Cycle through healthy instances in the order given (the example proxy's behaviour)."""

    _next: int = 0

    def pick(self, instances: Sequence[InstanceLoad], request: PlacementRequest, rng: random.Random) -> str | None:
        n = len(instances)
        for step in range(n):
            inst = instances[(self._next + step) % n]
            if inst.healthy:
                self._next = (self._next + step + 1) % n
                return inst.name
        return None


@dataclass(frozen=True, slots=True)
class LeastLoaded:
    """Fewest queued prefill tokens, then fewest used blocks, then fewest running requests."""

    @staticmethod
    def key(inst: InstanceLoad) -> tuple[int, float, int]:
        return LeastLoaded.key_of(inst.queued_prefill_tokens, inst.used_blocks, inst.total_blocks, inst.running_requests)

    @staticmethod
    def key_of(queued_prefill_tokens: int, used_blocks: int, total_blocks: int,
               running_requests: int) -> tuple[int, float, int]:
        return queued_prefill_tokens, used_blocks / total_blocks, running_requests

    def pick(self, instances: Sequence[InstanceLoad], request: PlacementRequest, rng: random.Random) -> str | None:
        return _argmin(instances, self.key, rng)


class LeastLoadedIndex:
    """:class:`LeastLoaded`'s choice kept up to date as loads change, for callers that see many instances
    and few changes per choice: O(log n) per change instead of O(n) per pick. ``pick`` returns what
    ``LeastLoaded().pick`` returns for the instances in their order at construction, with their latest
    loads (the same tie set, in the same order, so the same ``rng`` draw)."""

    def __init__(self, instances: Sequence[InstanceLoad]) -> None:
        self._position = {inst.name: i for i, inst in enumerate(instances)}
        if len(self._position) != len(instances):
            raise ValueError("instance names must be unique")
        # (*key, position, name) of every healthy instance, sorted: ties on the key are adjacent, in
        # order. Flat rather than (key, position, name): a nested key is compared twice (== then <)
        # wherever two entries differ, and the index compares entries on every change
        self._sorted: list[tuple[int, float, int, int, str]] = []
        self._entry: dict[str, tuple[int, float, int, int, str]] = {}
        for inst in instances:
            self.update(inst)

    def update(self, inst: InstanceLoad) -> None:
        """``inst`` is the instance's load now (replacing what the index held for its name)."""
        if inst.healthy:
            self.update_load(inst.name, queued_prefill_tokens=inst.queued_prefill_tokens,
                             running_requests=inst.running_requests, used_blocks=inst.used_blocks,
                             total_blocks=inst.total_blocks)
        else:  # out of the choice
            old = self._entry.pop(inst.name, None)
            if old is not None:
                del self._sorted[bisect.bisect_left(self._sorted, old)]

    def update_load(self, name: str, *, queued_prefill_tokens: int = 0, running_requests: int = 0,
                    used_blocks: int = 0, total_blocks: int = 1) -> None:
        """:meth:`update` with a healthy instance's numbers, for a caller that changes loads more often
        than it picks (no InstanceLoad built per change)."""
        if total_blocks < 1:
            raise ValueError(f"instance {name!r}: total_blocks must be >= 1, got {total_blocks}")
        # LeastLoaded.key_of, inline: a router calls this several times per pick
        entry = (queued_prefill_tokens, used_blocks / total_blocks, running_requests, self._position[name], name)
        entries = self._sorted
        old = self._entry.get(name)
        self._entry[name] = entry
        if old is None:
            bisect.insort(entries, entry)
            return
        at = bisect.bisect_left(entries, old)
        if (at == 0 or entries[at - 1] < entry) and (at + 1 == len(entries) or entry < entries[at + 1]):
            entries[at] = entry  # still in order where the old one stood
        else:
            del entries[at]
            bisect.insort(entries, entry)

    def pick(self, rng: random.Random) -> str | None:
        entries = self._sorted
        if not entries:
            return None
        best = entries[0][:3]
        if len(entries) == 1 or entries[1][:3] != best:
            return entries[0][4]
        ties = bisect.bisect_left(entries, (*best, len(self._position)))  # every position is below this
        return entries[rng.randrange(ties)][4]


@dataclass(frozen=True, slots=True)
class KVAwareCost:
    """cost = prefill_weight x tokens left to compute there + queued tokens + block_weight x block load.

    Tokens left to compute = prompt - max(cached there, reusable from a peer). Block load is the
    fraction of the instance's blocks that running requests plus this turn would occupy (retained
    blocks are reclaimable and do not count), scaled to tokens by ``block_weight``.
    """

    prefill_weight: float = 1.0
    block_weight: float = 4096.0

    def pick(self, instances: Sequence[InstanceLoad], request: PlacementRequest, rng: random.Random) -> str | None:
        def cost(inst: InstanceLoad) -> float:
            reused = max(request.cached_tokens.get(inst.name, 0), request.remote_reusable_tokens)
            to_compute = max(request.prompt_tokens - reused, 0)
            block_load = (inst.used_blocks + request.new_blocks) / inst.total_blocks
            return self.prefill_weight * to_compute + inst.queued_prefill_tokens + self.block_weight * block_load

        return _argmin(instances, cost, rng)
