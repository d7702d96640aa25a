"""The published figures (``data/published_figures.csv``, source: the AWS post, README.md), the deployments
they were measured on, and the benchmark's turn shape.

Each figure: model, prompt tokens, mode (``on``/``off`` = bidirectional KV transfer), metric
(``ttft``, ``prefill`` = prefill duration, ON including the D->P pull, ``transfer`` = the ON path's
D->P KV transfer) and the measured time in ms. Ten per model, twenty in all.
"""

from __future__ import annotations

import csv
import pathlib
from dataclasses import dataclass

from calibration.hardware import DATA_DIR

PUBLISHED_CSV = DATA_DIR / "published_figures.csv"
METRICS = ("ttft", "prefill", "transfer")
MODES = ("off", "on")


@dataclass(frozen=True, slots=True)
class PublishedFigure:
    model: str
    prompt_label: str
    prompt_tokens: int
    mode: str  # "on" | "off"
    metric: str  # "ttft" | "prefill" | "transfer"
    measured_ms: float
    approximate: bool
    source: str

    @property
    def bidirectional(self) -> bool:
        return self.mode == "on"

    @property
    def key(self) -> tuple[str, int, str, str]:
        return (self.model, self.prompt_tokens, self.mode, self.metric)


@dataclass(frozen=True, slots=True)
class MeasuredDeployment:
    """Where a published model ran: the profile it gets and the inputs it is built from."""

    model: str
    profile_name: str
    config_file: str  # under calibration/data/
    hardware: str
    tp: int
    kv_cache_dtype: str = "auto"  # vLLM's default: the model dtype (BF16; GLM-5 gets FP8 only on SM100)

    @property
    def config_path(self) -> pathlib.Path:
        return DATA_DIR / self.config_file


@dataclass(frozen=True, slots=True)
class BenchmarkShape:
    """The published benchmark's turn (vLLM multi-turn client, vLLM PR #32553: user 120-160 tokens/turn,
    output 800-1,200): a later turn's prompt is the previous prompt + output + the new user tokens."""

    user_tokens: int = 140  # midpoint of 120-160
    local_hit_tokens: int = 0  # prefix caching OFF on P


MEASURED = (
    MeasuredDeployment("Qwen3-32B", "qwen3-32b@p5en-tp8", "config_qwen3-32b.json", "p5en", 8),
    MeasuredDeployment("GLM-5-FP8", "glm-5-fp8@p5en-tp8", "config_glm-5-fp8.json", "p5en", 8),
)


def deployment(model: str) -> MeasuredDeployment:
    for d in MEASURED:
        if d.model == model or d.profile_name == model:
            return d
    raise ValueError(f"no measured deployment for {model!r} (known: {', '.join(d.model for d in MEASURED)})")


def commented_csv_rows(path: str | pathlib.Path) -> list[tuple[str, dict[str, str]]]:
    """A CSV whose ``#`` lines are provenance: each data row with where it is (``<path> row <n>``)."""
    path = pathlib.Path(path)
    lines = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return [(f"{path} row {i}", row) for i, row in enumerate(csv.DictReader(lines), start=1)]


def load_published(path: str | pathlib.Path = PUBLISHED_CSV) -> list[PublishedFigure]:
    figures = []
    for where, row in commented_csv_rows(path):
        try:
            figure = PublishedFigure(
                model=row["model"], prompt_label=row["prompt_label"], prompt_tokens=int(row["prompt_tokens"]),
                mode=row["mode"], metric=row["metric"], measured_ms=float(row["measured_ms"]),
                approximate=row["approximate"].strip().lower() == "true", source=row["source"])
        except KeyError as exc:
            raise ValueError(f"{where}: field {exc.args[0]!r} is missing") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None
        if figure.mode not in MODES:
            raise ValueError(f"{where}: field 'mode' must be one of {MODES}, got {figure.mode!r}")
        if figure.metric not in METRICS:
            raise ValueError(f"{where}: field 'metric' must be one of {METRICS}, got {figure.metric!r}")
        if figure.measured_ms <= 0 or figure.prompt_tokens <= 0:
            raise ValueError(f"{where}: fields 'measured_ms' and 'prompt_tokens' must be > 0")
        figures.append(figure)
    return figures
