"""How far a group of predictions is off: the one summary every held-out report prints (calibration.loo,
calibration.decode_fit, calibration.prefill_published)."""

from __future__ import annotations

import statistics
from typing import Any, Sequence


def error_band(errors: Sequence[float]) -> dict[str, Any]:
    """Points, median and max |relative error| and the signed range of one group of predictions."""
    return {"points": len(errors), "median_abs_error": statistics.median(abs(x) for x in errors),
            "max_abs_error": max(abs(x) for x in errors), "min_error": min(errors), "max_error": max(errors)}
