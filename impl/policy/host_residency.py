"""Whether D's host tier still holds a turn, as the router can estimate it, and whether to ask for it.

D's host tier is vLLM's (``OffloadingConnector`` + ``TieringOffloadingSpec``, vllm/v1/kv_offload/): a
turn's blocks are copied to host DRAM as they complete and stay until evicted (``lru`` or ``arc``)
from a cache of ``cpu_bytes_to_use`` bytes, or until D's process ends (the tier is a /dev/shm mmap
named by the engine id, ``cpu/shared_offload_region.py``). The router does not see that cache. It sees
every turn it sent each D, so it counts the tokens that D's host tier took in after the turn:

* **resident, estimated**: at conversation granularity under LRU (as the simulator models it, and as
  a conversation's blocks are all touched when its latest turn is stored), a span of ``span`` tokens
  stored when the tier had taken in ``W`` tokens since survives while ``span + W <= capacity``.
* **the count is uncertain**: it over-counts (blocks already in the tier are not stored twice:
  ``prepare_store`` skips them; a conversation's next turn shares its prefix keys) and under-counts
  (turns the router did not send: another router replica, direct requests; ARC keeps re-read entries
  longer than LRU and scan-once ones shorter). Modelled as the true count lying uniformly within
  ``W * (1 +- count_error)``: the likelihood is the probability that it still fits. ASSUMPTION:
  ``DEFAULT_COUNT_ERROR`` (25 %) is not measured.
* **gone, known**: a D that restarted since (new engine id) has an empty tier; a span larger than the
  tier was never stored (``prepare_store`` finds no room).

A wrong guess never serves wrong KV: vLLM's P2P tier looks blocks up by their hashes
(``tiering/p2p/manager.py``: the consumer probes the peer, which answers per block hash from its own
tier), so a guess that misses costs the probe and then P recomputes (vLLM's fallback). Asking is worth
it when ``p * (recompute - pull) > (1 - p) * probe + session`` (:func:`worth_asking`); a router with no
cost model asks when a hit is at least as likely as not.

Pure: standard library only, no clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_COUNT_ERROR = 0.25  # ASSUMPTION: relative error of the router's count of tokens D's tier took in
MIN_LIKELIHOOD_WITHOUT_COSTS = 0.5  # no cost model: ask when a hit is at least as likely as a miss


@dataclass(frozen=True, slots=True)
class HostSpan:
    """What the router knows of one turn's span in one D's host tier."""

    span_tokens: int  # tokens D offloaded for the turn (whole chunks)
    taken_in_since: int  # tokens D's host tier took in after it, as the router counted them
    capacity_tokens: int  # D's cpu_bytes_to_use over its host bytes per token
    same_incarnation: bool = True  # D has not restarted since the turn (same engine id)

    def __post_init__(self) -> None:
        for name in ("span_tokens", "taken_in_since", "capacity_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def host_hit_likelihood(span: HostSpan, count_error: float = DEFAULT_COUNT_ERROR) -> float:
    """The probability that D's host tier still holds ``span`` (see the module docstring), in [0, 1]."""
    if not (0.0 <= count_error < 1.0):
        raise ValueError(f"count_error must be in [0, 1), got {count_error!r}")
    if not span.same_incarnation or span.span_tokens == 0:
        return 0.0
    room = span.capacity_tokens - span.span_tokens  # what the tier may take in before the span is evicted
    if room < 0:
        return 0.0
    low = span.taken_in_since * (1.0 - count_error)
    high = span.taken_in_since * (1.0 + count_error)
    if room >= high:
        return 1.0
    if room < low:
        return 0.0
    return (room - low) / (high - low)  # high > low here: taken_in_since > 0 and count_error > 0


def worth_asking(likelihood: float, *, pull_s: float | None = None, recompute_s: float | None = None,
                 probe_s: float = 0.0, session_s: float = 0.0) -> bool:
    """Whether to stamp ``remote_kv_source``: with costs (a warm hit's pull including its probe, the
    recompute it saves, a miss's probe, a new P/D pair's session set-up, paid on both outcomes) when
    the expected time is lower than recomputing; without, when a hit is at least as likely as not."""
    if not (0.0 <= likelihood <= 1.0):
        raise ValueError(f"likelihood must be in [0, 1], got {likelihood!r}")
    if likelihood == 0.0:
        return False
    if pull_s is None or recompute_s is None:
        return likelihood >= MIN_LIKELIHOOD_WITHOUT_COSTS
    for name, value in (("pull_s", pull_s), ("recompute_s", recompute_s), ("probe_s", probe_s),
                        ("session_s", session_s)):
        if not (value >= 0.0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    expected = likelihood * pull_s + (1.0 - likelihood) * (probe_s + recompute_s) + session_s
    return expected < recompute_s


__all__ = ["DEFAULT_COUNT_ERROR", "HostSpan", "MIN_LIKELIHOOD_WITHOUT_COSTS", "host_hit_likelihood", "worth_asking"]
