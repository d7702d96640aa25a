"""The two-tier --kv-transfer-config (impl/connector/two_tier.py): rendered once, checked by our validator,
and parsed by vLLM 0.32, 0.33 and 0.34 as the engine parses it, children resolved to their classes."""

from __future__ import annotations

import copy
import json

import pytest

from impl.connector.two_tier import (HostTierConfig, TwoTierConfigError, check_kv_transfer_config,
                                     two_tier_kv_transfer_config)
from tests.vllm_releases import OTHER_RELEASES, vllm_parse

GIB = 1 << 30

PREFILL = {"kv_connector": "NixlConnector", "kv_connector_module_path": "impl.connector", "kv_role": "kv_producer",
           "kv_buffer_device": "cuda", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"bidirectional_kv_xfer": True, "kv_recompute_threshold": 64}}
DECODE = {"kv_connector": "NixlConnector", "kv_connector_module_path": "impl.connector", "kv_role": "kv_consumer",
          "kv_buffer_device": "cuda",
          "kv_connector_extra_config": {"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": 480,
                                        "bidikv_retained_under_pressure": "give_back", "bidikv_heartbeat_port": 5700}}


def _both(host: HostTierConfig | None = None) -> tuple[dict, dict]:
    host = host or HostTierConfig(cpu_bytes_to_use=512 * GIB)
    return two_tier_kv_transfer_config(PREFILL, host), two_tier_kv_transfer_config(DECODE, host)


def test_the_render_is_a_multiconnector_of_ours_then_vllms_host_tier():
    p, d = _both(HostTierConfig(cpu_bytes_to_use=512 * GIB, p2p_port=7777, eviction_policy="arc"))
    for cfg, source, role in ((p, PREFILL, "kv_producer"), (d, DECODE, "kv_consumer")):
        assert cfg["kv_connector"] == "MultiConnector" and cfg["kv_role"] == role
        ours, offloading = cfg["kv_connector_extra_config"]["connectors"]
        assert ours == source  # bidikv's child is the single-connector config, untouched
        assert offloading["kv_connector"] == "OffloadingConnector" and offloading["kv_role"] == "kv_both"
        extra = offloading["kv_connector_extra_config"]
        assert extra["spec_name"] == "TieringOffloadingSpec" and extra["cpu_bytes_to_use"] == 512 * GIB
        assert extra["eviction_policy"] == "arc" and extra["secondary_tiers"] == [{"type": "p2p", "port": 7777}]
    # D offloads what it generates (P pulls it), P keeps vLLM's default
    assert d["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]["offload_prompt_only"] is False
    assert p["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]["offload_prompt_only"] is True
    assert p["kv_load_failure_policy"] == "recompute" and "kv_load_failure_policy" not in d
    assert check_kv_transfer_config(d).host_tier == HostTierConfig(512 * GIB, 7777, None, "arc", False)
    assert check_kv_transfer_config(PREFILL).host_tier is None  # the single-connector form still checks


def _offload_extra(cfg: dict) -> dict:
    return cfg["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]


@pytest.mark.parametrize("side, mutate, field", [
    ("d", lambda c: _offload_extra(c).update(offload_prompt_only="false"), "connectors[1].kv_connector_extra_config.offload_prompt_only"),
    ("d", lambda c: _offload_extra(c).update(offload_prompt_only=True), "connectors[1].kv_connector_extra_config.offload_prompt_only"),
    ("d", lambda c: _offload_extra(c).pop("cpu_bytes_to_use"), "cpu_bytes_to_use"),
    ("d", lambda c: _offload_extra(c).update(cpu_bytes_to_use=0.5), "cpu_bytes_to_use"),
    ("d", lambda c: _offload_extra(c).update(spec_name="CPUOffloadingSpec"), "spec_name"),
    ("d", lambda c: _offload_extra(c).update(eviction_policy="fifo"), "eviction_policy"),
    ("d", lambda c: _offload_extra(c)["secondary_tiers"].append({"type": "fs"}), "secondary_tiers"),
    ("d", lambda c: _offload_extra(c)["secondary_tiers"][0].update(port=70000), "secondary_tiers[0].port"),
    ("d", lambda c: _offload_extra(c)["secondary_tiers"][0].update(host="tcp://10.0.0.1"), "secondary_tiers[0].host"),
    ("d", lambda c: _offload_extra(c)["secondary_tiers"][0].update(backpressure={}), "backpressure"),
    ("d", lambda c: c["kv_connector_extra_config"]["connectors"].reverse(), "connectors[0].kv_connector"),
    ("d", lambda c: c.update(kv_role="kv_both"), "kv_role"),
    ("d", lambda c: c["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"].update(
        bidikv_retention="forever"), "connectors[0].kv_connector_extra_config.bidikv_retention"),
    ("p", lambda c: c.pop("kv_load_failure_policy"), "kv_load_failure_policy"),
    ("p", lambda c: c["kv_connector_extra_config"]["connectors"][0].update(kv_role="kv_consumer"), "connectors[0].kv_role"),
])
def test_the_validator_names_the_bad_field(side, mutate, field):
    p, d = _both()
    cfg = copy.deepcopy(p if side == "p" else d)
    mutate(cfg)
    with pytest.raises(TwoTierConfigError) as e:
        check_kv_transfer_config(cfg)
    assert field in e.value.field, (e.value.field, str(e.value))
    assert str(e.value).startswith("--kv-transfer-config ")


@pytest.mark.parametrize("kwargs, field", [({"cpu_bytes_to_use": 0}, "cpu_bytes_to_use"),
                                           ({"cpu_bytes_to_use": GIB, "p2p_port": 0}, "p2p_port"),
                                           ({"cpu_bytes_to_use": GIB, "p2p_host": "a b"}, "p2p_host"),
                                           ({"cpu_bytes_to_use": GIB, "eviction_policy": "mru"}, "eviction_policy")])
def test_a_bad_host_tier_setting_is_refused_before_rendering(kwargs, field):
    with pytest.raises(TwoTierConfigError, match=field):
        HostTierConfig(**kwargs)


@pytest.mark.parametrize("version", ("0.32.0",) + OTHER_RELEASES)
def test_vllm_parses_both_servers_configs_and_resolves_the_children(version):
    p, d = _both(HostTierConfig(cpu_bytes_to_use=512 * GIB, p2p_host="10.0.1.12"))
    bad = copy.deepcopy(d)  # the engine's own check must be able to fail: a tier type vLLM does not know
    _offload_extra(bad)["secondary_tiers"][0]["type"] = "peer2peer"
    results = vllm_parse([json.dumps(p), json.dumps(d), json.dumps(bad)], version)
    for cfg, result in zip((p, d), results):
        assert result["ok"], result
        assert result["role"] == cfg["kv_role"] and result["extra"] == cfg["kv_connector_extra_config"]
        assert result["children"] == ["impl.connector.connector.NixlConnector",
                                      "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector.OffloadingConnector",
                                      "vllm.v1.kv_offload.tiering.spec.TieringOffloadingSpec"]
    assert not results[2]["ok"] and "peer2peer" in results[2]["error"]
