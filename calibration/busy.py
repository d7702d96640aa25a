"""What a bench turn's timing depended on besides its own prompt: other turns running around it.

Two features per turn, computed from the bench records alone (start, TTFT, total of every turn):

* ``busy``: did the deployment decode anything in the ``window_s`` before this turn started (another
  turn decoding at that moment, or finished less than ``window_s`` earlier)? On the 2-core CPU
  rehearsal P and D share the cores, and a turn that starts right after another one ended takes about
  twice as long to its first token (measured: OFF requests 2-5, 2,288 ms busy vs 1,141 ms quiet). The
  cause named so far: the connector's worker-side reader keeps polling for about a second after every
  step (impl/connector), on the core P needs. It is a property of the rig (P and D on one CPU), not of a
  GPU deployment, which is why it is fitted and replayed separately (:mod:`sim.engine.contention`) and not
  written into a profile's physical terms.
* decode load over the turn's decode span ``[start + ttft, start + total]``: the mean number of
  sequences decoding together (this one included) and the mean total context they hold, each other
  turn weighted by how much of the span it overlaps. This is what a decode step's cost depends on
  (``decode_fixed_s + decode_per_seq_s * B + decode_per_ctx_token_s * sum(context)``,
  :mod:`calibration.profile`).

Pure functions of the records; :mod:`calibration.from_bench` regresses on them and
:mod:`sim.replay.validate` replays the same definition in the simulator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from calibration.bench_records import BenchRecord

# A second: the connector's reader polls for about 1 s after each step (BASELINES' measurement that a
# turn starting < ~1 s after the previous one ended takes ~2x); a flag overrides it.
DEFAULT_BUSY_WINDOW_S = 1.0


@dataclass(frozen=True, slots=True)
class DecodeLoad:
    tpot_s: float  # BenchRecord.tpot_s: the mean time per output token after the ones TTFT brought
    batch: float  # mean sequences decoding together over the span, this one included
    context_tokens: float  # mean total context of those sequences over the span


def _span(r: BenchRecord) -> tuple[float, float]:
    return r.start_s + r.ttft_s, r.start_s + r.total_s


def _usable(r: BenchRecord) -> bool:
    return r.ok and math.isfinite(r.ttft_s) and math.isfinite(r.total_s)


def busy_flags(records: Sequence[BenchRecord], window_s: float = DEFAULT_BUSY_WINDOW_S) -> list[bool]:
    """Per record (same order): another turn was decoding within ``window_s`` before this one started."""
    spans = [(_span(r), i) for i, r in enumerate(records) if _usable(r)]
    out = []
    for i, r in enumerate(records):
        start = r.start_s
        out.append(window_s > 0 and any(j != i and lo < start and hi > start - window_s for (lo, hi), j in spans))
    return out


def decode_loads(records: Sequence[BenchRecord]) -> list[DecodeLoad | None]:
    """Per record: its TPOT and the decode load it ran under; None when it has no TPOT (failed, or every token came in the first read)."""
    spans = [(_span(r), r) if _usable(r) else None for r in records]
    out: list[DecodeLoad | None] = []
    for i, r in enumerate(records):
        tpot_s = r.tpot_s
        if spans[i] is None or math.isnan(tpot_s):
            out.append(None)
            continue
        (lo, hi), _ = spans[i]
        length = hi - lo
        if length <= 0:
            out.append(None)
            continue
        batch, context = 1.0, r.prompt_tokens + r.output_tokens / 2  # mean context over its own decode
        for j, s in enumerate(spans):
            if j == i or s is None:
                continue
            (olo, ohi), other = s
            overlap = min(hi, ohi) - max(lo, olo)
            if overlap > 0:
                share = overlap / length
                batch += share
                context += share * (other.prompt_tokens + other.output_tokens / 2)
        out.append(DecodeLoad(tpot_s, batch, context))
    return out
