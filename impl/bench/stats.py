"""What every latency table shares, measured or simulated: the prompt-length buckets and the percentile.

``bidikv bench``, ``bidikv deploy compare`` and the simulator's reports (sim.engine.records) all read these
from here, so a measured table and a simulated one bucket and interpolate alike and line up row by
row.
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence

PROMPT_BUCKETS = (0, 1024, 2048, 4096, 8192, 16384, 32768)


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
