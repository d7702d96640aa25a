"""Worker side: the NIXL agent vLLM builds gets our threading settings -- on real NIXL.

Every agent here is a real ``nixl._api.nixl_agent`` with its UCX backend (no bytes move). What the
agent was built with is read back from the agent itself where NIXL exposes it (the UCX backend's
``num_threads``) and otherwise (``useProgThread``, ``pthrDelay``, which NIXL passes to its compiled
``nixlAgent`` and never exposes) by :class:`BindingsWatch`, which wraps -- does not replace -- the
compiled bindings' ``nixlAgent`` constructor and records the real config struct's fields on the way in.
"""

from __future__ import annotations

import os

import pytest

import nixl._api as nixl_api  # part of the test setup (the 'impl' extra): missing is a failure, not a skip
import vllm  # noqa: F401  (same)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker  # noqa: E402

from impl.connector.worker import agent_config_factory, patched_agent_config  # noqa: E402


class BindingsWatch:
    """Records (useProgThread, pthrDelay) of every agent the compiled bindings create, then creates it."""

    def __init__(self, monkeypatch) -> None:
        self.created: list[tuple[bool, int]] = []
        real = nixl_api.nixlBind.nixlAgent

        def nixlAgent(name, agent_config):  # noqa: N802 - the bindings' name
            self.created.append((agent_config.useProgThread, agent_config.pthrDelay))
            return real(name, agent_config)

        monkeypatch.setattr(nixl_api.nixlBind, "nixlAgent", nixlAgent)
        self.installed = nixlAgent


@pytest.fixture
def bindings(monkeypatch) -> BindingsWatch:
    return BindingsWatch(monkeypatch)


def ucx_threads(agent) -> int:
    return int(agent.get_backend_params("UCX").get("num_threads", 0))


def test_overrides_replace_what_vllm_passes():
    factory = agent_config_factory(nixl_api.nixl_agent_config, {"enable_prog_thread": False, "num_threads": 1})
    config = factory(num_threads=4, capture_telemetry=True)  # vLLM 0.32's call
    assert isinstance(config, nixl_api.nixl_agent_config)
    assert config.enable_pthread is False and config.num_threads == 1 and config.capture_telemetry is True


def test_nixl_alone_spins_its_progress_thread(bindings):
    """The reason for the patch: NIXL's Python API builds every agent with pthrDelay = 0."""
    agent = nixl_api.nixl_agent("plain", nixl_api.nixl_agent_config(enable_prog_thread=True, num_threads=2))
    assert bindings.created == [(True, 0)] and ucx_threads(agent) == 2


def test_patch_is_scoped_to_the_worker_construction(bindings):
    assert base_worker.nixl_agent_config is nixl_api.nixl_agent_config  # vLLM resolved the real class
    with patched_agent_config({"enable_prog_thread": True, "num_threads": 1}, progress_delay_us=250):
        inside = base_worker.nixl_agent_config(num_threads=4, capture_telemetry=True)  # what vLLM calls
        agent = base_worker.NixlWrapper("inside", inside)
    outside = base_worker.NixlWrapper("outside", base_worker.nixl_agent_config(num_threads=3))
    assert bindings.created == [(True, 250), (True, 0)]  # our delay inside only
    assert ucx_threads(agent) == 1 and ucx_threads(outside) == 3
    assert base_worker.nixl_agent_config is nixl_api.nixl_agent_config
    assert nixl_api.nixlBind.nixlAgent is bindings.installed  # the bindings are as they were before


@pytest.fixture
def single_process_group(model_dir):
    """vLLM's worker asks for its TP/PCP ranks: a one-process gloo group, as vLLM's unit tests set up."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment

    from tests.connector.harness import make_vllm_config
    from tests.e2e.deployment import free_port

    if not parallel_state.model_parallel_is_initialized():
        with set_current_vllm_config(make_vllm_config(model_dir, "kv_consumer", {})):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
            ensure_model_parallel_initialized(1, 1)
    yield


@pytest.mark.parametrize("extra, expect_prog, expect_threads, expect_delay", [
    ({}, True, 1, 1000),  # our defaults
    ({"num_threads": 4, "bidikv_nixl_progress_delay_us": 0}, True, 4, 0),  # vLLM's and NIXL's own behaviour
    ({"num_threads": 0, "bidikv_nixl_progress_thread": False}, False, 0, 0),
])
def test_connector_worker_builds_its_agent_with_our_settings(model_dir, single_process_group, bindings,
                                                             extra, expect_prog, expect_threads, expect_delay):
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.platforms import current_platform

    from impl.connector.connector import NixlConnector
    from impl.connector.worker import BidikvPullWorker
    from tests.connector.harness import make_kv_cache_config, make_vllm_config

    if current_platform.device_type not in ("cpu", "cuda"):  # e.g. vLLM 0.33's GPU build on a CPU machine
        pytest.skip(f"vLLM has no usable platform here ({current_platform.device_type!r}): no worker can be built")

    vllm_config = make_vllm_config(model_dir, "kv_consumer", {"bidirectional_kv_xfer": True, **extra})
    with set_current_vllm_config(vllm_config):
        connector = NixlConnector(vllm_config, KVConnectorRole.WORKER, make_kv_cache_config())
    try:
        worker = connector.connector_worker
        assert isinstance(worker, BidikvPullWorker)
        assert isinstance(worker.nixl_wrapper, nixl_api.nixl_agent)  # a real agent
        assert bindings.created == [(expect_prog, expect_delay)]
        assert ucx_threads(worker.nixl_wrapper) == expect_threads
        assert base_worker.nixl_agent_config is nixl_api.nixl_agent_config  # restored after construction
    finally:
        connector.shutdown()


@pytest.mark.parametrize("keep", [True, False])
def test_the_model_threads_cpu_mask_survives_vllms_worker_init(model_dir, single_process_group, bindings, keep):
    """vLLM 0.32's CPU worker pins the constructing thread (the model thread) to the last core of each NUMA
    node; with bidikv_keep_cpu_affinity the mask the process had is put back. Run on the real vLLM worker:
    the thread starts on every core but that last one, so vLLM's pin is visible as a change."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.platforms import current_platform

    from impl.connector.connector import NixlConnector
    from tests.connector.harness import make_kv_cache_config, make_vllm_config

    if current_platform.device_type not in ("cpu", "cuda"):  # e.g. vLLM 0.33's GPU build on a CPU machine
        pytest.skip(f"vLLM has no usable platform here ({current_platform.device_type!r}): no worker can be built")
    if current_platform.device_type != "cpu":
        pytest.skip("vLLM re-pins only on a CPU device")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores to tell vLLM's pin from the mask the thread had")
    reserved = {max(c) for c in current_platform.discover_numa_topology()}
    before = set(cores) - reserved or {cores[0]}
    vllm_config = make_vllm_config(model_dir, "kv_consumer", {"bidirectional_kv_xfer": True,
                                                              "bidikv_keep_cpu_affinity": keep})
    original = os.sched_getaffinity(0)
    os.sched_setaffinity(0, before)
    try:
        with set_current_vllm_config(vllm_config):
            connector = NixlConnector(vllm_config, KVConnectorRole.WORKER, make_kv_cache_config())
        try:
            assert os.sched_getaffinity(0) == (before if keep else reserved)
        finally:
            connector.shutdown()
    finally:
        os.sched_setaffinity(0, original)
