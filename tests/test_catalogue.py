"""Every surface carries the catalogue's settings under their one name, default and help
(impl/policy/catalogue.py): the simulator's config and flags, the connector's keys, the router's config and
flags, the tuner's recommendation and the deploy recipe. A surface that lacks a setting, renames one, or
carries one the catalogue does not know fails here; an old name is refused naming the new one."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from impl.cli import build_parser
from impl.connector.config import KNOWN_BIDIKV_KEYS, ConfigError, ConnectorSettings
from impl.policy import catalogue
from impl.policy.catalogue import CONNECTOR, RENAMED, ROUTER, SETTINGS, SIM
from impl.router.config import FLAG_HELP, RouterConfig, build_config
from sim.engine.config import PolicyConfig, load_config

CATALOGUE_NAMES = {s.name for s in SETTINGS}
# PolicyConfig fields that are not (yet) one catalogue setting, and why
SIM_OWN = {"max_conversations": "the router's max_conversations bounds a deployment's memory (100,000); the "
                                "simulator's is effectively unbounded"}


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings if a.help != argparse.SUPPRESS}


def _wrong(setting: catalogue.Setting) -> object:
    return {bool: "maybe", int: "many", float: "long", str: 5}[setting.kind]


# -- the simulator ------------------------------------------------------------------------------------

def test_the_simulators_policy_fields_are_its_catalogue_settings():
    fields = {f.name: f for f in dataclasses.fields(PolicyConfig)}
    assert set(fields) - set(SIM_OWN) == {s.name for s in catalogue.on(SIM)}
    defaults = PolicyConfig()
    for s in catalogue.on(SIM):
        assert getattr(defaults, s.name) == s.default, s.name
        assert fields[s.name].metadata["help"].startswith(s.help), s.name
        if s.family is not None:
            assert fields[s.name].metadata["choices"] == catalogue.REGISTRIES[s.family].names(SIM)


@pytest.mark.parametrize("command", ["simulate", "tune"])
def test_the_simulators_flags_are_the_catalogues_names(command):
    flags = _flags(_subparser(command))
    assert {s.flag() for s in catalogue.on(SIM)} <= flags
    assert not {s.flag() for s in SETTINGS if SIM not in s.surfaces} & flags


@pytest.mark.parametrize("old", sorted(n for n, new in RENAMED.items() if SIM in catalogue.setting(new).surfaces))
def test_the_simulator_refuses_an_old_name_naming_the_new_one(old, capsys, tmp_path):
    new = RENAMED[old]
    with pytest.raises(ValueError, match=f"{old} is now {new}"):
        load_config(None, {"policy": {old: 1.0}})
    path = tmp_path / "old.toml"
    path.write_text(f"[policy]\n{old} = 1.0\n")
    with pytest.raises(ValueError, match=f"{path}.policy: {old} is now {new}"):
        load_config(str(path))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["simulate", "--" + old.replace("_", "-"), "1"])
    assert f"--{old.replace('_', '-')} is now --{new.replace('_', '-')}" in capsys.readouterr().err


def test_the_simulator_refuses_a_removed_setting_saying_why(capsys):
    with pytest.raises(ValueError, match="apply_threshold_p_to_d was removed: the simulator always pulls"):
        load_config(None, {"policy": {"apply_threshold_p_to_d": True}})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["simulate", "--apply-threshold-p-to-d"])
    assert "--apply-threshold-p-to-d was removed" in capsys.readouterr().err


# -- the connector --------------------------------------------------------------------------------------

def test_the_connectors_bidikv_keys_are_its_catalogue_settings():
    keys = {s.key() for s in catalogue.on(CONNECTOR)}
    assert KNOWN_BIDIKV_KEYS == {k for k in keys if k.startswith(catalogue.CONNECTOR_PREFIX)}
    assert keys - KNOWN_BIDIKV_KEYS == {"kv_recompute_threshold", "decoder_kv_blocks_ttl"}  # vLLM's own keys
    settings = ConnectorSettings.from_extra_config({})
    assert dict(settings.values) == {s.name: s.default for s in catalogue.on(CONNECTOR)}
    assert settings == ConnectorSettings()  # the dataclass's defaults are the catalogue's


@pytest.mark.parametrize("setting", catalogue.on(CONNECTOR), ids=lambda s: s.key())
def test_the_connector_reads_and_checks_every_catalogue_key(setting):
    with pytest.raises(ConfigError) as info:
        ConnectorSettings.from_extra_config({setting.key(): _wrong(setting)})
    assert info.value.key == setting.key()


@pytest.mark.parametrize("old", sorted(n for n, new in RENAMED.items() if CONNECTOR in catalogue.setting(new).surfaces))
def test_the_connector_refuses_an_old_key_naming_the_new_one(old):
    with pytest.raises(ConfigError, match=f"bidikv_{old} is now bidikv_{RENAMED[old]}"):
        ConnectorSettings.from_extra_config({f"bidikv_{old}": 1.0})


# -- the router ---------------------------------------------------------------------------------------

def test_the_routers_settings_are_its_catalogue_settings():
    fields = {f.name for f in dataclasses.fields(RouterConfig)}
    assert fields & CATALOGUE_NAMES == {s.name for s in catalogue.on(ROUTER)}
    defaults = RouterConfig()
    for s in catalogue.on(ROUTER):
        assert getattr(defaults, s.name) == s.default, s.name
        assert FLAG_HELP[s.name].startswith(s.help), s.name
    flags = _flags(_subparser("router"))
    assert {s.flag() for s in catalogue.on(ROUTER)} <= flags
    assert not {s.flag() for s in SETTINGS if ROUTER not in s.surfaces} & flags


@pytest.mark.parametrize("old", sorted(n for n, new in RENAMED.items() if ROUTER in catalogue.setting(new).surfaces))
def test_the_router_refuses_an_old_name_naming_the_new_one(old, capsys):
    new = RENAMED[old]
    with pytest.raises(ValueError, match=f"{old} is now {new}"):
        build_config({old: 10.0})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--" + old.replace("_", "-"), "10"])
    assert f"--{old.replace('_', '-')} is now --{new.replace('_', '-')}" in capsys.readouterr().err


# -- the tuner's recommendation ----------------------------------------------------------------------------

def test_the_recommendation_uses_only_catalogue_keys_and_flags():
    from sim.tune.frontier import Point
    from sim.tune.grid import REFERENCES, build_grid
    from sim.tune.report import vllm_settings

    router_flags = _flags(_subparser("router"))
    for candidate in [*build_grid(learnt_retention_budget_pct=50.0), *(c for c in REFERENCES if c.kind == "default")]:
        s = vllm_settings(Point(candidate, {}), "qwen3-32b@p5en-tp8", (1, 1), 1_000_000)
        for config in (s["prefill_kv_transfer_config"], s["decode_kv_transfer_config"]):
            extra = config["kv_connector_extra_config"]
            assert set(extra) - {"bidirectional_kv_xfer"} <= {x.key() for x in catalogue.on(CONNECTOR)}, candidate.label
        assert {a for a in s["router_argv"] if a.startswith("--")} <= router_flags, candidate.label


# -- the deploy recipe -------------------------------------------------------------------------------------

def test_the_deploy_recipes_keys_and_flags_are_the_catalogues():
    import pathlib
    import tomllib

    from impl.deploy.config import DEFAULT_CONNECTOR, ROUTER_FLAGS_OWNED

    keys = {s.key(): s for s in catalogue.on(CONNECTOR)}
    for key, value in DEFAULT_CONNECTOR.items():
        assert key in keys, key
        keys[key].check(value, CONNECTOR)
    recipe = tomllib.loads((pathlib.Path(__file__).parents[1] / "impl" / "deploy" / "deploy.toml").read_text())
    vllm_keys = {"num_threads", "kv_lease_duration", "backends"}
    assert set(recipe["connector"]) <= set(keys) | vllm_keys
    router_flags = _flags(_subparser("router"))
    assert set(ROUTER_FLAGS_OWNED) - {"--config"} <= router_flags


# -- a setting on two surfaces is one catalogue entry -------------------------------------------------

# names two surfaces use for different things, and why they are not one setting
NOT_ONE_SETTING = {
    "seed": "the simulator's seed drives every random stream of a run; the router's only breaks placement ties",
    **SIM_OWN,
}


def test_a_name_on_two_surfaces_is_a_catalogue_setting():
    from sim.engine.config import SimConfig

    def fields(cls: type) -> set[str]:
        out = set()
        for f in dataclasses.fields(cls):
            default = getattr(cls(), f.name)
            out |= fields(type(default)) if dataclasses.is_dataclass(default) else {f.name}
        return out

    surfaces = {SIM: fields(SimConfig), ROUTER: {f.name for f in dataclasses.fields(RouterConfig)},
                CONNECTOR: {k.removeprefix(catalogue.CONNECTOR_PREFIX) for k in KNOWN_BIDIKV_KEYS}}
    shared = {name for a in surfaces for b in surfaces if a < b for name in surfaces[a] & surfaces[b]}
    assert shared - set(NOT_ONE_SETTING) <= CATALOGUE_NAMES
