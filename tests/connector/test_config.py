"""The extra-config keys: defaults, policy selection, and rejection of bad values naming the key (pure)."""

from __future__ import annotations

import pytest

from impl.connector.config import DEFAULT_NUM_THREADS, KNOWN_BIDIKV_KEYS, ConfigError, ConnectorSettings
from impl.policy import BreakEvenThreshold, FixedThreshold, FixedTTL, GapQuantileTTL, HeartbeatLease


def test_defaults_are_vllms_rules_plus_our_cpu_friendly_threading():
    s = ConnectorSettings.from_extra_config({})
    assert s.bidirectional is False and s.kv_recompute_threshold == 64 and s.decoder_kv_blocks_ttl == 480
    assert isinstance(s.recompute_policy, FixedThreshold) and s.recompute_policy.tokens == 64
    assert isinstance(s.make_retention(), FixedTTL) and s.make_retention().seconds == 480
    assert s.apply_threshold_p_to_d is True
    assert s.agent_config_overrides() == {"enable_prog_thread": True, "num_threads": DEFAULT_NUM_THREADS}
    assert s.nixl_progress_delay_us == 1000
    assert s.idle_step_sleep_s == 5.0 and s.notify is True


def test_vllm_keys_keep_their_meaning():
    s = ConnectorSettings.from_extra_config({"bidirectional_kv_xfer": True, "kv_recompute_threshold": 0,
                                            "decoder_kv_blocks_ttl": 30, "num_threads": 4})
    assert s.bidirectional and s.recompute_policy == FixedThreshold(0) and s.make_retention() == FixedTTL(30)
    assert s.agent_config_overrides() == {"enable_prog_thread": True}  # an explicit num_threads is vLLM's to pass


def test_policy_selection():
    lease = ConnectorSettings.from_extra_config({"bidikv_retention": "lease", "bidikv_lease_s": 60,
                                                "bidikv_heartbeat_interval_s": 15})
    assert lease.make_retention() == HeartbeatLease(lease_s=60, heartbeat_interval_s=15, max_hold_s=3600)
    gap = ConnectorSettings.from_extra_config({"decoder_kv_blocks_ttl": 300, "bidikv_retention": "gap_quantile",
                                              "bidikv_gap_quantile": 0.5})
    policy = gap.make_retention()
    assert isinstance(policy, GapQuantileTTL) and policy.quantile == 0.5 and policy.initial_s == 300
    assert gap.make_retention() is not policy  # stateful: one per scheduler
    be = ConnectorSettings.from_extra_config({"bidikv_recompute_policy": "break_even",
                                             "bidikv_cost_profile": "glm-5-fp8@p5en-tp8"})
    assert isinstance(be.recompute_policy, BreakEvenThreshold)


@pytest.mark.parametrize("extra, key", [
    ({"bidirectional_kv_xfer": "yes"}, "bidirectional_kv_xfer"),
    ({"kv_recompute_threshold": -1}, "kv_recompute_threshold"),
    ({"kv_recompute_threshold": 1.5}, "kv_recompute_threshold"),
    ({"kv_recompute_threshold": True}, "kv_recompute_threshold"),
    ({"decoder_kv_blocks_ttl": -5}, "decoder_kv_blocks_ttl"),
    ({"decoder_kv_blocks_ttl": float("inf")}, "decoder_kv_blocks_ttl"),
    ({"decoder_kv_blocks_ttl": "480"}, "decoder_kv_blocks_ttl"),
    ({"num_threads": -1}, "num_threads"),
    ({"kv_lease_duration": 0}, "kv_lease_duration"),
    ({"backends": "UCX"}, "backends"),
    ({"bidikv_recompute_policy": "always"}, "bidikv_recompute_policy"),
    ({"bidikv_recompute_policy": "break_even"}, "bidikv_cost_profile"),
    ({"bidikv_recompute_policy": "break_even", "bidikv_cost_profile": "no-such-profile"}, "bidikv_cost_profile"),
    ({"bidikv_cost_profile": "qwen3-32b@p5en-tp8"}, "bidikv_cost_profile"),
    ({"bidikv_apply_threshold_p_to_d": 1}, "bidikv_apply_threshold_p_to_d"),
    ({"bidikv_retention": "forever"}, "bidikv_retention"),
    ({"bidikv_lease_s": 60}, "bidikv_lease_s"),  # lease key without the lease policy
    ({"bidikv_retention": "lease", "bidikv_gap_quantile": 0.5}, "bidikv_gap_quantile"),
    ({"bidikv_retention": "lease", "bidikv_lease_s": 0}, "bidikv_lease_s"),
    ({"bidikv_retention": "lease", "bidikv_heartbeat_interval_s": 45}, "bidikv_heartbeat_interval_s"),
    ({"bidikv_retention": "gap_quantile", "bidikv_gap_quantile": 0}, "bidikv_gap_quantile"),
    ({"bidikv_retention": "gap_quantile", "bidikv_gap_quantile": 1.5}, "bidikv_gap_quantile"),
    ({"bidikv_retention": "gap_quantile", "bidikv_gap_floor_s": 1000}, "bidikv_gap_floor_s"),
    ({"bidikv_retention": "gap_quantile", "bidikv_gap_window": 5}, "bidikv_gap_window"),
    ({"bidikv_retention": "gap_quantile", "bidikv_gap_min_samples": 0}, "bidikv_gap_min_samples"),
    ({"bidikv_nixl_progress_thread": "on"}, "bidikv_nixl_progress_thread"),
    ({"bidikv_idle_step_sleep_s": 31}, "bidikv_idle_step_sleep_s"),
    ({"bidikv_idle_step_sleep_s": -0.1}, "bidikv_idle_step_sleep_s"),
    ({"bidikv_notify_timeout_s": 0}, "bidikv_notify_timeout_s"),
    ({"bidikv_retension": "ttl"}, "bidikv_retension"),  # a typo
])
def test_bad_values_are_rejected_naming_the_key(extra, key):
    with pytest.raises(ConfigError) as info:
        ConnectorSettings.from_extra_config(extra)
    assert info.value.key == key
    assert str(info.value).startswith(f"kv_connector_extra_config[{key!r}]: ")


def test_unknown_key_message_lists_the_known_ones():
    with pytest.raises(ConfigError, match="known bidikv_\\* keys: .*bidikv_retention"):
        ConnectorSettings.from_extra_config({"bidikv_nope": 1})
    assert "bidikv_retention" in KNOWN_BIDIKV_KEYS


def test_unrelated_vllm_keys_pass_through():
    ConnectorSettings.from_extra_config({"enforce_handshake_compat": False, "some_future_vllm_key": 3})
