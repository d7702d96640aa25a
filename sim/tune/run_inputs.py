"""What both ``bidikv tune`` commands (sim/tune/cli.py, and its ``--designs``: sim/tune/design_cli.py) read
from their flags, and the capacity warnings they print about the references they measure against."""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from sim.tune.grid import DEFAULT_THRESHOLDS, parse_floats


def capacity_warnings(points: Any, num_prefill: int) -> list[str]:
    """The simulate warnings, for the references every configuration is measured against."""
    from sim.commands.simulate import QUEUE_SHARE_WARN, UTILISATION_WARN

    out = []
    for p in points:
        if p.candidate.kind not in ("baseline_off", "default"):
            continue
        m, name = p.metrics, p.candidate.label
        if m.get("prefill_utilisation_max", 0.0) >= UTILISATION_WARN:
            out.append(f"{name}: a prefill instance is {m['prefill_utilisation_max']:.0%} busy, so TTFT measures a "
                       f"saturated cluster, not KV reuse; add prefill instances (--num-prefill {num_prefill + 1}) "
                       "or lower the load")
        elif m.get("queue_share_of_ttft", 0.0) > QUEUE_SHARE_WARN:
            out.append(f"{name}: queueing is {m['queue_share_of_ttft']:.0%} of TTFT, so the ranking is mostly about "
                       f"waiting; add prefill instances (--num-prefill {num_prefill + 1}) or lower the arrival rate")
    return out


def float_list(text: str, name: str) -> list[float]:
    """A comma-separated flag's numbers; none for an empty one."""
    return parse_floats(text, name) if text.strip() else []


def thresholds_of(args: argparse.Namespace, default: Sequence[str] = DEFAULT_THRESHOLDS) -> list[str]:
    """--thresholds, or ``default`` when it is not given."""
    text = args.thresholds if args.thresholds is not None else ",".join(default)
    return [t.strip() for t in text.split(",") if t.strip()]


def decode_memory(args: argparse.Namespace, config: Any) -> tuple[Any, int, float, int]:
    """(profile, KV blocks per decode instance, decode KV GB in all, decode KV tokens in all); sets the
    config's decode blocks from --decode-hbm-gb when given."""
    from calibration.profile import LatencyProfile

    profile = LatencyProfile.load(config.profile)
    block_gb = profile.kv_bytes_per_token * profile.block_size / 1e9
    if args.decode_hbm_gb is not None:
        config.topology.decode_kv_blocks = max(1, int(args.decode_hbm_gb / block_gb))
    decode_blocks = config.topology.decode_kv_blocks or profile.decode_blocks()
    return (profile, decode_blocks, decode_blocks * block_gb * config.topology.num_decode,
            decode_blocks * profile.block_size * config.topology.num_decode)
