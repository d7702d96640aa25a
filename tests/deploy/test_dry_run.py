"""The launch scripts' --dry-run prints the exact commands, and without it they run exactly those.

Expected values come from the config the test writes (tests/deploy/conftest.py), never from the
renderer: the kv-transfer JSON is parsed and compared key by key, the environment is read off the
``env`` prefix of the printed line.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from tests.deploy.conftest import (D_HOST, D_HTTP, D_SIDE, P_HOST, P_HTTP, P_SIDE, ROOT, ROUTER_HOST, ROUTER_PORT,
                                   THRESHOLD, TTL_S, WORKDIR, run_script, sample)

SCRIPTS = {"decode": "start_decode.sh", "prefill": "start_prefill.sh", "router": "start_router.sh",
           "bench": "run_bench.sh", "report": "report.sh"}


def dry_run(config_path, step: str, mode: str | None = None) -> list[list[str]]:
    args = ["--config", str(config_path), "--dry-run"] + (["--mode", mode] if mode else [])
    done = run_script(SCRIPTS[step], *args)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    commands = [shlex.split(line) for line in lines if line and not line.startswith("#")]
    assert all(line.startswith("# ") for line in lines[::2]), "every command is preceded by its comment line"
    return commands


def split_env(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """``env A=1 B=2 prog args`` -> ({A: 1, B: 2}, [prog, args...])."""
    assert argv[0] == "env", argv
    env, i = {}, 1
    while "=" in argv[i] and not argv[i].startswith("-"):
        name, _, value = argv[i].partition("=")
        env[name] = value
        i += 1
    return env, argv[i:]


def flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} appears {argv.count(name)} times in {argv}"
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("mode", ["on", "off"])
def test_servers(write_config, mode):
    path = write_config(sample())
    [d_cmd] = dry_run(path, "decode", mode)
    [p_cmd] = dry_run(path, "prefill", mode)
    d_env, d_argv = split_env(d_cmd)
    p_env, p_argv = split_env(p_cmd)

    for env, host, side in ((d_env, D_HOST, D_SIDE), (p_env, P_HOST, P_SIDE)):
        assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == host
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(side)
        assert env["PYTHONPATH"] == WORKDIR
    assert p_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != d_env["VLLM_NIXL_SIDE_CHANNEL_PORT"]

    for argv, port in ((d_argv, D_HTTP), (p_argv, P_HTTP)):
        assert argv[:3] == ["/opt/bidikv/.venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
        assert flag(argv, "--model") == "Qwen/Qwen3-32B"
        assert flag(argv, "--served-model-name") == "qwen3-32b"
        assert flag(argv, "--port") == str(port)
        assert flag(argv, "--tensor-parallel-size") == "8"
        assert flag(argv, "--max-model-len") == "32768"
    assert "--no-enable-prefix-caching" in p_argv and "--no-enable-prefix-caching" not in d_argv
    assert "--enable-prefix-caching" in d_argv  # prefill on D reuses D's cache (vLLM's default, explicit)

    d_kv, p_kv = json.loads(flag(d_argv, "--kv-transfer-config")), json.loads(flag(p_argv, "--kv-transfer-config"))
    for kv, role in ((d_kv, "kv_consumer"), (p_kv, "kv_producer")):
        assert kv["kv_connector"] == "NixlConnector"
        assert kv["kv_connector_module_path"] == "impl.connector"
        assert kv["kv_role"] == role
        assert kv["kv_buffer_device"] == "cuda"
        extra = kv["kv_connector_extra_config"]
        assert extra["bidirectional_kv_xfer"] is (mode == "on")
        assert extra["backends"] == ["LIBFABRIC"]
        assert extra["kv_recompute_threshold"] == THRESHOLD
        assert extra["decoder_kv_blocks_ttl"] == TTL_S
        assert extra["num_threads"] == 0  # LIBFABRIC: keep vLLM's (no posting pool), not the connector's 1
    assert p_kv["kv_load_failure_policy"] == "recompute"
    assert "kv_load_failure_policy" not in d_kv  # vLLM's default on D, as in the e2e deployment

    # the rendered extra config is accepted by the connector that will read it inside vLLM
    from impl.connector.config import ConnectorSettings

    for kv in (d_kv, p_kv):
        ConnectorSettings.from_extra_config(kv["kv_connector_extra_config"])


@pytest.mark.parametrize("mode", ["on", "off"])
def test_router_and_bench(write_config, mode):
    path = write_config(sample())
    [router] = dry_run(path, "router", mode)
    env, argv = split_env(router)
    assert env == {"PYTHONPATH": WORKDIR}
    assert argv[1:3] == ["-m", "impl.router"]
    assert flag(argv, "--prefill") == f"http://{P_HOST}:{P_HTTP}"
    assert flag(argv, "--decode") == f"http://{D_HOST}:{D_HTTP}"
    assert flag(argv, "--port") == str(ROUTER_PORT)
    assert float(flag(argv, "--decoder-kv-blocks-ttl")) == TTL_S
    if mode == "on":
        assert "--notify" in argv
        assert flag(argv, "--notify-url") == f"http://{ROUTER_HOST}:{ROUTER_PORT}/internal/kv_params"
    else:
        assert "--no-notify" in argv and "--notify-url" not in argv

    mkdir, bench = dry_run(path, "bench", mode)
    assert mkdir == ["mkdir", "-p", f"{WORKDIR}/results"]
    _, argv = split_env(bench)
    assert argv[1:4] == ["-m", "impl.cli", "bench"]
    assert flag(argv, "--url") == f"http://{ROUTER_HOST}:{ROUTER_PORT}"
    assert flag(argv, "--mode") == mode
    assert flag(argv, "--out") == f"{WORKDIR}/results/{mode}.jsonl"
    assert flag(argv, "--conversations") == "24"
    assert flag(argv, "--concurrency") == "2"
    assert flag(argv, "--seed") == "7"
    assert flag(argv, "--model") == "qwen3-32b"


def test_report(write_config):
    compare, calibrate = dry_run(write_config(sample()), "report")
    _, compare = split_env(compare)
    _, calibrate = split_env(calibrate)
    assert compare[1:] == ["-m", "impl.deploy", "compare", f"{WORKDIR}/results/on.jsonl", f"{WORKDIR}/results/off.jsonl",
                           "--merged", f"{WORKDIR}/results/on_off.jsonl"]
    assert calibrate[1:4] == ["-m", "impl.cli", "calibrate"]
    assert flag(calibrate, "--from-bench") == f"{WORKDIR}/results/on_off.jsonl"
    assert flag(calibrate, "--base-profile") == "qwen3-32b@p5en-tp8"


def test_mode_is_required_where_it_matters(write_config):
    path = write_config(sample())
    for step in ("decode", "prefill", "router", "bench"):
        done = run_script(SCRIPTS[step], "--config", str(path), "--dry-run")
        assert done.returncode != 0 and "--mode" in done.stderr and done.stdout == ""


def test_ssh_wraps_the_same_command(write_config):
    config = sample()
    plain = dry_run(write_config(config, "plain.toml"), "decode", "on")[0]
    config["decode"]["ssh"] = "ubuntu@10.0.1.12"
    [remote] = dry_run(write_config(config, "ssh.toml"), "decode", "on")
    assert remote[:5] == ["ssh", "-o", "BatchMode=yes", "-tt", "ubuntu@10.0.1.12"] and len(remote) == 6
    cd, _, rest = remote[5].partition(" && exec ")
    assert shlex.split(cd) == ["cd", WORKDIR]
    assert shlex.split(rest) == plain


def test_lease_retention_bounds_the_router_entries_by_the_lease_cap(write_config):
    config = sample()
    config["connector"].update(bidikv_retention="lease", bidikv_lease_s=30, bidikv_lease_max_hold_s=1200)
    [router] = dry_run(write_config(config), "router", "on")
    assert float(flag(router, "--decoder-kv-blocks-ttl")) == 1200


def test_without_dry_run_the_script_execs_exactly_the_printed_command(write_config, fake_python, tmp_path):
    fake, record = fake_python
    config = sample()
    config["deploy"]["python"] = str(fake)
    config["bench"]["results_dir"] = str(tmp_path / "results")
    path = write_config(config)
    for step, mode in (("decode", "on"), ("prefill", "off"), ("router", "on"), ("bench", "on")):
        printed = dry_run(path, step, mode)[-1]
        done = run_script(SCRIPTS[step], "--config", str(path), "--mode", mode)
        assert done.returncode == 0, done.stderr
        seen = json.loads(record.read_text().splitlines()[-1])
        env, argv = split_env(printed)
        assert argv[0] == str(fake) and seen["argv"] == argv[1:]
        assert all(seen["env"][k] == v for k, v in env.items())
    assert (tmp_path / "results").is_dir()  # the bench step's mkdir ran before the bench was exec'd


def test_shipped_config_renders_through_the_bidikv_cli():
    shipped = ROOT / "impl" / "deploy" / "deploy.toml"
    done = subprocess.run([sys.executable, "-m", "impl.cli", "deploy", "plan", "--config", str(shipped)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    headers = [line for line in done.stdout.splitlines() if line.startswith("## ")]
    assert headers == [f"## {s} --mode {m}" for m in ("on", "off") for s in ("decode", "prefill", "router", "bench")] \
        + ["## report"]
    check = subprocess.run([sys.executable, "-m", "impl.deploy", "check", "--config", str(shipped)],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "OK" in check.stdout, check.stderr
