"""A model no fit has seen: Llama-3.3-70B-Instruct on p5en (vLLM PR #32553), predicted through the simulator.

The PR's figures (``data/heldout_pr32553.csv``) are means and medians over a multi-turn benchmark, not
single-request points, so they are predicted the way they were measured: the benchmark's workload
(:data:`WORKLOAD`, the synthetic generator at the PR's settings, back to back) on 1P1D with prefix
caching OFF on P (``sim.published.published_config``), by a profile that ``bidikv profile`` builds from
the model's config.json with the efficiencies given. Two things the comparison has to assume:

* the PR does not state the instances' TP size: every figure is predicted at each of :data:`TPS`;
* vLLM's client serves its conversations round-robin and stops when the first conversation ends (129
  requests OFF, 126 ON, of the 192 the conversations hold); the simulator's client runs each
  conversation to its end, so the statistics are taken over the first ``requests`` turns in
  round-robin order (turn index, then conversation): the requests vLLM's client had sent.

TPOT per turn = (completion - arrival - TTFT) / (output tokens - 1), vLLM's definition.
"""

from __future__ import annotations

import pathlib
import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from calibration.build import profile_from_architecture
from calibration.efficiencies import HardwareEfficiencies
from calibration.hardware import DATA_DIR
from calibration.published import commented_csv_rows

HELDOUT_CSV = DATA_DIR / "heldout_pr32553.csv"
CONFIG = DATA_DIR / "config_llama-3.3-70b.json"
MODEL = "Llama-3.3-70B"
HARDWARE = "p5en"
TPS = (4, 8)
WORKLOAD = {"kind": "synthetic", "num_conversations": 24, "inter_turn_gap_s": 0}  # PR #32553: no think time
SOURCE_URL = "https://github.com/vllm-project/vllm/pull/32553"


@dataclass(frozen=True, slots=True)
class HeldoutFigure:
    model: str
    mode: str  # "on" | "off"
    metric: str  # "ttft" | "tpot"
    statistic: str  # "mean" | "p50"
    measured_ms: float
    requests: int


def load_heldout(path: str | pathlib.Path = HELDOUT_CSV) -> list[HeldoutFigure]:
    out = []
    for where, row in commented_csv_rows(path):
        try:
            fig = HeldoutFigure(row["model"], row["mode"], row["metric"], row["statistic"], float(row["measured_ms"]),
                                int(row["requests"]))
        except KeyError as exc:
            raise ValueError(f"{where}: field {exc.args[0]!r} is missing") from None
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if fig.mode not in ("on", "off") or fig.metric not in ("ttft", "tpot") or fig.statistic not in ("mean", "p50"):
            raise ValueError(f"{where}: fields mode/metric/statistic must be on|off, ttft|tpot, mean|p50, "
                             f"got {fig.mode!r}, {fig.metric!r}, {fig.statistic!r}")
        if fig.measured_ms <= 0 or fig.requests <= 0:
            raise ValueError(f"{where}: fields 'measured_ms' and 'requests' must be > 0")
        out.append(fig)
    return out


def simulate_benchmark(profile: Any, bidirectional: bool, requests: int, seed: int = 0) -> dict[str, float]:
    """``ttft_mean``, ``ttft_p50``, ``tpot_mean`` (ms) over the first ``requests`` turns in round-robin order."""
    from sim.cluster import Cluster
    from sim.published import published_config
    from sim.workload import load_workload

    conversations = load_workload(WORKLOAD, seed)
    result = Cluster(published_config(bidirectional, seed), profile).run(conversations)
    order = {c.conversation_id: i for i, c in enumerate(conversations)}
    done = sorted((r for r in result.records if not r.rejected), key=lambda r: (r.turn, order[r.conversation]))
    if len(done) < requests:
        raise RuntimeError(f"the simulated benchmark completed {len(done)} turns, fewer than the {requests} measured")
    sent = done[:requests]
    ttft_ms = [r.ttft_s * 1e3 for r in sent]
    tpot_ms = [(r.completion_s - r.arrival_s - r.ttft_s) / (r.output_tokens - 1) * 1e3 for r in sent if r.output_tokens > 1]
    return {"ttft_mean": statistics.fmean(ttft_ms), "ttft_p50": statistics.median(ttft_ms),
            "tpot_mean": statistics.fmean(tpot_ms)}


def heldout_rows(sources: Mapping[str, HardwareEfficiencies | None], tps: Sequence[int] = TPS,
                 figures: Sequence[HeldoutFigure] | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Per efficiency source (None: ``bidikv profile``'s default) and TP: every held-out figure, predicted."""
    figures = list(figures if figures is not None else load_heldout())
    rows = []
    for label, eff in sources.items():
        for tp in tps:
            profile = profile_from_architecture(CONFIG, HARDWARE, tp, eff, name=MODEL)
            predicted: dict[tuple[str, int], dict[str, float]] = {}
            for fig in figures:
                key = (fig.mode, fig.requests)
                if key not in predicted:
                    predicted[key] = simulate_benchmark(profile, fig.mode == "on", fig.requests, seed)
                value = predicted[key][f"{fig.metric}_{fig.statistic}"]
                rows.append({"trained_on": label, "model": f"{fig.model} (TP{tp})", "tp": tp, "mode": fig.mode,
                             "metric": fig.metric, "statistic": fig.statistic, "prompt_tokens": None,
                             "measured_ms": fig.measured_ms, "predicted_ms": value,
                             "rel_error": value / fig.measured_ms - 1.0, "source": "simulator",
                             "carried_from": profile.provenance["carried_from"]})
    return rows
