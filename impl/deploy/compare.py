"""The ON/OFF table: two ``bidikv bench`` JSONLs of the same workload, TTFT side by side by prompt length.

Same buckets and percentile as the simulator's reports (impl.bench.stats), so a measured table and a
simulated one line up. The merged file (``--merged``) holds both runs for ``bidikv calibrate
--from-bench``: OFF turns pin the prefill terms, ON turns the pull terms (calibration/from_bench.py).
"""

from __future__ import annotations

import math
from typing import Sequence

from calibration.bench_records import BenchRecord, read_jsonl, write_jsonl
from impl.bench.stats import bucket_label, percentile


def load_run(path: str, mode: str) -> list[BenchRecord]:
    records = read_jsonl(path)
    if not records:
        raise ValueError(f"{path}: no turns")
    wrong = sorted({r.mode for r in records if r.mode != mode})
    if wrong:
        raise ValueError(f"{path}: expected a --mode {mode} run, found turns of mode {', '.join(wrong)}")
    return records


def _ok(records: Sequence[BenchRecord]) -> list[BenchRecord]:
    return [r for r in records if r.ok and math.isfinite(r.ttft_s)]


def _ms(records: Sequence[BenchRecord], q: float) -> float:
    return percentile(sorted(r.ttft_s for r in records), q) * 1e3


def _cell(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:,.0f}"


def _ratio(off_ms: float, on_ms: float) -> str:
    return "-" if math.isnan(off_ms) or math.isnan(on_ms) or on_ms <= 0 else f"{off_ms / on_ms:.2f}x"


def on_off_table(on: Sequence[BenchRecord], off: Sequence[BenchRecord]) -> str:
    ok_on, ok_off = _ok(on), _ok(off)
    groups: dict[str, tuple[list[BenchRecord], list[BenchRecord]]] = {}
    order: dict[str, int] = {}
    for index, records in enumerate((ok_on, ok_off)):
        for r in records:
            label = bucket_label(r.prompt_tokens)
            order.setdefault(label, r.prompt_tokens)
            order[label] = min(order[label], r.prompt_tokens)
            groups.setdefault(label, ([], []))[index].append(r)
    rows = [(label, *groups[label]) for label in sorted(groups, key=order.__getitem__)]
    rows.append(("all", ok_on, ok_off))

    header = ("prompt", "turns ON/OFF", "OFF p50", "ON p50", "p50 OFF/ON", "OFF p90", "ON p90", "p90 OFF/ON",
              "reused ON")
    lines = [f"TTFT (ms) by prompt length: bidirectional ON vs OFF "
             f"({len(on)} ON turns, {len(on) - len(ok_on)} failed; {len(off)} OFF turns, {len(off) - len(ok_off)} failed)",
             "| " + " | ".join(header) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"]
    for label, r_on, r_off in rows:
        p50_on, p50_off, p90_on, p90_off = _ms(r_on, 50), _ms(r_off, 50), _ms(r_on, 90), _ms(r_off, 90)
        prompt = sum(r.prompt_tokens for r in r_on)
        reused = sum(r.prefill_cached_tokens or 0 for r in r_on) / prompt if prompt else math.nan
        cells = (label, f"{len(r_on)}/{len(r_off)}", _cell(p50_off), _cell(p50_on), _ratio(p50_off, p50_on),
                 _cell(p90_off), _cell(p90_on), _ratio(p90_off, p90_on), "-" if math.isnan(reused) else f"{reused:.1%}")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("reused ON: prompt tokens P reports it did not compute (pulled from D or its own cache) / prompt tokens")
    return "\n".join(lines)


def compare(on_path: str, off_path: str, merged_path: str | None = None) -> str:
    on, off = load_run(on_path, "on"), load_run(off_path, "off")
    if merged_path:
        write_jsonl([*on, *off], merged_path)
    return on_off_table(on, off)


__all__ = ["compare", "load_run", "on_off_table"]
