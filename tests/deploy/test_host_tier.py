"""[host_tier] in the deploy recipe: P's and D's --kv-transfer-config become the two-tier MultiConnector
impl/connector/two_tier.py renders (checked by its validator, parsed by vLLM 0.32's serve parser and
EngineArgs), both servers get one PYTHONHASHSEED, and the router is told D's P2P port and tier size."""

from __future__ import annotations

import argparse
import json

import pytest

from impl.connector.two_tier import HostTierConfig, check_kv_transfer_config, two_tier_kv_transfer_config
from impl.deploy.config import DeployConfigError, parse_config
from tests.deploy.conftest import D_HOST, P_HOST, sample
from tests.deploy.test_dry_run import dry_run, split_env

TIER = {"decode_cpu_bytes_to_use": 512 << 30, "prefill_cpu_bytes_to_use": 64 << 30, "decode_p2p_port": 7777,
        "prefill_p2p_port": 7778, "min_cached_token_delta": 4096}


def _two_tier(**changes):
    config = sample()
    config["host_tier"] = {**TIER, **changes}
    return config


def _kv(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def test_the_dry_run_renders_both_servers_as_the_two_tier_function_does(write_config):
    path = write_config(_two_tier())
    single = write_config(sample(), "single.toml")
    for step, role, host, size, port in (("decode", "kv_consumer", D_HOST, TIER["decode_cpu_bytes_to_use"], 7777),
                                         ("prefill", "kv_producer", P_HOST, TIER["prefill_cpu_bytes_to_use"], 7778)):
        [argv] = dry_run(path, step, "on")
        env, cmd = split_env(argv)
        [alone] = dry_run(single, step, "on")
        # what the recipe renders is the one function's output around the recipe's single-connector config
        expected = two_tier_kv_transfer_config(_kv(split_env(alone)[1]), HostTierConfig(
            cpu_bytes_to_use=size, p2p_port=port, p2p_host=host))
        assert _kv(cmd) == expected and check_kv_transfer_config(expected).nixl["kv_role"] == role
        assert env["PYTHONHASHSEED"] == "0"  # P and D hash blocks alike


def test_the_router_is_told_ds_p2p_port_and_its_tier_in_tokens(write_config):
    from impl.router.cli import add_arguments, config_from_args

    [argv] = dry_run(write_config(_two_tier()), "router", "on")
    _, cmd = split_env(argv)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(cmd[cmd.index("impl.router") + 1:]))
    # 512 GiB over the base profile's KV bytes per token (Qwen3-32B: 256 KiB, all ranks)
    assert config.host_tier_capacity_tokens == (512 << 30) // (256 << 10)
    assert config.host_tier_p2p_port == 7777 and config.min_cached_token_delta == 4096
    [plain] = dry_run(write_config(sample(), "single.toml"), "router", "on")
    assert not any(a.startswith("--host-tier") for a in plain)


def test_vllms_serve_parser_and_engine_args_take_the_two_tier_commands(write_config):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    path = write_config(_two_tier())
    for step in ("decode", "prefill"):
        [argv] = dry_run(path, step, "on")
        _, cmd = split_env(argv)
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[cmd.index("vllm.entrypoints.openai.api_server") + 1:])
        validate_parsed_serve_args(args)
        kv = AsyncEngineArgs.from_cli_args(args).kv_transfer_config
        assert kv.kv_connector == "MultiConnector" and kv.has_connector("OffloadingConnector")
        assert kv.has_connector("NixlConnector")  # vLLM's name checks (CPU platform, layout) still see NIXL


@pytest.mark.parametrize("changes, field", [
    ({"decode_cpu_bytes_to_use": 0}, "host_tier.decode_cpu_bytes_to_use"),
    ({"eviction_policy": "fifo"}, "host_tier.eviction_policy"),
    ({"decode_p2p_port": 5601}, "host_tier.decode_p2p_port"),  # D's NIXL side channel already
    ({"prefill_p2p_port": 70000}, "host_tier.prefill_p2p_port"),
    ({"cpu_bytes": 1}, "host_tier.cpu_bytes"),
])
def test_a_bad_host_tier_names_the_key(changes, field):
    config = _two_tier(**changes)
    with pytest.raises(DeployConfigError) as e:
        parse_config(config, "deploy.toml")
    assert e.value.field == field, str(e.value)


def test_prefill_cpu_bytes_are_required():
    config = _two_tier()
    del config["host_tier"]["prefill_cpu_bytes_to_use"]
    with pytest.raises(DeployConfigError, match="host_tier.prefill_cpu_bytes_to_use"):
        parse_config(config, "deploy.toml")
