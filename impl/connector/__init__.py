"""bidikv's vLLM connector: vLLM's NixlConnector with every decision taken from impl.policy.

Load it with::

    --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_connector_module_path": "impl.connector",
                           "kv_role": "kv_producer" | "kv_consumer", "kv_buffer_device": "cpu",
                           "kv_connector_extra_config": {"bidirectional_kv_xfer": true, ...}}'

Reading guide, one concern per module:

* :mod:`~impl.connector.config`    -- the extra-config keys, defaults and their validation (pure)
* :mod:`~impl.connector.scheduler` -- scheduler side: pull or recompute on both paths, block
  alignment, D-side retention, the router notification (decisions from impl.policy)
* :mod:`~impl.connector.worker`    -- worker side: vLLM's NIXL mechanics with the agent's threading
  settings under our control (busy-polling)
* :mod:`~impl.connector.notify`    -- the background poster of impl.router.notify's contract (pure)
* :mod:`~impl.connector.compat`    -- the supported vLLM versions, checked before vLLM is touched
* :mod:`~impl.connector.connector` -- the ``NixlConnector`` facade vLLM instantiates

``config``, ``notify`` and ``compat`` import without vLLM; the connector itself is loaded lazily so
that importing them does not need vLLM, and loading it on an unsupported vLLM fails with a message
that says what to install.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NixlConnector"]


def __getattr__(name: str) -> Any:
    if name == "NixlConnector":
        from impl.connector.compat import check_vllm_version

        check_vllm_version()
        from impl.connector.connector import NixlConnector

        globals()["NixlConnector"] = NixlConnector
        return NixlConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
