"""Host contention: P's prefill slowed while the host's decode is busy (P and D sharing CPU cores).

On the CPU rehearsal (tests/e2e: P, D and the router on one 2-core machine) a turn that starts while
another one decodes, or less than about a second after one finished, takes about twice as long to its
first token: the processes contend for the cores, and the connector's reader keeps polling for about a
second after each step (:mod:`calibration.busy`). A GPU deployment with P and D on separate nodes has no
such coupling, so this is not part of a latency profile's physics: it is a rig property that
:mod:`calibration.from_bench` fits (``busy_factor``) and that ``bidikv validate`` attaches to the
simulated cluster it replays a bench run through. Deterministic: it reads only the simulator's clock
and state.

The same definition as the fit, evaluated per prefill step instead of per turn start: busy when a
decode instance has sequences running or joining, or finished one less than ``window_s`` ago.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence


@dataclass(frozen=True, slots=True)
class HostContention:
    window_s: float = 0.0  # busy this long after the last decode finished; 0 = never busy after decode ends
    factor: float = 0.0  # a busy prefill step takes (1 + factor) x its profile time; 0 = no contention

    def __post_init__(self) -> None:
        if not (math.isfinite(self.window_s) and self.window_s >= 0 and math.isfinite(self.factor) and self.factor >= 0):
            raise ValueError(f"host contention needs finite window_s >= 0 and factor >= 0, got {self}")


class _ContendedProfile:
    """A profile whose prefill step is (1 + factor) x slower while ``busy()``; everything else delegated."""

    def __init__(self, profile: Any, busy: Callable[[], bool], factor: float) -> None:
        self._profile, self._busy, self._factor = profile, busy, factor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._profile, name)

    def prefill_step_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        t = self._profile.prefill_step_s(chunks)
        return t * (1.0 + self._factor) if self._busy() else t


def attach(cluster: Any, contention: HostContention) -> None:
    """Slow ``cluster``'s prefill steps while its decode is busy (before ``cluster.run``)."""
    if contention.factor == 0:
        return
    env = cluster.env
    last_finish = [-math.inf]
    for d in cluster.decode:
        def on_finish(node: Any, seq: Any, expires_at: Any, _inner: Callable = d.on_finish) -> None:
            last_finish[0] = env.now
            _inner(node, seq, expires_at)

        d.on_finish = on_finish

    def busy() -> bool:
        return (env.now - last_finish[0] < contention.window_s
                or any(d.running or d._joining for d in cluster.decode))

    for p in cluster.prefill:
        p.profile = _ContendedProfile(p.profile, busy, contention.factor)
