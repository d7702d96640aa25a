"""The per-turn record of a benchmark run, as JSON lines; the reader validates every line.

``bidikv bench`` (sim.bench) writes it, calibration fits from it, ``bidikv validate`` replays it and
``bidikv deploy compare`` tabulates it: it lives here, in the lowest layer that reads it, so none of
them imports another's layer for it."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Iterable

FORMAT = "bidikv-bench/1"
PATHS = ("", "pull_to_p", "prefill_on_d", "recompute_on_p")  # impl.policy.prefill_on_d.TurnPath's values


@dataclass(frozen=True, slots=True)
class BenchRecord:
    conversation: str
    turn: int
    mode: str  # "on" | "off": what the deployment under test runs (bidirectional_kv_xfer)
    prompt_tokens: int
    output_tokens: int  # generated, as the server reported
    start_s: float  # since the run started
    ttft_s: float  # NaN when no token arrived (a failed turn); null in the JSONL
    total_s: float
    reuse_offered_tokens: int  # router: tokens of D's KV offered to P (X-Bidikv-Reuse-Offered-Tokens)
    prefill_cached_tokens: int | None  # P: prompt tokens it did not compute (X-Bidikv-Prefill-Cached-Tokens)
    prefill_instance: str = ""
    decode_instance: str = ""
    error: str = ""
    format: str = FORMAT
    # output tokens that reached the client in the same read as the first (sim.bench.client.TurnResult);
    # None: not recorded (a record written before the field existed), taken as 1, what its TPOT assumed
    first_read_tokens: int | None = None
    # which of the three the router served the turn by (X-Bidikv-Path: pull_to_p, prefill_on_d, recompute_on_p);
    # "" from a router that does not say (one without --prefill-on-d before the header existed)
    path: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after TTFT: (total - ttft) / (output - first_read_tokens); NaN for a
        failed turn or one whose tokens all came in the first read. The tokens that arrived with the first
        were decoded before TTFT was stamped, so they are not part of the time after it."""
        first = min(1, self.output_tokens) if self.first_read_tokens is None else self.first_read_tokens
        later = self.output_tokens - first
        if self.error or later < 1:
            return math.nan
        return (self.total_s - self.ttft_s) / later


def write_jsonl(records: Iterable[BenchRecord], path: str) -> None:
    with open(path, "w") as fh:
        for r in records:
            obj = dataclasses.asdict(r)
            if math.isnan(obj["ttft_s"]):
                obj["ttft_s"] = None  # NaN is not JSON; a reader in another language would choke on it
            fh.write(json.dumps(obj, sort_keys=True, allow_nan=False) + "\n")


_INT_FIELDS = ("turn", "prompt_tokens", "output_tokens", "reuse_offered_tokens")
_FLOAT_FIELDS = ("start_s", "ttft_s", "total_s")


def read_jsonl(path: str) -> list[BenchRecord]:
    """Records of a bench file; a bad line is an error naming the line and the field."""
    names = {f.name for f in dataclasses.fields(BenchRecord)}
    out = []
    try:
        fh = open(path)
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror}") from None
    with fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected an object")
            if obj.get("format") != FORMAT:
                raise ValueError(f"{where}: field format must be {FORMAT!r}, got {obj.get('format')!r}")
            unknown = sorted(set(obj) - names)
            if unknown:
                raise ValueError(f"{where}: unknown field(s) {unknown}")
            for name in _INT_FIELDS:
                v = obj.get(name)
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise ValueError(f"{where}: field {name} must be an integer >= 0, got {v!r}")
            if obj.get("ttft_s", 0) is None:
                if not obj.get("error"):
                    raise ValueError(f"{where}: field ttft_s may be null only on a failed turn (with an error)")
                obj["ttft_s"] = math.nan
            for name in _FLOAT_FIELDS:
                v = obj.get(name)
                if name == "ttft_s" and isinstance(v, float) and math.isnan(v) and obj.get("error"):
                    continue
                if isinstance(v, bool) or not isinstance(v, (int, float)) or (math.isnan(v) if isinstance(v, float) else False):
                    raise ValueError(f"{where}: field {name} must be a number, got {v!r}")
            # 0 with tokens is possible: the event that stamped TTFT carried text but no token ids
            first, outputs = obj.get("first_read_tokens"), obj["output_tokens"]
            if first is not None and (isinstance(first, bool) or not isinstance(first, int)
                                      or not 0 <= first <= outputs):
                raise ValueError(f"{where}: field first_read_tokens must be null or an integer from 0 to "
                                 f"output_tokens ({outputs}), got {first!r}")
            cached = obj.get("prefill_cached_tokens")
            if cached is not None and (isinstance(cached, bool) or not isinstance(cached, int) or cached < 0):
                raise ValueError(f"{where}: field prefill_cached_tokens must be an integer >= 0 or null, got {cached!r}")
            if obj.get("mode") not in ("on", "off"):
                raise ValueError(f"{where}: field mode must be 'on' or 'off', got {obj.get('mode')!r}")
            if obj.get("path", "") not in PATHS:
                raise ValueError(f"{where}: field path must be one of {PATHS}, got {obj.get('path')!r}")
            for name in ("conversation", "prefill_instance", "decode_instance", "error"):
                if not isinstance(obj.get(name, ""), str):
                    raise ValueError(f"{where}: field {name} must be a string")
            try:
                out.append(BenchRecord(**obj))
            except TypeError as exc:
                raise ValueError(f"{where}: {exc}") from None
    return out
