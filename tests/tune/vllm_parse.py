"""Parse ``--kv-transfer-config`` values exactly as ``vllm serve`` does, in whatever vLLM is importable.

Run as a script (one vLLM version per interpreter: 0.33 shadows 0.32 through PYTHONPATH): reads a JSON
list of the argument strings on stdin, prints one JSON line per string, ``{"ok": true, "role": ...}``
or ``{"ok": false, "error": ...}``, after a first line with the vLLM version. vLLM's argument parser
turns a dataclass-typed flag into ``TypeAdapter(cls).validate_json(text)`` after expanding
human-readable numbers (vllm/engine/arg_utils.py, ``parse_dataclass``, 0.32 and 0.33); building the
whole parser also builds a device config, which has no platform on a CPU-only 0.33, so the same two
steps are called directly. A ``MultiConnector``'s children are then resolved as the engine resolves
them (``_children``).
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    import vllm
    from pydantic import TypeAdapter, ValidationError
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import _expand_json_human_readable_numbers

    print(json.dumps({"vllm": vllm.__version__}), flush=True)
    adapter = TypeAdapter(KVTransferConfig)
    for text in json.load(sys.stdin):
        try:
            cfg = adapter.validate_json(_expand_json_human_readable_numbers(text))
        except ValidationError as exc:
            print(json.dumps({"ok": False, "error": str(exc)}))
        else:
            try:
                children = _children(cfg)
            except Exception as exc:  # what vLLM raises when the engine builds the MultiConnector
                print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
                continue
            print(json.dumps({"ok": True, "role": cfg.kv_role, "extra": cfg.kv_connector_extra_config,
                              "module": cfg.kv_connector_module_path, "children": children}))


def _children(cfg) -> list[str]:
    """A MultiConnector's children as vLLM resolves them when the engine starts: each child's own
    ``KVTransferConfig`` (``MultiConnector._get_connector_classes_and_configs``), its class from the
    connector factory, and for the offloading connector its spec class and the metric definitions it
    builds from the extra config (``TieringOffloadingSpec`` resolves each secondary tier's class
    there). The class names, in order; [] for a single connector."""
    if cfg.kv_connector != "MultiConnector":
        return []
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    names = []
    for ktc in cfg.kv_connector_extra_config["connectors"]:
        child = KVTransferConfig(**ktc, engine_id=ktc.get("engine_id", cfg.engine_id))
        cls = KVConnectorFactory.get_connector_class(child)
        names.append(f"{cls.__module__}.{cls.__name__}")
        if cls.__name__ == "OffloadingConnector":
            spec = OffloadingSpecFactory.get_spec_cls(child.kv_connector_extra_config)
            spec.build_metric_definitions(dict(child.kv_connector_extra_config))
            names.append(f"{spec.__module__}.{spec.__name__}")
    return names


if __name__ == "__main__":
    main()
