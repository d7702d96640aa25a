"""When conversations start (all at once, or Poisson), and the per-conversation streams generators share."""

from __future__ import annotations

import random
from typing import Callable

from sim.workload.model import Conversation, Turn


def start_times(count: int, arrival_rate_per_s: float | None, rng: random.Random) -> list[float]:
    """All at 0 s, as vLLM's benchmark starts its clients, or Poisson arrivals at the given rate.

    Open-loop arrivals are what a load study needs: load does not fall when the server slows down.
    """
    if arrival_rate_per_s is None:
        return [0.0] * count
    starts: list[float] = []
    clock_s = 0.0
    for _ in range(count):
        clock_s += rng.expovariate(arrival_rate_per_s)
        starts.append(clock_s)
    return starts


def conversations(count: int, arrival_rate_per_s: float | None, rng_workload: random.Random, rng_gaps: random.Random,
                  id_prefix: str, shared_prefix_tokens: int,
                  turns: Callable[[random.Random, random.Random], tuple[Turn, ...]]) -> list[Conversation]:
    """``count`` conversations in start order; each draws its turns from sub-streams of its own, so a
    change to one conversation's draws (or to the gap model) never shifts another's."""
    starts = start_times(count, arrival_rate_per_s, random.Random(rng_gaps.getrandbits(64)))
    out = []
    for index, start_s in enumerate(starts):
        tokens_rng = random.Random(rng_workload.getrandbits(64))
        gaps_rng = random.Random(rng_gaps.getrandbits(64))
        out.append(Conversation(conversation_id=f"{id_prefix}-{index:04d}", start_s=start_s,
                                turns=turns(tokens_rng, gaps_rng), shared_prefix_tokens=shared_prefix_tokens))
    return out
