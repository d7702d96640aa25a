"""Parse ``--kv-transfer-config`` values exactly as ``vllm serve`` does, in whatever vLLM is importable.

Run as a script (one vLLM version per interpreter: 0.33 shadows 0.32 through PYTHONPATH): reads a JSON
list of the argument strings on stdin, prints one JSON line per string, ``{"ok": true, "role": ...}``
or ``{"ok": false, "error": ...}``, after a first line with the vLLM version. vLLM's argument parser
turns a dataclass-typed flag into ``TypeAdapter(cls).validate_json(text)`` after expanding
human-readable numbers (vllm/engine/arg_utils.py, ``parse_dataclass``, 0.32 and 0.33); building the
whole parser also builds a device config, which has no platform on a CPU-only 0.33, so the same two
steps are called directly.
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
            print(json.dumps({"ok": True, "role": cfg.kv_role, "extra": cfg.kv_connector_extra_config,
                              "module": cfg.kv_connector_module_path}))


if __name__ == "__main__":
    main()
