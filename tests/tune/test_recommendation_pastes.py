"""Every configuration `bidikv tune` can recommend pastes: into vLLM (0.32 and 0.33 parse the
--kv-transfer-config values), into our connector (its validator), into the deploy recipe
(`bidikv deploy check`), and the router command starts with every P and D of the tuned topology.

"Can recommend": every sweep point of the default grid (fixed TTLs, leases, gap quantiles, the learnt
per-turn retention, each with every threshold), every setting of every design `bidikv tune --designs`
compares (sim/tune/designs.py: prefill on D adds router flags) and vLLM's default; the oracle and OFF are
references, never recommended.
"""

from __future__ import annotations

import json
import pathlib
import shlex
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request

import pytest

from tests.vllm_releases import OTHER_RELEASES, vllm_parse

from impl.cli import main
from impl.connector.config import ConnectorSettings
from impl.connector.two_tier import check_kv_transfer_config
from sim.tune.frontier import Point
from sim.tune.grid import REFERENCES, build_grid
from sim.tune.design_report import design_settings
from sim.tune.designs import DESIGNS, DesignRow, Settings, design_candidates
from sim.tune.grid import DEFAULT_THRESHOLDS, DEFAULT_TTLS_S
from sim.tune.report import DECODE_HTTP_PORT, HEARTBEAT_PORT, paste_lines, recommendation_text, vllm_settings

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROFILE = "qwen3-32b@p5en-tp8"
TOPOLOGY = (2, 3)
DECODE_KV_TOKENS = 3 * 950_000  # the learnt retention's budget is a share of it
DESIGN_CANDIDATES = [c for c, key in zip(*design_candidates(DESIGNS, Settings(DEFAULT_TTLS_S, DEFAULT_THRESHOLDS, 50.0)))
                     if key]
CANDIDATES = [*build_grid(learnt_retention_budget_pct=50.0), *(c for c in REFERENCES if c.kind == "default"),
              *DESIGN_CANDIDATES]


def _settings():
    return [(c, design_settings(DesignRow(None, Point(c, {}), True), PROFILE, TOPOLOGY, DECODE_KV_TOKENS))
            for c in CANDIDATES]


def _pasted_configs(candidate) -> list[str]:
    """The --kv-transfer-config values exactly as a shell passes them from the printed recommendation."""
    text = "\n".join(paste_lines(design_settings(DesignRow(None, Point(candidate, {}), True), PROFILE, TOPOLOGY,
                                                 DECODE_KV_TOKENS), {}))
    values = []
    for line in text.splitlines():
        if "--kv-transfer-config" in line:
            argv = shlex.split(line.split(":", 1)[1])
            values.append(argv[argv.index("--kv-transfer-config") + 1])
    assert len(values) == 2, text
    return values


def test_the_grid_covers_every_retention_and_threshold():
    kinds = {(c.policy.get("retention"), c.threshold) for c in CANDIDATES}
    assert {r for r, _ in kinds} == {"ttl", "lease", "gap_quantile", "learnt"}
    assert {t for _, t in kinds} == {"0", "64", "256", "1024", "break_even"}


def test_no_recommendation_carries_an_infinity_or_nan():
    for c in CANDIDATES:
        for value in _pasted_configs(c):
            json.loads(value, parse_constant=lambda name: pytest.fail(f"{c.label}: {name} in {value}"))
            assert '"inf' not in value.lower(), value


def test_the_connector_validator_accepts_every_recommendation():
    host = 0
    for c, s in _settings():
        for side in ("prefill_kv_transfer_config", "decode_kv_transfer_config"):
            # either form, bidikv's child checked by bidikv's validator (raises, naming the key)
            parts = check_kv_transfer_config(s[side])
            ConnectorSettings.from_extra_config(parts.nixl["kv_connector_extra_config"])
            if c.policy.get("host_tier"):
                host += 1
                assert s[side]["kv_connector"] == "MultiConnector" and parts.host_tier is not None
                assert parts.host_tier.offload_prompt_only is (side.startswith("prefill"))  # D stores its answers
            else:
                assert parts.offloading is None
    assert host >= 4


def test_the_heartbeat_port_is_not_a_port_the_recipe_already_uses():
    recipe = tomllib.loads((ROOT / "impl/deploy/deploy.toml").read_text())
    used = {recipe[r][k] for r in ("prefill", "decode") for k in ("http_port", "side_channel_port")} | {recipe["router"]["port"]}
    assert HEARTBEAT_PORT not in used and DECODE_HTTP_PORT == recipe["decode"]["http_port"]
    leases = [s for c, s in _settings() if c.policy.get("retention") == "lease"]
    assert leases and all(s["decode_kv_transfer_config"]["kv_connector_extra_config"]["bidikv_heartbeat_port"]
                          == HEARTBEAT_PORT for s in leases)


def _deploy_toml_with(connector: dict, path: pathlib.Path, router_extra_args: list | None = None) -> pathlib.Path:
    """The shipped recipe with the recommendation's [connector] keys (and [router] extra_args) set, as the
    printed hint says."""
    text = (ROOT / "impl/deploy/deploy.toml").read_text()
    head, rest = text.split("\n[connector]", 1)
    _, tail = rest.split("\n[router]", 1)
    if router_extra_args:
        before, after = tail.split("extra_args = []", 1)
        tail = f"{before}extra_args = {json.dumps(router_extra_args)}{after}"
    table = dict(tomllib.loads(text)["connector"])
    table.update(connector)
    body = "".join(f"{k} = {json.dumps(v)}\n" for k, v in table.items())
    path.write_text(f"{head}\n[connector]\n{body}\n[router]{tail}")
    return path


def test_deploy_check_accepts_every_recommendation(tmp_path, capsys):
    seen = set()
    for c, s in _settings():
        key = json.dumps([s["deploy_connector"], s["deploy_router_extra_args"]], sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        path = _deploy_toml_with(s["deploy_connector"], tmp_path / f"deploy{len(seen)}.toml",
                                 s["deploy_router_extra_args"])
        assert main(["deploy", "check", "--config", str(path)]) == 0, (c.label, capsys.readouterr())
        out = capsys.readouterr().out
        assert ": OK" in out, out
    assert len(seen) > 10


@pytest.mark.parametrize("version", ("0.32.0",) + OTHER_RELEASES)
def test_vllm_parses_every_recommendation(version):
    values = [v for c in CANDIDATES for v in _pasted_configs(c)]
    results = vllm_parse(values, version)
    assert len(results) == len(values)
    for value, result in zip(values, results):
        assert result["ok"], (value, result)
        assert result["extra"] == json.loads(value)["kv_connector_extra_config"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_ttl_of_zero_is_recommended_as_bidirectional_off():
    [(c, s)] = [(c, s) for c, s in _settings() if c.label == "ttl=0s thr=64"]
    for side in ("prefill_kv_transfer_config", "decode_kv_transfer_config"):
        assert s[side]["kv_connector_extra_config"]["bidirectional_kv_xfer"] is False
    assert s["deploy_mode"] == "off" and "--decoder-kv-blocks-ttl" not in s["router_argv"]
    assert "bidirectional transfer OFF" in recommendation_text(Point(c, {}), PROFILE, TOPOLOGY)


def test_the_learnt_retention_is_asked_by_the_router_and_read_by_our_connector():
    [(c, s)] = [(c, s) for c, s in _settings() if c.label == "learnt thr=64"]
    decode = s["decode_kv_transfer_config"]
    assert decode["kv_connector_module_path"] == "impl.connector"  # stock vLLM would ignore the per-turn hold
    assert decode["kv_connector_extra_config"]["decoder_kv_blocks_ttl"] == 3605.0  # the longest hold: D cuts none
    argv = s["router_argv"]
    assert argv[argv.index("--learnt-retention-budget-tokens") + 1] == str(DECODE_KV_TOKENS // 2)
    assert argv[argv.index("--decoder-kv-blocks-ttl") + 1] == "3605"
    assert s["deploy_router_extra_args"] == argv[argv.index("--learnt-retention-budget-tokens"):]
    text = recommendation_text(Point(c, {}), PROFILE, TOPOLOGY, DECODE_KV_TOKENS)
    assert "[router] extra_args = " in text and "--learnt-retention-budget-tokens" in text.split("impl/deploy")[1]
    with pytest.raises(ValueError, match="decode KV tokens"):
        vllm_settings(Point(c, {}), PROFILE, TOPOLOGY)


@pytest.mark.parametrize("retention, ttl, on_d", [("ttl", 480.0, "off"), ("ttl", 0.0, "off"), ("lease", None, "off"),
                                                  ("gap_quantile", None, "off"), ("learnt", None, "off"),
                                                  ("ttl", None, "isl_or_load")])
def test_the_router_command_starts_with_the_tuned_topology(retention, ttl, on_d):
    c, s = next((c, s) for c, s in _settings() if c.policy.get("retention") == retention
                and (ttl is None or c.policy["decoder_kv_blocks_ttl"] == ttl)
                and c.policy.get("prefill_on_d", "off") == on_d)
    argv = shlex.split(s["router_command"])
    assert argv == s["router_argv"] and argv[:2] == ["bidikv", "router"]
    urls = [a for a in argv if a.startswith("http://")]
    assert len([u for u in urls if "//P" in u]) == TOPOLOGY[0] and len([u for u in urls if "//D" in u]) == TOPOLOGY[1]
    port = _free_port()
    # the placeholders P0.., D0.. resolve nowhere: the router must start anyway and report them down
    proc = subprocess.Popen([sys.executable, "-m", "impl.cli", *argv[1:], "--host", "127.0.0.1", "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        health = None
        while time.monotonic() < deadline and health is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    health = json.load(r)
            except urllib.error.HTTPError as e:  # 503: up, no healthy instance
                health = json.load(e)
            except OSError:
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.2)
        assert health is not None, "router did not answer /health within 60 s"
        assert health["prefill"]["total"] == TOPOLOGY[0] and health["decode"]["total"] == TOPOLOGY[1]
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert "Traceback" not in out, out
    if retention == "ttl" and ttl:
        assert argv[argv.index("--decoder-kv-blocks-ttl") + 1] == "480"
    if on_d != "off":
        assert argv[argv.index("--prefill-on-d") + 1] == on_d and "--prefill-on-d" in s["deploy_router_extra_args"]
