"""Run sweep points: a local process pool by default, or Ray. Results come back in candidate order,
and each point is a pure function of (config, overrides), so both executors give the same numbers.

:class:`Runs` submits points as they are decided and hands back futures, so the tuner can keep every
worker busy: it submits what it will surely simulate before it screens, and the next point as soon
as a worker frees. A point asked for twice runs once.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import os
import sys
import time
from typing import Any, Sequence

from sim.engine.config import SimConfig
from sim.tune.evaluate import evaluate

EXECUTORS = ("process", "ray", "serial")


def timed_evaluate(config: SimConfig, overrides: dict[str, Any]) -> tuple[dict[str, Any], float, float]:
    """(figures, wall seconds, CPU seconds) of one point, measured where it runs."""
    wall, cpu = time.perf_counter(), time.process_time()
    metrics = evaluate(config, overrides)
    return metrics, time.perf_counter() - wall, time.process_time() - cpu


class Runs:
    """Points submitted to one executor, each run once, with how long the workers were busy."""

    def __init__(self, executor: str = "process", workers: int | None = None, progress: bool | None = None) -> None:
        if executor not in EXECUTORS:
            raise ValueError(f"executor must be process, ray or serial, got {executor!r}")
        self.executor = executor
        self._requested_workers = workers
        self.workers = 1 if executor == "serial" else (workers or os.cpu_count() or 1)
        self._submitted: dict[str, concurrent.futures.Future] = {}
        self._bar = _bar(sys.stderr.isatty() if progress is None else progress)
        self._remote: Any = None
        self.started = time.perf_counter()  # the workers' span begins when the tuner does
        self.simulations = 0
        self.busy_s = 0.0  # wall time workers spent in a point, summed over workers
        self.cpu_s = 0.0  # CPU time of the points (workers' own, load does not inflate it)
        self.last_done = self.started

    def submit(self, configs: Sequence[SimConfig], overrides: Sequence[dict[str, Any]]) -> list[concurrent.futures.Future]:
        """A future of each point's figures; a point already submitted keeps its first future."""
        if len(configs) != len(overrides):
            raise ValueError(f"{len(configs)} configs for {len(overrides)} points")
        out = []
        for config, override in zip(configs, overrides):
            key = repr(config) + json.dumps(override, sort_keys=True, default=repr)
            if key not in self._submitted:
                self._submitted[key] = self._start(config, override)
            out.append(self._submitted[key])
        return out

    def run(self, configs: Sequence[SimConfig], overrides: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        return [f.result() for f in self.submit(configs, overrides)]

    def idle_share(self) -> float:
        """Of the workers' time from the start to the last point's end, the share no point ran in."""
        span = (self.last_done - self.started) * self.workers
        return max(0.0, 1.0 - self.busy_s / span) if span > 0 else 0.0

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def _start(self, config: SimConfig, override: dict[str, Any]) -> concurrent.futures.Future:
        self.simulations += 1
        if self._bar is not None:
            self._bar.total += 1
            self._bar.refresh()
        if self.executor == "serial":
            timed: concurrent.futures.Future = concurrent.futures.Future()
            timed.set_result(timed_evaluate(config, override))
        elif self.executor == "ray":
            timed = self._ray().remote(config, override).future()
        else:
            timed = _pool(self.workers).submit(timed_evaluate, config, override)
        figures: concurrent.futures.Future = concurrent.futures.Future()

        def done(f: concurrent.futures.Future) -> None:
            if f.exception() is not None:
                figures.set_exception(f.exception())
                return
            metrics, wall, cpu = f.result()
            self.busy_s += wall
            self.cpu_s += cpu
            self.last_done = time.perf_counter()
            if self._bar is not None:
                self._bar.update(1)
            figures.set_result(metrics)

        timed.add_done_callback(done)
        return figures

    def _ray(self) -> Any:
        if self._remote is None:
            try:
                import ray
            except ImportError:
                raise ValueError("--executor ray needs Ray: pip install 'bidikv[ray]'") from None
            if not ray.is_initialized():
                address = os.environ.get("RAY_ADDRESS")
                # a local Ray starts with --workers CPUs (a cluster at RAY_ADDRESS has its own)
                local = {} if address or self._requested_workers is None else {"num_cpus": self._requested_workers}
                ray.init(address=address, include_dashboard=False, log_to_driver=False, **local)
            self._remote = ray.remote(timed_evaluate)
        return self._remote


def run_points(config: SimConfig | Sequence[SimConfig], overrides: Sequence[dict[str, Any]], executor: str = "process",
               workers: int | None = None, progress: bool | None = None) -> list[dict[str, Any]]:
    """``config`` is the base of every point, or one base per point (e.g. one per client behaviour)."""
    configs = list(config) if isinstance(config, (list, tuple)) else [config] * len(overrides)
    runs = Runs(executor, workers, progress)
    try:
        return runs.run(configs, overrides)
    finally:
        runs.close()


_POOLS: dict[int, concurrent.futures.ProcessPoolExecutor] = {}


def _pool(workers: int) -> concurrent.futures.ProcessPoolExecutor:
    """One pool per size for the life of the process: a worker keeps the workload it generated
    (sim/tune/evaluate.py) from one point to the next."""
    if workers not in _POOLS:
        _POOLS[workers] = concurrent.futures.ProcessPoolExecutor(max_workers=workers)
        if len(_POOLS) == 1:
            atexit.register(_shutdown)
    return _POOLS[workers]


def _shutdown() -> None:
    for pool in _POOLS.values():
        pool.shutdown(cancel_futures=True)
    _POOLS.clear()


def _bar(progress: bool):
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=0, unit="config", desc="tune", leave=False)
