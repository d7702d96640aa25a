"""`bidikv deploy` knows the instance types people deploy on: every hardware preset, by instance type or short name."""

from __future__ import annotations

import pytest

from calibration.hardware import PRESETS, load_hardware
from impl.deploy.cli import main
from impl.deploy.config import DEFAULT_INSTANCE, load_config
from tests.deploy.conftest import sample


@pytest.mark.parametrize("key, instance", sorted(PRESETS.items()))
def test_check_prints_the_instance_facts(write_config, capsys, key, instance):
    config = sample()
    config["deploy"]["instance_type"] = instance
    path = write_config(config)
    assert main(["check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    hw = load_hardware(key)
    assert f"instance {instance}: {hw.gpus_per_node} x {hw.accelerator}" in out
    assert f"hardware_{key}.json" in out
    assert ("Neuron backend" in out) == (key == "trn2")


def test_short_preset_names_are_accepted_and_the_default_is_p5en(write_config):
    config = sample()
    assert load_config(write_config(config)).instance.name == DEFAULT_INSTANCE == "p5en.48xlarge"
    config["deploy"]["instance_type"] = "p6-b200"
    assert load_config(write_config(config)).instance.accelerator == "B200"


def test_trn2_takes_sixteen_chips(write_config):
    config = sample()
    config["deploy"]["instance_type"] = "trn2.48xlarge"
    config["model"]["tensor_parallel_size"] = 16
    assert load_config(write_config(config)).model.tensor_parallel_size == 16
