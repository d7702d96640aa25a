"""The two-tier ``--kv-transfer-config``: bidikv's connector (D's HBM) and vLLM's host tier, composed.

One function renders it, :func:`two_tier_kv_transfer_config`; ``bidikv deploy``, ``bidikv tune`` and
the tests call it, and :func:`check_kv_transfer_config` is the validator every surface runs on what it
renders or is given. The result is vLLM's ``MultiConnector`` (``distributed/kv_transfer/kv_connector/
v1/multi_connector.py``) of two children, in this order:

1. bidikv's ``NixlConnector`` (``kv_connector_module_path: "impl.connector"``) exactly as it is
   configured alone: P reads a retained turn from D's HBM, D reads P's prompt blocks.
2. vLLM's ``OffloadingConnector`` with ``spec_name: "TieringOffloadingSpec"`` (``v1/kv_offload/
   tiering/spec.py``): a CPU primary tier of ``cpu_bytes_to_use`` bytes (required, ``cpu/spec.py``),
   evicted ``lru`` or ``arc`` (``cpu/policies/``), and the P2P secondary tier
   (``tiering/p2p/manager.py``) whose ZMQ control socket binds ``host``/``port`` (defaults:
   ``VLLM_P2P_SIDE_CHANNEL_HOST``/``VLLM_P2P_SIDE_CHANNEL_PORT``, ``localhost``/5710, vllm/envs.py),
   plus the engine's data-parallel index. ``offload_prompt_only`` is false on D so a turn's generated
   blocks reach the host tier too (vLLM's default, true, stores the prompt only: ``kv_offload/base.py``).

Why this order: ``MultiConnector.get_num_new_matched_tokens`` lets the *first* child that reports
tokens load the request, so a live HBM entry (bidikv) wins over the host tier, and the host tier is
asked only when the router stamped ``remote_kv_source`` (impl/router/host_tier.py) because bidikv had
nothing to offer. ``request_finished`` is aggregated: bidikv's delayed free (D's retained blocks)
and the offloading connector's answer (it frees at once and fences the blocks of unfinished stores,
``offloading/scheduler.py``) combine, and keys of ``kv_transfer_params`` may not clash (they do not:
the offloading connector returns none).

The same composition is llm-d's P/D recipe (https://github.com/llm-d/llm-d/tree/main/guides/
p2p-kv-cache-sharing, "P/D variant"), which runs vLLM's NixlConnector in ``kv_both``; bidikv's keeps
``kv_producer`` on P and ``kv_consumer`` on D, and the top level carries that role and P's
``kv_load_failure_policy`` (the scheduler reads both from the top-level ``KVTransferConfig``).

Peers must agree on block hashes (same ``--block-size``, hash algorithm and ``PYTHONHASHSEED``; the P2P
handshake rejects a seed mismatch) and on the tensor-parallel layout; a pull addressed to a wrong port
stalls the request (llm-d's guide). Pure: stdlib and :mod:`impl.connector.config` only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from impl.connector.config import ConfigError, ConnectorSettings

OFFLOADING_CONNECTOR = "OffloadingConnector"
TIERING_SPEC = "TieringOffloadingSpec"
P2P_TIER = "p2p"
DEFAULT_P2P_PORT = 5710  # vLLM's VLLM_P2P_SIDE_CHANNEL_PORT default (vllm/envs.py, 0.32-0.34)
EVICTION_POLICIES = ("lru", "arc")  # vLLM's registered CPU cache policies (kv_offload/cpu/policies/factory.py)
_ROLES = ("kv_producer", "kv_consumer")
# the offloading child's keys this module renders and checks; others pass to vLLM untouched


class TwoTierConfigError(ValueError):
    """A bad ``--kv-transfer-config`` field; the message starts with its dotted path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"--kv-transfer-config {field}: {message}")
        self.field = field


@dataclass(frozen=True)
class HostTierConfig:
    """One instance's host tier: vLLM's own keys, one name each."""

    cpu_bytes_to_use: int
    p2p_port: int = DEFAULT_P2P_PORT
    # None: the instance's VLLM_P2P_SIDE_CHANNEL_HOST (set per instance, like VLLM_NIXL_SIDE_CHANNEL_HOST)
    p2p_host: str | None = None
    eviction_policy: str = "lru"
    # None: by role -- false on D (its generated blocks are what P pulls), vLLM's true on P
    offload_prompt_only: bool | None = None

    def __post_init__(self) -> None:
        _check_bytes("cpu_bytes_to_use", self.cpu_bytes_to_use)
        _check_port("p2p_port", self.p2p_port)
        if self.p2p_host is not None:
            _check_host("p2p_host", self.p2p_host)
        if self.eviction_policy not in EVICTION_POLICIES:
            raise TwoTierConfigError("eviction_policy", f"must be one of {', '.join(map(repr, EVICTION_POLICIES))}, "
                                                 f"got {self.eviction_policy!r}")
        if self.offload_prompt_only is not None and not isinstance(self.offload_prompt_only, bool):
            raise TwoTierConfigError("offload_prompt_only", f"must be a boolean, got {self.offload_prompt_only!r}")


def two_tier_kv_transfer_config(nixl: Mapping[str, Any], host: HostTierConfig) -> dict[str, Any]:
    """``nixl`` (bidikv's single-connector ``--kv-transfer-config`` of P or D) composed with vLLM's host
    tier ``host``, as one ``MultiConnector`` config; checked by :func:`check_kv_transfer_config`."""
    role = nixl.get("kv_role")
    if role not in _ROLES:
        raise TwoTierConfigError("kv_role", f"must be one of {', '.join(map(repr, _ROLES))} (P or D), got {role!r}")
    prompt_only = host.offload_prompt_only if host.offload_prompt_only is not None else role == "kv_producer"
    tier: dict[str, Any] = {"type": P2P_TIER, "port": host.p2p_port}
    if host.p2p_host is not None:
        tier["host"] = host.p2p_host
    offloading = {
        "kv_connector": OFFLOADING_CONNECTOR,
        "kv_role": "kv_both",  # stores its own blocks and serves or pulls peers' (llm-d's P/D recipe)
        "kv_connector_extra_config": {
            "spec_name": TIERING_SPEC,
            "cpu_bytes_to_use": int(host.cpu_bytes_to_use),
            "eviction_policy": host.eviction_policy,
            "offload_prompt_only": prompt_only,
            "secondary_tiers": [tier],
        },
    }
    top: dict[str, Any] = {"kv_connector": "MultiConnector", "kv_role": role}
    for key in ("kv_buffer_device", "kv_load_failure_policy"):
        if key in nixl:
            top[key] = nixl[key]
    top["kv_connector_extra_config"] = {"connectors": [dict(nixl), offloading]}
    check_kv_transfer_config(top)
    return top


@dataclass(frozen=True)
class TwoTierParts:
    """A checked ``--kv-transfer-config``: bidikv's child, and the host tier's (None: bidikv alone)."""

    nixl: dict[str, Any]
    offloading: dict[str, Any] | None
    settings: ConnectorSettings

    @property
    def host_tier(self) -> HostTierConfig | None:
        if self.offloading is None:
            return None
        extra = self.offloading["kv_connector_extra_config"]
        tier = extra["secondary_tiers"][0]
        return HostTierConfig(cpu_bytes_to_use=extra["cpu_bytes_to_use"], p2p_port=tier.get("port", DEFAULT_P2P_PORT),
                              p2p_host=tier.get("host"), eviction_policy=extra.get("eviction_policy", "lru"),
                              offload_prompt_only=extra.get("offload_prompt_only", True))


def check_kv_transfer_config(config: Mapping[str, Any]) -> TwoTierParts:
    """Validate a whole ``--kv-transfer-config`` of P or D: bidikv's connector alone, or the two-tier
    ``MultiConnector`` above. Raises :class:`TwoTierConfigError` naming the field (a dotted path) and why."""
    if not isinstance(config, Mapping):
        raise TwoTierConfigError("kv_transfer_config", f"must be a JSON object, got {type(config).__name__}")
    if config.get("kv_connector") != "MultiConnector":
        return TwoTierParts(_check_nixl(config, "kv_transfer_config"), None, _settings(config, "kv_transfer_config"))
    role = config.get("kv_role")
    if role not in _ROLES:
        raise TwoTierConfigError("kv_role", f"must be one of {', '.join(map(repr, _ROLES))} (bidikv's role on P or D), "
                                     f"got {role!r}")
    extra = config.get("kv_connector_extra_config")
    children = extra.get("connectors") if isinstance(extra, Mapping) else None
    where = "kv_connector_extra_config.connectors"
    if not isinstance(children, list) or len(children) != 2 or not all(isinstance(c, Mapping) for c in children):
        raise TwoTierConfigError(where, "must list two connectors: bidikv's NixlConnector, then vLLM's OffloadingConnector")
    nixl = _check_nixl(children[0], f"{where}[0]")
    if nixl.get("kv_role") != role:
        raise TwoTierConfigError(f"{where}[0].kv_role", f"must equal the top-level kv_role {role!r}, got {nixl.get('kv_role')!r}")
    if role == "kv_producer" and config.get("kv_load_failure_policy") != "recompute":
        # the engine reads it from the top-level config: a failed or declined read must recompute
        raise TwoTierConfigError("kv_load_failure_policy", "must be 'recompute' on P (top level of the MultiConnector), got "
                                                    f"{config.get('kv_load_failure_policy')!r}")
    offloading = _check_offloading(children[1], f"{where}[1]", role)
    return TwoTierParts(nixl, offloading, _settings(nixl, f"{where}[0]"))


def _check_nixl(child: Mapping[str, Any], where: str) -> dict[str, Any]:
    # bidikv's (module path impl.connector) or vLLM's own, whose keys bidikv's validator also checks
    if child.get("kv_connector") != "NixlConnector" or child.get("kv_connector_module_path") not in (None, "impl.connector"):
        raise TwoTierConfigError(f"{where}.kv_connector", "must be bidikv's NixlConnector (kv_connector 'NixlConnector', "
                                                          "kv_connector_module_path 'impl.connector') or vLLM's")
    if child.get("kv_role") not in _ROLES:
        raise TwoTierConfigError(f"{where}.kv_role", f"must be one of {', '.join(map(repr, _ROLES))}, got {child.get('kv_role')!r}")
    return dict(child)


def _settings(child: Mapping[str, Any], where: str) -> ConnectorSettings:
    extra = child.get("kv_connector_extra_config", {})
    if not isinstance(extra, Mapping):
        raise TwoTierConfigError(f"{where}.kv_connector_extra_config", "must be a JSON object")
    try:
        return ConnectorSettings.from_extra_config(extra)
    except ConfigError as e:  # bidikv's own validator, on its child
        raise TwoTierConfigError(f"{where}.kv_connector_extra_config.{e.key}", str(e).split(": ", 1)[1]) from None


def _check_offloading(child: Mapping[str, Any], where: str, role: str) -> dict[str, Any]:
    if child.get("kv_connector") != OFFLOADING_CONNECTOR or "kv_connector_module_path" in child:
        raise TwoTierConfigError(f"{where}.kv_connector", f"must be vLLM's own {OFFLOADING_CONNECTOR} (no module path)")
    if child.get("kv_role") != "kv_both":
        raise TwoTierConfigError(f"{where}.kv_role", f"must be 'kv_both' (it stores and serves), got {child.get('kv_role')!r}")
    extra = child.get("kv_connector_extra_config")
    if not isinstance(extra, Mapping):
        raise TwoTierConfigError(f"{where}.kv_connector_extra_config", "must be a JSON object")
    at = f"{where}.kv_connector_extra_config"
    if extra.get("spec_name") != TIERING_SPEC:
        raise TwoTierConfigError(f"{at}.spec_name", f"must be {TIERING_SPEC!r} (the P2P tier is one of its secondary tiers), "
                                             f"got {extra.get('spec_name')!r}")
    _check_bytes(f"{at}.cpu_bytes_to_use", extra.get("cpu_bytes_to_use"))
    if extra.get("eviction_policy", "lru") not in EVICTION_POLICIES:
        raise TwoTierConfigError(f"{at}.eviction_policy", f"must be one of {', '.join(map(repr, EVICTION_POLICIES))}, "
                                                   f"got {extra.get('eviction_policy')!r}")
    prompt_only = extra.get("offload_prompt_only", True)
    if not isinstance(prompt_only, bool):  # vLLM reads bool(value): the string "false" would mean true
        raise TwoTierConfigError(f"{at}.offload_prompt_only", f"must be a JSON boolean, got {prompt_only!r}")
    if role == "kv_consumer" and prompt_only:
        raise TwoTierConfigError(f"{at}.offload_prompt_only", "must be false on D: with true D's generated blocks never reach "
                                                       "its host tier, so P could pull only what it sent D itself")
    tiers = extra.get("secondary_tiers")
    if not isinstance(tiers, list) or len(tiers) != 1 or not isinstance(tiers[0], Mapping) \
            or tiers[0].get("type") != P2P_TIER:
        raise TwoTierConfigError(f"{at}.secondary_tiers", "must be one P2P tier, [{\"type\": \"p2p\", \"port\": ...}]")
    tier = tiers[0]
    _check_port(f"{at}.secondary_tiers[0].port", tier.get("port", DEFAULT_P2P_PORT))
    if "host" in tier:
        _check_host(f"{at}.secondary_tiers[0].host", tier["host"])
    if "backpressure" in tier:  # P2PSecondaryTierManager raises on it at startup
        raise TwoTierConfigError(f"{at}.secondary_tiers[0].backpressure", "is not supported by vLLM's P2P tier")
    return dict(child)


def _check_bytes(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 1 \
            or value != int(value):
        raise TwoTierConfigError(key, f"must be a whole number of bytes > 0, got {value!r}")


def _check_port(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise TwoTierConfigError(key, f"must be an integer port in 1..65535, got {value!r}")


def _check_host(key: str, value: Any) -> None:
    # an address peers dial: the P2P tier binds it and advertises it verbatim (tiering/p2p/manager.py)
    if not isinstance(value, str) or not value or len(value) > 253 or any(c in value for c in " /\t\n@?#:"):
        raise TwoTierConfigError(key, f"must be a host name or IP address (no port, no scheme), got {value!r}")


__all__ = ["DEFAULT_P2P_PORT", "EVICTION_POLICIES", "HostTierConfig", "TwoTierConfigError", "TwoTierParts", "check_kv_transfer_config",
           "two_tier_kv_transfer_config"]
