"""Run sweep points: a local process pool by default, or Ray. Results come back in candidate order,
and each point is a pure function of (config, overrides), so both executors give the same numbers."""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import sys
from typing import Any, Sequence

from sim.config import SimConfig
from sim.tune.evaluate import evaluate


def run_points(config: SimConfig | Sequence[SimConfig], overrides: Sequence[dict[str, Any]], executor: str = "process",
               workers: int | None = None, progress: bool | None = None) -> list[dict[str, Any]]:
    """``config`` is the base of every point, or one base per point (e.g. one per client behaviour)."""
    if progress is None:
        progress = sys.stderr.isatty()
    configs = list(config) if isinstance(config, (list, tuple)) else [config] * len(overrides)
    if len(configs) != len(overrides):
        raise ValueError(f"{len(configs)} configs for {len(overrides)} points")
    if executor == "serial":
        return [evaluate(c, o) for c, o in _progress(list(zip(configs, overrides)), progress)]
    if executor == "ray":
        return _run_ray(configs, overrides, progress, workers)
    if executor != "process":
        raise ValueError(f"executor must be process, ray or serial, got {executor!r}")
    results: list[dict[str, Any] | None] = [None] * len(overrides)
    pool = _pool(workers or os.cpu_count() or 1)
    futures = {pool.submit(evaluate, c, o): i for i, (c, o) in enumerate(zip(configs, overrides))}
    for future in _progress(concurrent.futures.as_completed(futures), progress, total=len(futures)):
        results[futures[future]] = future.result()
    return results  # type: ignore[return-value]


_POOLS: dict[int, concurrent.futures.ProcessPoolExecutor] = {}


def _pool(workers: int) -> concurrent.futures.ProcessPoolExecutor:
    """One pool per size for the life of the process: screening runs points a batch at a time, and a
    worker keeps the workload it generated (sim/tune/evaluate.py) from one batch to the next."""
    if workers not in _POOLS:
        _POOLS[workers] = concurrent.futures.ProcessPoolExecutor(max_workers=workers)
        if len(_POOLS) == 1:
            atexit.register(_shutdown)
    return _POOLS[workers]


def _shutdown() -> None:
    for pool in _POOLS.values():
        pool.shutdown(cancel_futures=True)
    _POOLS.clear()


def _run_ray(configs: Sequence[SimConfig], overrides: Sequence[dict[str, Any]], progress: bool,
             workers: int | None = None) -> list[dict[str, Any]]:
    try:
        import ray
    except ImportError:
        raise ValueError("--executor ray needs Ray: pip install 'bidikv[ray]'") from None
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        # a local Ray starts with --workers CPUs (a cluster at RAY_ADDRESS has its own)
        local = {} if address or workers is None else {"num_cpus": workers}
        ray.init(address=address, include_dashboard=False, log_to_driver=False, **local)
    remote = ray.remote(evaluate)
    refs = [remote.remote(c, o) for c, o in zip(configs, overrides)]
    pending = list(refs)
    bar = _bar(progress, len(refs))
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        if bar is not None:
            bar.update(len(done))
    if bar is not None:
        bar.close()
    return ray.get(refs)


def _bar(progress: bool, total: int):
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="config", desc="tune", leave=False)


def _progress(iterable, progress: bool, total: int | None = None):
    if not progress:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, unit="config", desc="tune", leave=False)
