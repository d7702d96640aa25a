"""When conversations start: all at once (closed loop) or as a Poisson process (open loop)."""

from __future__ import annotations

import random


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
