"""Published decode measurements (``data/decode_published.csv``): TPOT, ITL or per-user output rate of vLLM
(and, marked, of other engines), with the deployment each was measured on and the page it was read from.

Reference data only: nothing here is fitted (the row marked ``heldout`` is the project's held-out benchmark,
vLLM PR #32553, which :mod:`calibration.heldout` predicts and never fits). The file's ``#`` header says how the
rows were collected and what every column means; this module reads and checks it: every row names its
source page, carries at least one positive decode figure, and uses a known precision and accelerator name.
Errors name the row (``<path> row <n>``, n counting data rows from 1) and the field.
"""

from __future__ import annotations

import pathlib
from collections import Counter
from dataclasses import dataclass

from calibration.hardware import DATA_DIR
from calibration.published import commented_csv_rows

DECODE_CSV = DATA_DIR / "decode_published.csv"

ARCHITECTURES = ("dense", "moe")
PRECISIONS = ("BF16", "FP16", "FP8", "FP4")
GPUS = ("A100 SXM", "H100 SXM", "H100 NVL", "H20", "H200", "B200", "GB200", "B300", "MI300X", "MI325X", "MI355X",
        "Gaudi3", "Trainium2")
STATISTICS = ("mean", "median")
SERVING = ("aggregated", "pd_decode")
CONCURRENCY_KINDS = ("max_concurrency", "all_at_once", "request_rate", "clients", "batch")

COLUMNS = ("model", "hf_id", "params_b", "active_params_b", "architecture", "precision", "kv_cache_dtype", "gpu",
           "num_gpus_tp", "pp", "ep", "dp", "engine", "engine_version", "spec_decode", "serving", "batch_or_concurrency",
           "concurrency_kind", "num_requests", "input_tokens", "output_tokens", "statistic", "tpot_ms", "itl_ms",
           "output_tok_s_per_user", "output_tok_s_total", "ttft_ms", "heldout", "source_url", "quote", "notes")
_REQUIRED_TEXT = ("model", "architecture", "precision", "gpu", "engine", "serving", "statistic", "source_url", "quote")
_INTS = ("num_gpus_tp", "pp", "ep", "dp", "batch_or_concurrency", "num_requests")
_FLOATS = ("params_b", "active_params_b", "input_tokens", "output_tokens", "tpot_ms", "itl_ms",
           "output_tok_s_per_user", "output_tok_s_total", "ttft_ms")
DECODE_METRICS = ("tpot_ms", "itl_ms", "output_tok_s_per_user")


@dataclass(frozen=True, slots=True)
class DecodeFigure:
    """One published measurement. ``None`` = the page does not give it."""

    model: str
    hf_id: str
    params_b: float | None
    active_params_b: float | None
    architecture: str  # "dense" | "moe"
    precision: str  # weights: BF16 | FP16 | FP8 | FP4
    kv_cache_dtype: str
    gpu: str
    num_gpus_tp: int | None
    pp: int | None
    ep: int | None
    dp: int | None
    engine: str
    engine_version: str
    spec_decode: str
    serving: str  # "aggregated" | "pd_decode" (the decode instance of a prefill/decode-disaggregated deployment)
    batch_or_concurrency: int | None
    concurrency_kind: str
    num_requests: int | None
    input_tokens: float | None
    output_tokens: float | None
    statistic: str  # of tpot_ms / itl_ms / ttft_ms: "mean" | "median"
    tpot_ms: float | None
    itl_ms: float | None
    output_tok_s_per_user: float | None
    output_tok_s_total: float | None
    ttft_ms: float | None
    heldout: bool
    source_url: str
    quote: str
    notes: str

    @property
    def is_vllm(self) -> bool:
        """vLLM itself or a vLLM hardware plugin (vllm-gaudi)."""
        return self.engine.lower().startswith("vllm")

    @property
    def decode_ms_per_token(self) -> float:
        """The row's per-request decode step: TPOT, else ITL, else 1000 / per-user rate (derived)."""
        if self.tpot_ms is not None:
            return self.tpot_ms
        if self.itl_ms is not None:
            return self.itl_ms
        assert self.output_tok_s_per_user is not None  # the loader guarantees one of the three
        return 1000.0 / self.output_tok_s_per_user


def _number(where: str, field: str, text: str, kind: type) -> float | int | None:
    text = text.strip()
    if not text:
        return None
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"{where}: field {field!r} must be {'an integer' if kind is int else 'a number'} "
                         f"or empty, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"{where}: field {field!r} must be > 0 when given, got {text!r}")
    return value


def _figure(where: str, row: dict[str, str | None]) -> DecodeFigure:
    if None in row:
        raise ValueError(f"{where}: more fields than the header's {len(COLUMNS)} (unquoted comma?)")
    missing = [c for c in COLUMNS if c not in row]
    if missing:
        raise ValueError(f"{where}: field {missing[0]!r} is missing from the header")
    values = {c: (row[c] or "").strip() for c in COLUMNS}
    for field in _REQUIRED_TEXT:
        if not values[field]:
            raise ValueError(f"{where}: field {field!r} is empty")
    checks = (("architecture", ARCHITECTURES), ("precision", PRECISIONS), ("gpu", GPUS), ("statistic", STATISTICS),
              ("serving", SERVING))
    for field, allowed in checks:
        if values[field] not in allowed:
            raise ValueError(f"{where}: field {field!r} must be one of {allowed}, got {values[field]!r}")
    if values["concurrency_kind"] and values["concurrency_kind"] not in CONCURRENCY_KINDS:
        raise ValueError(f"{where}: field 'concurrency_kind' must be one of {CONCURRENCY_KINDS} or empty, "
                         f"got {values['concurrency_kind']!r}")
    if values["heldout"] not in ("true", "false"):
        raise ValueError(f"{where}: field 'heldout' must be true or false, got {values['heldout']!r}")
    if not values["source_url"].startswith(("https://", "http://")):
        raise ValueError(f"{where}: field 'source_url' must be an http(s) address, got {values['source_url']!r}")
    parsed: dict[str, object] = {}
    for field in _INTS:
        parsed[field] = _number(where, field, values[field], int)
    for field in _FLOATS:
        parsed[field] = _number(where, field, values[field], float)
    if all(parsed[m] is None for m in DECODE_METRICS):
        raise ValueError(f"{where}: no decode figure: one of {DECODE_METRICS} must be given")
    texts = {c: values[c] for c in COLUMNS if c not in parsed}
    texts["heldout"] = values["heldout"] == "true"
    return DecodeFigure(**texts, **parsed)


def load_decode_published(path: str | pathlib.Path = DECODE_CSV) -> list[DecodeFigure]:
    return [_figure(where, row) for where, row in commented_csv_rows(path)]


def coverage(figures: list[DecodeFigure]) -> Counter[tuple[str, str]]:
    """Rows per (model, gpu)."""
    return Counter((f.model, f.gpu) for f in figures)
