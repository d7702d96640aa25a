"""A bad config is an error naming the field, a nonzero exit, and nothing launched."""

from __future__ import annotations

import pytest

from impl.deploy.config import DeployConfigError, parse_config
from tests.deploy.conftest import run_script, sample


def _set(path: str, value):
    def mutate(config):
        *parents, key = path.split(".")
        table = config
        for p in parents:
            table = table.setdefault(p, {})
        table[key] = value
    return mutate


def _drop(path: str):
    def mutate(config):
        *parents, key = path.split(".")
        table = config
        for p in parents:
            table = table[p]
        del table[key]
    return mutate


def _same_host(config):
    config["decode"]["host"] = config["prefill"]["host"]
    config["decode"]["side_channel_port"] = config["prefill"]["side_channel_port"]


BAD = [
    (_set("deploy.instance_type", "p4d.24xlarge"), "deploy.instance_type", "unknown instance type"),
    (_set("model.tensor_parallel_size", 12), "model.tensor_parallel_size", "exceeds the 8 H200 of one p5en.48xlarge"
     " and is not a multiple of 8"),
    (lambda c: (c["deploy"].update(instance_type="p5.48xlarge"), c["model"].update(tensor_parallel_size=9)),
     "model.tensor_parallel_size", "exceeds the 8 H100 SXM of one p5.48xlarge"),
    (_drop("prefill.host"), "prefill.host", "required"),
    (_drop("deploy"), "deploy", "required"),
    (_set("decode.http_port", 70000), "decode.http_port", "65535"),
    (_set("decode.http_port", "8200"), "decode.http_port", "integer"),
    (_same_host, "decode.side_channel_port", "already prefill.side_channel_port"),
    (_set("router.port", 8100), "router.port", "already prefill.http_port"),
    (_set("prefill.host", "127.0.0.1"), "prefill.host", "loopback"),
    (_set("decode.host", "0.0.0.0"), "decode.host", "wildcard"),
    (_set("prefill.side_chanel_port", 5600), "prefill.side_chanel_port", "unknown setting"),
    (_set("routr", {"port": 1}), "routr", "unknown section"),
    (lambda c: c["connector"].update(bidikv_retention="lease", bidikv_heartbeat_port=8200),
     "connector.bidikv_heartbeat_port", "already decode.http_port"),
    (_set("connector.bidirectional_kv_xfer", True), "connector.bidirectional_kv_xfer", "--mode"),
    (_set("connector.backends", ["UCX"]), "connector.backends", "[transfer]"),
    (_set("connector.bidikv_retention", "forever"), "connector.bidikv_retention", "must be one of"),
    (_set("connector.bidikv_lease_s", 30), "connector.bidikv_lease_s", "only applies with bidikv_retention 'lease'"),
    (_set("connector.bidikv_retnetion", "lease"), "connector.bidikv_retnetion", "unknown key"),
    (_set("connector.kv_recompute_threshold", -1), "connector.kv_recompute_threshold", ">= 0"),
    (_set("transfer.env", {"VLLM_NIXL_SIDE_CHANNEL_PORT": "1"}), "transfer.env.VLLM_NIXL_SIDE_CHANNEL_PORT", "per server"),
    (_set("transfer.env", {"BAD NAME": "1"}), "transfer.env.BAD NAME", "not a valid"),
    (_set("transfer.backends", []), "transfer.backends", "at least one"),
    (_set("transfer.kv_buffer_device", "gpu"), "transfer.kv_buffer_device", "cuda"),
    (_set("prefill.extra_args", ["--port", "1"]), "prefill.extra_args", "--port"),
    (_set("prefill.extra_args", ["--kv-transfer-config={}"]), "prefill.extra_args", "--kv-transfer-config"),
    (_set("router.extra_args", ["--no-notify"]), "router.extra_args", "--no-notify"),
    (_set("prefill.gpus", "0,1"), "prefill.gpus", "fewer than model.tensor_parallel_size"),
    (_set("decode.extra_args", ["--block-size", "32"]), "decode.extra_args",
     "--block-size 32 differs from prefill.extra_args' (vLLM default): P and D must use one block size"),
    (lambda c: (c["prefill"].update(extra_args=["--block-size=16"]), c["decode"].update(extra_args=["--block-size", "32"])),
     "decode.extra_args", "--block-size 32 differs from prefill.extra_args' 16"),
    (_set("decode.gpus", "0;1"), "decode.gpus", "comma-separated"),
    (_set("decode.ssh", "-oProxyCommand=x"), "decode.ssh", "ssh destination"),
    (_set("model.tensor_parallel_size", 0), "model.tensor_parallel_size", ">= 1"),
    (_set("bench.workload", "mooncake"), "bench.trace", "required"),
    (_set("bench.trace", "t.jsonl"), "bench.trace", "only used"),
    (_set("bench.concurrency", 0), "bench.concurrency", ">= 1"),
    (_set("deploy.workdir", "a\nb"), "deploy.workdir", "single line"),
]


@pytest.mark.parametrize("mutate,field,words", BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_bad_config_names_the_field(mutate, field, words):
    config = sample()
    mutate(config)
    with pytest.raises(DeployConfigError) as caught:
        parse_config(config, "my.toml")
    message = str(caught.value)
    assert message.startswith(f"my.toml: {field}: "), message
    assert words in message
    assert caught.value.field == field


@pytest.mark.parametrize("script,mode", [("start_decode.sh", "on"), ("start_prefill.sh", "off"),
                                         ("start_router.sh", "on"), ("run_bench.sh", "on"), ("report.sh", None)])
def test_scripts_refuse_a_bad_config_and_launch_nothing(write_config, fake_python, script, mode):
    fake, record = fake_python
    config = sample()
    config["deploy"]["python"] = str(fake)  # would record an exec if anything were launched
    config["connector"]["bidikv_retention"] = "forever"
    path = write_config(config)
    mode_args = ["--mode", mode] if mode else []
    for dry in ([], ["--dry-run"]):
        done = run_script(script, "--config", str(path), *mode_args, *dry)
        assert done.returncode != 0
        assert "connector.bidikv_retention" in done.stderr, done.stderr
        assert done.stdout == ""
        assert "Traceback" not in done.stderr
    assert not record.exists()


def test_unreadable_and_invalid_files(tmp_path):
    from impl.deploy.config import load_config

    with pytest.raises(DeployConfigError, match="missing.toml: file: "):
        load_config(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[prefill\nhost = 1\n")
    with pytest.raises(DeployConfigError, match="broken.toml: file: not valid TOML"):
        load_config(broken)


def test_unknown_script_argument_is_refused(write_config):
    done = run_script("start_decode.sh", "--config", str(write_config(sample())), "--mdoe", "on")
    assert done.returncode == 2 and "unknown argument: --mdoe" in done.stderr


@pytest.mark.parametrize("script", ["start_decode.sh", "start_prefill.sh"])
def test_a_tp_group_spanning_instances_is_refused_by_the_ssh_recipe(write_config, fake_python, script):
    """TP 16 on 8-GPU instances is valid (Kubernetes renders it as a LeaderWorkerSet), but the ssh recipe
    starts each server on one instance: it names the key and starts nothing."""
    fake, record = fake_python
    config = sample()
    config["deploy"]["python"] = str(fake)
    config["model"]["tensor_parallel_size"] = 16
    assert parse_config(config, "my.toml").nodes_per_server == 2
    done = run_script(script, "--config", str(write_config(config)), "--mode", "on")
    assert done.returncode == 2, done.stderr
    assert "model.tensor_parallel_size: 16 spans 2 p5en.48xlarge" in done.stderr
    assert "bidikv deploy manifests" in done.stderr and "Traceback" not in done.stderr
    assert not record.exists()
