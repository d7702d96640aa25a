"""``bidikv calibrate`` and ``bidikv profile`` with the simulator passed in: calibration's commands
(calibration.cli) as ``bidikv`` registers them.

Calibration is a layer below the simulator and never imports it (``tools/import_graph.py --layers``),
yet ``calibrate`` compares the profiles with the simulator and both commands' leave-one-model-out
figures come from it. So the commands take the simulator as a parameter, and this module, above both
layers, passes it in: :func:`load_simulator` (called when a command runs, so ``bidikv --help`` loads
no simulator) returns

* ``sim.replay.published.simulate_published_point``: ``calibrate``'s simulated column (the published figures);
* ``sim.replay.published.simulate_heldout_benchmark``: vLLM PR #32553's benchmark, the model no fit has seen
  (``calibrate --leave-one-model-out``, and the expected error ``profile`` prints).

``python -m sim.commands.calibrate calibrate|profile ...`` runs the commands standalone, as ``bidikv`` does;
``python -m sim.commands.calibrate loo [--json|--markdown] [--seed N]`` prints calibration.loo's report.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

from calibration import cli


def load_simulator() -> cli.Simulator:
    from sim.replay.published import simulate_heldout_benchmark, simulate_published_point

    return cli.Simulator(published_point=simulate_published_point, heldout_benchmark=simulate_heldout_benchmark)


def register(subparsers: Any) -> None:
    cli.register(subparsers, load_simulator)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["loo"]:
        from calibration import loo

        return loo.main(argv[1:], simulate_benchmark=load_simulator().heldout_benchmark)
    return cli.main(argv, load_simulator)


if __name__ == "__main__":
    raise SystemExit(main())
