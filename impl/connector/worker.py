"""Worker side: vLLM's pull worker (the NIXL mechanics), with the agent's threading under our control.

vLLM builds its NIXL agent inside ``NixlBaseConnectorWorker.__init__`` as
``nixl_agent_config(num_threads=<extra config num_threads, default 4>, capture_telemetry=True)``;
NIXL's Python API then starts the agent's progress thread with ``pthrDelay = 0``, i.e. a thread that
spins without ever sleeping. On a small CPU machine those threads busy-poll the cores the model needs
(measured on this project's 2-core machine, impl/connector/README.md: 100 % system CPU while idle,
128 KiB transfers taking up to 25 s, an engine hang).

Turning the progress thread off is not the answer: a NIXL READ over UCX (tcp wire-up, cma bytes)
completes only when the *holder* of the blocks progresses its UCX worker too, and vLLM progresses it
only from engine steps -- measured here, a holder whose engine was not stepping left its peer's READ
pending until the lease ran out (30 s), and reads took 1-47 s. So this worker keeps the progress thread
and gives it a delay: vLLM's ``nixl_agent_config(...)`` call goes through :func:`agent_config_factory`
(forcing ``enable_prog_thread`` and, unless the extra config sets it, ``num_threads``), and the agent's
``pthrDelay`` is set to ``bidikv_nixl_progress_delay_us`` (default 1000 us) instead of 0. NIXL's
threaded UCX engine then waits for events between progress rounds instead of spinning: in a raw NIXL
test (holder never polling from Python) 128 KiB READs took 0.3-6 ms with the holder's process at ~1 %
CPU. ``bidikv_nixl_progress_delay_us: 0`` restores NIXL's spinning thread.

**CPU affinity.** On a CPU device vLLM 0.32's worker ``__init__`` calls ``os.sched_setaffinity(0,
[last core of each NUMA node])`` ("reserve different cores for start_load_kv() from model_forward()",
``nixl/base_worker.py``); the calling thread is the worker's main thread, the one that runs the model. So
on one host every P and D runs its forward passes on the same last core (measured on this project's
2-core machine: both workers' main threads on core 1, core 0 nearly idle, and a P pinned to core 0 by its
launcher still computing on core 1 beside D). With ``bidikv_keep_cpu_affinity`` (default on) this worker
puts back the mask the process had before; off keeps vLLM's. GPU workers are not re-pinned by vLLM and
are left alone either way.

Nothing else of the worker changes: the READs, notifications, expiry checks and failure handling are
vLLM's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as _base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

from impl.connector.stats import BidikvKVConnectorStats
from impl.connector.config import ConnectorSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("bidikv.connector")

_PATCH_LOCK = threading.Lock()
_DEBUG = os.environ.get("BIDIKV_CONNECTOR_DEBUG") == "1"


def agent_config_factory(original: Callable[..., Any], overrides: dict[str, Any]) -> Callable[..., Any]:
    """``nixl_agent_config`` with ``overrides`` replacing whatever vLLM passes for those keywords."""

    def factory(*args: Any, **kwargs: Any) -> Any:
        kwargs.update(overrides)
        return original(*args, **kwargs)

    factory.bidikv_overrides = dict(overrides)  # type: ignore[attr-defined]
    return factory


def _bindings_of(config_class: Any) -> Any:
    """NIXL's compiled bindings module as the Python API module of ``config_class`` imported it."""
    module = sys.modules.get(getattr(config_class, "__module__", ""), None)
    return getattr(module, "nixlBind", None)


@contextlib.contextmanager
def patched_agent_config(overrides: dict[str, Any], progress_delay_us: int | None = None) -> Iterator[None]:
    """For one worker __init__: route vLLM's ``nixl_agent_config(...)`` through ``overrides`` and, if
    ``progress_delay_us`` is given, build the agent with that progress-thread delay (NIXL's Python API
    hardcodes 0)."""
    with _PATCH_LOCK:
        original = _base_worker.nixl_agent_config
        if original is None:  # NIXL without agent config support: vLLM passes no config at all
            yield
            return
        _base_worker.nixl_agent_config = agent_config_factory(original, overrides)
        bindings = _bindings_of(original) if progress_delay_us is not None else None
        original_agent = getattr(bindings, "nixlAgent", None)
        if original_agent is not None:
            def agent_with_delay(name: str, agent_config: Any) -> Any:
                agent_config.pthrDelay = progress_delay_us
                return original_agent(name, agent_config)

            bindings.nixlAgent = agent_with_delay
        elif progress_delay_us is not None:
            log.warning("bidikv: cannot set NIXL's progress-thread delay with this NIXL build; it may spin")
        try:
            yield
        finally:
            _base_worker.nixl_agent_config = original
            if original_agent is not None:
                bindings.nixlAgent = original_agent


def _affinity() -> set[int] | None:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None


def restore_affinity(before: set[int] | None) -> bool:
    """Put the calling thread's CPU mask back to ``before`` if something changed it; True if it did."""
    now = _affinity()
    if before is None or now is None or now == before:
        return False
    os.sched_setaffinity(0, before)
    log.info("bidikv: vLLM pinned the model thread to CPUs %s; restored %s (bidikv_keep_cpu_affinity)",
             sorted(now), sorted(before))
    return True


class BidikvPullWorker(NixlPullConnectorWorker):
    def __init__(self, vllm_config: "VllmConfig", engine_id: str, kv_cache_config: "KVCacheConfig",
                 settings: ConnectorSettings) -> None:
        self.settings = settings
        overrides = settings.agent_config_overrides()
        delay = settings.nixl_progress_delay_us if settings.nixl_progress_thread else None
        affinity = _affinity()
        with patched_agent_config(overrides, delay):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        if settings.keep_cpu_affinity:
            restore_affinity(affinity)
        # vLLM aggregates the scheduler's stats into ours key by key: one class with every key
        self.xfer_stats = BidikvKVConnectorStats()
        log.info("bidikv connector worker %s: NIXL agent with %s, progress delay %s us", engine_id,
                 ", ".join(f"{k}={v}" for k, v in overrides.items()), delay)

    # -- diagnostics (BIDIKV_CONNECTOR_DEBUG=1): how often vLLM polls NIXL, what is in flight ------------
    def get_transfer_results(self):
        results = super().get_transfer_results()
        if _DEBUG:
            now = time.monotonic()
            self._polls = getattr(self, "_polls", 0) + 1
            last = getattr(self, "_last_report", None)
            if last is None:
                self._last_report = now
            elif now - last >= 2.0:
                log.warning("bidikv worker %s: %.0f polls/s, %d reads in flight, %d blocks held for peers, "
                            "%d reads done, %d sends done", self.engine_id, self._polls / (now - last),
                            len(self._recving_transfers), len(self._reqs_to_send), len(results.finished_recving),
                            len(results.finished_sending))
                self._polls, self._last_report = 0, now
        return results
