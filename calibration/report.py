"""Measured vs simulated: the published figures beside what a profile produces, and the two charts.

The "simulated" column comes from the simulator when the caller passes one in (:data:`SimulatedPoint`:
``sim.replay.published.simulate_published_point(profile, prompt_tokens, bidirectional, seed)``, medians over
simulated turns; calibration is a layer below the simulator and does not import it), otherwise from the
closed form (calibration.closed_form: the simulator's assembly without contention). Which one was used
is carried in every record and printed; the closed form is never passed off as the simulator.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from calibration.closed_form import turn_metrics
from calibration.profile import LatencyProfile
from calibration.published import BenchmarkShape, PublishedFigure

SIMULATOR, CLOSED_FORM = "simulator", "closed-form"
PointFn = Callable[[LatencyProfile, int, bool], Mapping[str, float]]
# (profile, prompt_tokens, bidirectional, seed) -> ttft_s, prefill_s, transfer_s: the simulator's run of
# the published benchmark, passed in by a caller above both layers (sim.commands.calibrate)
SimulatedPoint = Callable[[LatencyProfile, int, bool, int], Mapping[str, float]]
NO_SIMULATOR = "no simulator passed in"


@dataclass(frozen=True)
class Source:
    kind: str  # SIMULATOR or CLOSED_FORM
    description: str
    point: PointFn = field(repr=False)


def closed_form_source(reason: str = "", shape: BenchmarkShape = BenchmarkShape()) -> Source:
    def point(profile: LatencyProfile, prompt_tokens: int, bidirectional: bool) -> Mapping[str, float]:
        return turn_metrics(profile, prompt_tokens, bidirectional, shape.user_tokens, shape.local_hit_tokens)

    why = f" ({reason})" if reason else ""
    return Source(CLOSED_FORM, "closed form: calibration.closed_form, the simulator's assembly, one turn without "
                               f"contention, user tokens {shape.user_tokens}{why}", point)


def resolve_source(requested: str = "auto", seed: int = 0, simulator: SimulatedPoint | None = None,
                   missing: str = NO_SIMULATOR) -> Source:
    """``auto``: ``simulator`` if one is passed in, else the closed form; ``sim``: the simulator or an
    error; ``closed-form``: the closed form. ``missing`` says why there is no simulator (in the closed
    form's description, or the error)."""
    if requested not in ("auto", "sim", CLOSED_FORM):
        raise ValueError(f"source must be auto, sim or {CLOSED_FORM}, got {requested!r}")
    if requested == CLOSED_FORM:
        return closed_form_source("requested")
    if simulator is None:
        if requested == "sim":
            raise ValueError(missing)
        return closed_form_source(missing)

    def point(profile: LatencyProfile, prompt_tokens: int, bidirectional: bool) -> Mapping[str, float]:
        return simulator(profile, prompt_tokens, bidirectional, seed)

    name = f"{simulator.__module__}.{simulator.__qualname__}"  # sim.replay.published.simulate_published_point
    return Source(SIMULATOR, f"simulator: {name} (seed {seed})", point)


def records(profiles: Mapping[str, LatencyProfile], figures: Sequence[PublishedFigure], source: Source
            ) -> list[dict[str, Any]]:
    """One record per published figure: model, prompt_tokens, metric, mode, measured_ms,
    simulated_ms, rel_error, source."""
    cache: dict[tuple[str, int, bool], Mapping[str, float]] = {}
    out = []
    for fig in figures:
        if fig.model not in profiles:
            continue
        key = (fig.model, fig.prompt_tokens, fig.bidirectional)
        if key not in cache:
            cache[key] = source.point(profiles[fig.model], fig.prompt_tokens, fig.bidirectional)
        simulated_ms = float(cache[key][f"{fig.metric}_s"]) * 1e3
        out.append({"model": fig.model, "prompt_tokens": fig.prompt_tokens, "metric": fig.metric, "mode": fig.mode,
                    "measured_ms": fig.measured_ms, "simulated_ms": simulated_ms,
                    "rel_error": simulated_ms / fig.measured_ms - 1.0, "source": source.kind})
    return out


def prompt_grid(figures: Sequence[PublishedFigure], model: str, points: int = 8) -> list[int]:
    published = sorted({f.prompt_tokens for f in figures if f.model == model})
    top = max(published)
    grid = {round(top * (i + 1) / points) for i in range(points)} | set(published)
    return sorted(grid)


def write_plots(profiles: Mapping[str, LatencyProfile], figures: Sequence[PublishedFigure], source: Source,
                out_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """Per model: TTFT vs prompt length (ON/OFF) and the prefill split into recompute and KV transfer,
    the measured points overlaid. PNG, one pair per model."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for model, profile in profiles.items():
        grid = prompt_grid(figures, model)
        points = {(n, on): source.point(profile, n, on) for n in grid for on in (False, True)}
        measured = {(f.prompt_tokens, f.mode, f.metric): f.measured_ms for f in figures if f.model == model}
        label = "simulated" if source.kind == SIMULATOR else "closed form"

        fig = Figure(figsize=(6.4, 4.2))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for on, colour, name in ((False, "tab:red", "OFF"), (True, "tab:blue", "ON (bidirectional)")):
            ax.plot([n / 1e3 for n in grid], [points[(n, on)]["ttft_s"] * 1e3 for n in grid], color=colour,
                    label=f"{name}, {label}")
            mode = "on" if on else "off"
            xs = [n for (n, m, k) in measured if m == mode and k == "ttft"]
            ax.scatter([n / 1e3 for n in xs], [measured[(n, mode, "ttft")] for n in xs], color=colour, marker="o",
                       edgecolors="black", zorder=3, label=f"{name}, measured")
        ax.set_xlabel("prompt length (k tokens)")
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"{model}: TTFT vs prompt length ({profile.hardware}, TP{profile.tp}, 1P1D)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        path = out / f"{profile.name}-ttft.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        written.append(path)

        fig = Figure(figsize=(7.2, 4.2))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        width = 0.38
        seen: set[str] = set()

        def once(text: str) -> str | None:  # each legend entry once
            if text in seen:
                return None
            seen.add(text)
            return text

        for i, n in enumerate(grid):
            off, on = points[(n, False)], points[(n, True)]
            ax.bar(i - width / 2, off["prefill_s"] * 1e3, width, color="tab:red", alpha=0.8,
                   label=once("OFF: recompute"))
            ax.bar(i + width / 2, on["transfer_s"] * 1e3, width, color="tab:green", alpha=0.8,
                   label=once("ON: KV transfer (D->P)"))
            ax.bar(i + width / 2, (on["prefill_s"] - on["transfer_s"]) * 1e3, width, bottom=on["transfer_s"] * 1e3,
                   color="tab:blue", alpha=0.8, label=once("ON: recompute (suffix + reuse overhead)"))
            for mode, dx in (("off", -width / 2), ("on", width / 2)):
                if (n, mode, "prefill") in measured:
                    ax.scatter(i + dx, measured[(n, mode, "prefill")], color="black", marker="D", zorder=3,
                               label=once("measured prefill"))
            if (n, "on", "transfer") in measured:
                ax.scatter(i + width / 2, measured[(n, "on", "transfer")], color="white", edgecolors="black",
                           marker="s", zorder=3, label=once("measured KV transfer"))
        ax.set_xticks(range(len(grid)), [f"{n / 1e3:.1f}k" for n in grid])
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("prefill duration (ms)")
        ax.set_title(f"{model}: prefill split, recompute vs KV transfer ({label})")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
        path = out / f"{profile.name}-prefill-split.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        written.append(path)
    return written
