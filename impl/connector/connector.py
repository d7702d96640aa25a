"""The class vLLM instantiates: ``NixlConnector``, a drop-in for vLLM's pull NixlConnector.

Named ``NixlConnector`` so vLLM's name-based checks (``has_connector("NixlConnector")``: KV layout,
DCP, CPU platform setup) treat it as the NIXL connector it is. It only validates the extra config
(:class:`~impl.connector.config.ConnectorSettings`) and builds our scheduler (scheduler role, in the
engine-core process) or our worker (worker role, in each worker process) instead of vLLM's; every
other method is vLLM's facade, forwarding to them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector, NixlPullConnector

from impl.connector.config import ConnectorSettings
from impl.connector.scheduler import BidikvPullScheduler
from impl.connector.stats import BidikvKVConnectorStats, BidikvPromMetrics
from impl.connector.worker import BidikvPullWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def settings_of(vllm_config: "VllmConfig") -> ConnectorSettings:
    kv_transfer_config = vllm_config.kv_transfer_config
    if kv_transfer_config is None:
        raise ValueError("kv_transfer_config must be set for the bidikv NixlConnector")
    return ConnectorSettings.from_extra_config(kv_transfer_config.kv_connector_extra_config)


class NixlConnector(NixlPullConnector):
    """vLLM's pull (READ) NIXL connector with impl.policy's decisions; see the package docstring."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        settings = settings_of(vllm_config)  # fails before anything is built, naming the bad key
        # NixlPullConnector.__init__ would build vLLM's scheduler/worker (a worker owns a NIXL agent):
        # run the common base and build ours instead.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        self.bidikv_settings = settings
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = BidikvPullScheduler(vllm_config, self.engine_id, kv_cache_config, settings)
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = BidikvPullWorker(vllm_config, self.engine_id, kv_cache_config, settings)
        else:
            raise ValueError(f"Unsupported KVConnectorRole: {role}")

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig"):
        # The engine core asks this before it builds workers or the KV cache: fail there, naming the key.
        if vllm_config.kv_transfer_config is not None:
            settings_of(vllm_config)
        return super().get_required_kvcache_layout(vllm_config)

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", *args: Any, **kwargs: Any):
        # Called in the API-server process before the engine starts: a bad extra config stops the
        # server there, with the key in the message, instead of in a child process's traceback.
        settings_of(vllm_config)
        return BidikvPromMetrics(vllm_config, *args, **kwargs)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return BidikvKVConnectorStats(data=data) if data is not None else BidikvKVConnectorStats()

    def get_kv_connector_stats(self):
        # scheduler side too: the prefix-verification counts are taken where reads are decided
        if self.connector_scheduler is not None:
            return self.connector_scheduler.take_stats()
        return super().get_kv_connector_stats()
