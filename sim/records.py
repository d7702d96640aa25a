"""A turn in flight and the record it leaves; the summary computed from records.

The record is filled in as the turn moves through router, prefill, interconnect and decode; every
duration is measured on the simulator's clock, never predicted.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, fields
from typing import Iterable, Sequence

PROMPT_BUCKETS = (0, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass(slots=True)
class TurnRecord:
    conversation: str
    turn: int
    tenant: str
    prompt_tokens: int
    output_tokens: int
    arrival_s: float
    prefill_instance: str = ""
    decode_instance: str = ""
    store_hit: bool = False
    miss_reason: str = ""  # store miss reason, or why a hit was not pulled in the end
    decision: str = ""  # pull / recompute / none
    decision_reason: str = ""
    p_local_hit_tokens: int = 0
    reused_tokens: int = 0  # pulled D->P
    recomputed_tokens: int = 0  # computed on P
    d2p_transfer_s: float = 0.0
    p_queue_s: float = 0.0
    prefill_compute_s: float = 0.0
    reuse_overhead_s: float = 0.0
    d_local_hit_tokens: int = 0
    p2d_tokens: int = 0
    p2d_transfer_s: float = 0.0
    d_queue_s: float = 0.0
    ttft_s: float = math.nan
    completion_s: float = math.nan
    preempted: int = 0
    rejected: str = ""  # non-empty: why the turn did not complete
    # token-exact reuse (as P's connector reports it, each beyond P's local hit): D's tokens the router
    # offered (min(held, prompt) - local hit), the part of them P verified equal to its prompt's ids,
    # and what it pulled (the recompute policy decides on the verified count)
    offered_tokens: int = 0
    verified_tokens: int = 0
    pulled_tokens: int = 0

    @property
    def prefill_s(self) -> float:
        """The published "prefill duration": D->P pull + compute + reuse overhead on P."""
        return self.d2p_transfer_s + self.prefill_compute_s + self.reuse_overhead_s


RECORD_FIELDS = [f.name for f in fields(TurnRecord)]


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of an already sorted sequence; NaN if empty."""
    n = len(sorted_values)
    if n == 0:
        return math.nan
    pos = (n - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


_BUCKET_LABELS = ([f"{lo // 1024}-{hi // 1024}k" for lo, hi in zip(PROMPT_BUCKETS, PROMPT_BUCKETS[1:])]
                  + [f">={PROMPT_BUCKETS[-1] // 1024}k"])


def bucket_label(prompt_tokens: int) -> str:
    """The bucket below the first edge above ``prompt_tokens`` (below every edge: the first bucket)."""
    return _BUCKET_LABELS[max(bisect.bisect_right(PROMPT_BUCKETS, prompt_tokens) - 1, 0)]


def _dist(values: Iterable[float]) -> dict:
    v = sorted(values)
    return {"n": len(v), "p50_ms": percentile(v, 50) * 1e3, "p90_ms": percentile(v, 90) * 1e3,
            "p99_ms": percentile(v, 99) * 1e3, "mean_ms": (sum(v) / len(v) * 1e3) if v else math.nan}


@dataclass(slots=True)
class NodeTotals:
    retained_block_seconds: float = 0.0
    peak_retained_blocks: int = 0
    preemptions: int = 0
    rejected: int = 0
    dropped_under_pressure: int = 0
    peak_used_blocks: int = 0


def summarize(records: Sequence[TurnRecord], bytes_per_block: float, decode_totals: dict[str, NodeTotals],
              sim_time_s: float) -> dict:
    # one pass over the records, one per-turn value list per distribution: a summary of a million
    # turns was a dozen generator passes over them
    done = [r for r in records if not r.rejected]
    ttft = [r.ttft_s for r in done]
    by_bucket: dict[str, list[float]] = {}
    misses: dict[str, int] = {}
    later = hits = 0
    reused = recomputed = offered = verified = pulled = prompt = 0  # token totals: ints, any order is exact
    for r in done:
        by_bucket.setdefault(bucket_label(r.prompt_tokens), []).append(r.ttft_s)
        if r.turn > 0:
            later += 1
            if r.reused_tokens > 0:
                hits += 1
            if r.reused_tokens == 0:
                key = r.miss_reason or "unknown"
                misses[key] = misses.get(key, 0) + 1
        reused += r.reused_tokens
        recomputed += r.recomputed_tokens
        offered += r.offered_tokens
        verified += r.verified_tokens
        pulled += r.pulled_tokens
        prompt += r.prompt_tokens
    order = {bucket_label(e): i for i, e in enumerate(PROMPT_BUCKETS)}
    gb = bytes_per_block / 1e9
    return {
        "turns": len(records),
        "completed": len(done),
        "rejected": len(records) - len(done),
        "sim_time_s": sim_time_s,
        "ttft": _dist(ttft),
        "ttft_by_prompt_bucket": {k: _dist(v) for k, v in sorted(by_bucket.items(), key=lambda kv: order.get(kv[0], 99))},
        "prefill": _dist([r.prefill_s for r in done]),
        "reuse_hit_rate": (hits / later) if later else math.nan,
        "miss_reasons": dict(sorted(misses.items())),
        "tokens_reused": reused,  # = prompt tokens P did not recompute thanks to D
        "tokens_recomputed": recomputed,
        # what the router offered from D, what P verified of it (token ids equal) and what P pulled
        "tokens_offered": offered,
        "tokens_verified": verified,
        "tokens_pulled": pulled,
        "prompt_tokens": prompt,
        "retained_hbm_gb_s": sum(t.retained_block_seconds for t in decode_totals.values()) * gb,
        "peak_retained_hbm_gb": max((t.peak_retained_blocks for t in decode_totals.values()), default=0) * gb,
        "preemptions": sum(t.preemptions for t in decode_totals.values()),
        "dropped_under_pressure": sum(t.dropped_under_pressure for t in decode_totals.values()),
    }
