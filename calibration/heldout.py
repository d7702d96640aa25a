"""A model no fit has seen: Llama-3.3-70B-Instruct on p5en (vLLM PR #32553), predicted through the simulator.

The PR's figures (``data/heldout_pr32553.csv``) are means and medians over vLLM's multi-turn benchmark,
not single-request points, so they are predicted the way they were measured: the PR's benchmark config
(``data/pr32553_multi_turn.json``, vLLM's ``generate_multi_turn.json`` format with the PR's parameters)
sent by vLLM's client loop as the simulator replays it (:mod:`sim.clients.bench`: 2 clients, 24 active
conversations served round robin, back to back, the run ends when the first conversation does), on 1P1D
with prefix caching OFF on P (``sim.replay.published.published_config``), by a profile that ``bidikv profile``
builds from the model's config.json with the efficiencies given. What the comparison has to assume:

* the PR does not state the instances' TP size: every figure is predicted at each of :data:`TPS`;
* the PR publishes the distributions, not its conversations: the simulated run sends its own draws
  (135 requests at seed 0, against the PR's 129 OFF and 126 ON).

TPOT per turn = (completion - arrival - TTFT) / (output tokens - 1), vLLM's definition.

The run itself is a parameter (:data:`SimulatedBenchmark`): the caller passes in
``sim.replay.published.simulate_heldout_benchmark``, since calibration is a layer below the simulator and does
not import it (``tools/import_graph.py --layers``).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from calibration.build import profile_from_architecture
from calibration.efficiencies import HardwareEfficiencies
from calibration.hardware import DATA_DIR
from calibration.published import commented_csv_rows

HELDOUT_CSV = DATA_DIR / "heldout_pr32553.csv"
CONFIG = DATA_DIR / "config_llama-3.3-70b.json"
MODEL = "Llama-3.3-70B"
HARDWARE = "p5en"
TPS = (4, 8)
BENCH_CONFIG = DATA_DIR / "pr32553_multi_turn.json"
ACTIVE_CONVERSATIONS = 24  # the PR's active_conversations: all 24 at once, 12 per client

# (profile, bidirectional, seed) -> ``ttft_mean``, ``ttft_p50``, ``tpot_mean`` (ms) and ``requests`` of the
# PR's benchmark as the simulator runs it: sim.replay.published.simulate_heldout_benchmark, passed in by the
# caller (calibration is a layer below the simulator and does not import it).
SimulatedBenchmark = Callable[[Any, bool, int], Mapping[str, float]]


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


def heldout_rows(sources: Mapping[str, HardwareEfficiencies | None], simulate: SimulatedBenchmark,
                 tps: Sequence[int] = TPS, figures: Sequence[HeldoutFigure] | None = None, seed: int = 0
                 ) -> list[dict[str, Any]]:
    """Per efficiency source (None: ``bidikv profile``'s default) and TP: every held-out figure, predicted
    by ``simulate`` (the simulator, passed in: :data:`SimulatedBenchmark`)."""
    figures = list(figures if figures is not None else load_heldout())
    rows = []
    for label, eff in sources.items():
        for tp in tps:
            profile = profile_from_architecture(CONFIG, HARDWARE, tp, eff, name=MODEL)
            predicted: dict[str, dict[str, float]] = {}
            for fig in figures:
                if fig.mode not in predicted:
                    predicted[fig.mode] = simulate(profile, fig.mode == "on", seed)
                value = predicted[fig.mode][f"{fig.metric}_{fig.statistic}"]
                rows.append({"trained_on": label, "model": f"{fig.model} (TP{tp})", "tp": tp, "mode": fig.mode,
                             "metric": fig.metric, "statistic": fig.statistic, "prompt_tokens": None,
                             "measured_ms": fig.measured_ms, "predicted_ms": value,
                             "rel_error": value / fig.measured_ms - 1.0, "source": "simulator",
                             "requests": fig.requests, "simulated_requests": int(predicted[fig.mode]["requests"]),
                             "carried_from": profile.provenance["carried_from"]})
    return rows
