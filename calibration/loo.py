"""Leave one model out: how far a profile for a model nobody measured can be trusted, from data.

Two kinds of held-out prediction, printed by ``bidikv calibrate --leave-one-model-out`` (or
``python -m sim.commands.calibrate loo [--json|--markdown]``):

* **across kernel families, published figures** (closed form, calibration.fit.leave_one_out): fit on one
  measured model's ten figures alone (EFA at line rate: nothing from the other model), build the other
  model's profile from its config.json, predict its ten figures. Qwen3-32B (BF16 dense GQA) and GLM-5-FP8
  (FP8 MoE MLA) share no kernel family, so this is the error of a profile whose family nobody measured.
* **within a kernel family, a model no fit has seen** (simulator, calibration.heldout): Llama-3.3-70B on
  p5en (vLLM PR #32553), predicted by ``bidikv profile``'s default (the same-family model's fit: Qwen3-32B),
  and, to show what the family rule buys, by GLM-5-FP8's fit and by the two-model compromise.

The summary gives per (trained on, predicted model, metric group) the median and max |error| and the
signed range: the numbers ``bidikv profile`` prints as what to expect.

The held-out part runs the simulator, which calibration does not import: :func:`report` and :func:`main`
take it as a parameter (calibration.heldout.SimulatedBenchmark), and ``sim.commands.calibrate`` passes it in.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any, Sequence

from calibration.error_bands import error_band

if TYPE_CHECKING:
    from calibration.heldout import SimulatedBenchmark

GROUPS = {"transfer": "transfer", "prefill": "prefill/TTFT", "ttft": "prefill/TTFT", "tpot": "TPOT"}
DEFAULT_SOURCE = "bidikv profile default"
WRONG_FAMILY = "GLM-5-FP8 family"
NO_FAMILY = "no-family fallback"
ONE_FIT = "one fit to both models (no family rule)"


def published_rows() -> list[dict[str, Any]]:
    from calibration.fit import leave_one_out

    return [{**r, "statistic": "single request", "tp": 8, "source": "closed form"} for r in leave_one_out()]


def heldout_sources(with_alternatives: bool = True) -> dict[str, Any]:
    """``bidikv profile``'s default, and to show what its family rule buys: GLM-5-FP8's prefill terms (the
    wrong family, same engine overheads), the fallback of a model of no measured family, and the
    one fit to both models (every term fitted to Qwen3-32B and GLM-5-FP8 together, ``data/p5en_efficiencies.json``)."""
    from calibration.efficiencies import load_efficiencies
    from calibration.portable import efficiencies_for

    sources: dict[str, Any] = {DEFAULT_SOURCE: None}
    if with_alternatives:
        sources[WRONG_FAMILY] = efficiencies_for("GLM-5-FP8")[0]
        sources[NO_FAMILY] = efficiencies_for(None)[0]
        sources[ONE_FIT] = load_efficiencies("p5en")
    return sources


def summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str, str], list[float]] = {}
    for r in rows:
        key = (r["trained_on"], r["model"], GROUPS[r["metric"]])
        groups.setdefault(key, []).append(r["rel_error"])
    return [{"trained_on": t, "model": m, "group": g, **error_band(e)} for (t, m, g), e in groups.items()]


def report(simulate_benchmark: SimulatedBenchmark, with_alternatives: bool = True, seed: int = 0) -> dict[str, Any]:
    """Both parts and their summary; the held-out part runs ``simulate_benchmark`` (the simulator, passed in:
    sim.replay.published.simulate_heldout_benchmark)."""
    from calibration.heldout import heldout_rows

    published = published_rows()
    heldout = heldout_rows(heldout_sources(with_alternatives), simulate_benchmark, seed=seed)
    return {"published": published, "heldout": heldout, "summary": summary(published + heldout)}


def _pct(x: float) -> str:
    return f"{100 * x:+.1f} %"


def format_text(rep: dict[str, Any]) -> str:
    lines = ["Across kernel families: fit on one measured model alone, predict the other's published figures "
             "(closed form, single requests, TP8)"]
    for r in rep["published"]:
        lines.append(f"  {r['trained_on']:10} -> {r['model']:10} {r['prompt_tokens']:6d} {r['mode']:3} {r['metric']:8} "
                     f"measured {r['measured_ms']:7.1f} ms  predicted {r['predicted_ms']:7.1f} ms  {_pct(r['rel_error']):>9}")
    lines.append("\nWithin a kernel family: Llama-3.3-70B on p5en, vLLM PR #32553, never fitted (simulator; the PR does "
                 "not state TP, so TP4 and TP8)")
    for r in rep["heldout"]:
        lines.append(f"  {r['trained_on']:24} -> {r['model']:20} {r['mode']:3} {r['metric']} {r['statistic']:4} "
                     f"measured {r['measured_ms']:7.1f} ms  predicted {r['predicted_ms']:7.1f} ms  {_pct(r['rel_error']):>9}")
    lines.append("\nSummary: |error| median / max (signed range)")
    for s in rep["summary"]:
        lines.append(f"  {s['trained_on']:24} -> {s['model']:20} {s['group']:13} {s['points']:2d} points  "
                     f"{100 * s['median_abs_error']:5.1f} % / {100 * s['max_abs_error']:5.1f} %  "
                     f"({_pct(s['min_error'])} to {_pct(s['max_error'])})")
    return "\n".join(lines)


def format_markdown(rep: dict[str, Any]) -> str:
    lines = ["| trained on | predicted | what | points | \\|error\\| median | \\|error\\| max | signed range |",
             "|---|---|---|---:|---:|---:|---|"]
    for s in rep["summary"]:
        lines.append(f"| {s['trained_on']} | {s['model']} | {s['group']} | {s['points']} | "
                     f"{100 * s['median_abs_error']:.1f} % | {100 * s['max_abs_error']:.1f} % | "
                     f"{_pct(s['min_error'])} to {_pct(s['max_error'])} |")
    return "\n".join(lines)


COMMAND = "python -m sim.commands.calibrate loo"  # main with the simulator passed in


def main(argv: Sequence[str] | None = None, simulate_benchmark: SimulatedBenchmark | None = None,
         prog: str = COMMAND) -> int:
    """The report on stdout; ``simulate_benchmark`` None (``python -m calibration.loo``): exit 2, naming
    the command that passes the simulator in."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows and the summary as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the summary as a markdown table")
    parser.add_argument("--seed", type=int, default=0, help="workload seed of the held-out simulation (default: 0)")
    args = parser.parse_args(argv)
    if simulate_benchmark is None:
        print(f"{parser.prog}: error: the held-out part runs the simulator, which calibration does not import: "
              f"{COMMAND} [--json|--markdown] [--seed N] passes it in", file=sys.stderr)
        return 2
    rep = report(simulate_benchmark, seed=args.seed)
    if args.json:
        print(json.dumps(rep, indent=2))
    elif args.markdown:
        print(format_markdown(rep))
    else:
        print(format_text(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m calibration.loo"))
