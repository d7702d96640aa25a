"""Worker side: the NIXL agent vLLM builds gets our threading settings (NIXL faked at the agent)."""

from __future__ import annotations

import pytest

import vllm  # noqa: F401  (part of the test setup: a missing vLLM is a failure, not a skip)

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker  # noqa: E402

from impl.connector.worker import agent_config_factory, patched_agent_config  # noqa: E402


class FakeNixlAgentConfig:
    """Stands in for nixl._api.nixl_agent_config: records how vLLM configured the agent."""

    def __init__(self, enable_prog_thread=True, enable_listen_thread=False, capture_telemetry=False, num_threads=0,
                 backends=("UCX",)):
        self.enable_prog_thread = enable_prog_thread
        self.num_threads = num_threads
        self.capture_telemetry = capture_telemetry
        self.backends = list(backends)


class FakeBindingsAgentConfig:
    """Stands in for the compiled nixlBind.nixlAgentConfig struct."""

    pthrDelay = 0


class nixlBind:  # noqa: N801 - the name NIXL's Python API module gives its compiled bindings
    """Stands in for NIXL's compiled bindings: records the agent config the agent is created with."""

    created: list = []

    @staticmethod
    def nixlAgent(name, agent_config):  # noqa: N802
        nixlBind.created.append(agent_config)
        return object()


class FakeNixlWrapper:
    """Stands in for nixl._api.nixl_agent: like NIXL's, builds the bindings' agent config with
    ``pthrDelay = 0`` and creates the agent through ``nixlBind.nixlAgent``; moves no bytes."""

    built: list = []

    def __init__(self, name, config):
        self.name = name
        self.config = config
        agent_config = FakeBindingsAgentConfig()
        agent_config.useProgThread = config.enable_prog_thread
        agent_config.pthrDelay = 0
        self.agent = nixlBind.nixlAgent(name, agent_config)
        self.agent_config = agent_config
        type(self).built.append(self)


def test_overrides_replace_what_vllm_passes():
    factory = agent_config_factory(FakeNixlAgentConfig, {"enable_prog_thread": False, "num_threads": 1})
    config = factory(num_threads=4, capture_telemetry=True)  # vLLM 0.32's call
    assert config.enable_prog_thread is False and config.num_threads == 1 and config.capture_telemetry is True


def test_patch_is_scoped_to_the_worker_construction(monkeypatch):
    monkeypatch.setattr(base_worker, "nixl_agent_config", FakeNixlAgentConfig)
    original_agent = nixlBind.nixlAgent
    with patched_agent_config({"enable_prog_thread": False}, progress_delay_us=250):
        inside = base_worker.nixl_agent_config(num_threads=4, capture_telemetry=True)
        wrapper = FakeNixlWrapper("a", inside)
    assert inside.enable_prog_thread is False and inside.num_threads == 4
    assert wrapper.agent_config.pthrDelay == 250  # NIXL's Python API would have left 0 (spinning)
    assert base_worker.nixl_agent_config is FakeNixlAgentConfig and nixlBind.nixlAgent is original_agent


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
def test_connector_worker_builds_its_agent_with_our_settings(model_dir, single_process_group, monkeypatch,
                                                             extra, expect_prog, expect_threads, expect_delay):
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm.platforms import current_platform

    from impl.connector.connector import NixlConnector
    from impl.connector.worker import BidikvPullWorker
    from tests.connector.harness import make_kv_cache_config, make_vllm_config

    if current_platform.device_type not in ("cpu", "cuda"):  # e.g. vLLM 0.33's GPU build on a CPU machine
        pytest.skip(f"vLLM has no usable platform here ({current_platform.device_type!r}): no worker can be built")

    monkeypatch.setattr(base_worker, "NixlWrapper", FakeNixlWrapper)
    monkeypatch.setattr(base_worker, "nixl_agent_config", FakeNixlAgentConfig)
    FakeNixlWrapper.built = []
    vllm_config = make_vllm_config(model_dir, "kv_consumer", {"bidirectional_kv_xfer": True, **extra})
    with set_current_vllm_config(vllm_config):
        connector = NixlConnector(vllm_config, KVConnectorRole.WORKER, make_kv_cache_config())
    assert isinstance(connector.connector_worker, BidikvPullWorker)
    [agent] = FakeNixlWrapper.built
    assert agent.config.enable_prog_thread is expect_prog and agent.config.num_threads == expect_threads
    assert agent.agent_config.pthrDelay == expect_delay
    assert base_worker.nixl_agent_config is FakeNixlAgentConfig  # restored after construction
