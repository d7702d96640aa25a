"""``bidikv calibrate`` / ``bidikv profile`` through argparse, as the top-level CLI registers them: with the
simulator passed in (sim.commands.calibrate), and without it (calibration.cli alone: the closed form)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from calibration import cli
from calibration.report import CLOSED_FORM, SIMULATOR, resolve_source
from sim.commands import calibrate as calibration_cli  # what bidikv registers: calibration.cli with the simulator passed in
from tests.calibration.conftest import GLM5_FP8, QWEN3_32B

RECORD_KEYS = {"model", "prompt_tokens", "metric", "mode", "measured_ms", "simulated_ms", "rel_error", "source"}


def test_import_does_no_io_and_loads_nothing_heavy():
    # sim.commands.calibrate is what bidikv imports to register the commands: the simulator loads when one runs
    code = ("import sys, calibration.cli, sim.commands.calibrate; "
            "assert not {'scipy', 'matplotlib', 'numpy', 'sim.replay.published'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_register_on_a_foreign_parser():
    parser = argparse.ArgumentParser(prog="bidikv")
    sub = parser.add_subparsers(dest="command")
    cli.register(sub)
    args = parser.parse_args(["profile", "--model-config", "c.json", "--tp", "4"])
    assert args.run is cli.run_profile and args.hardware == "p5en"
    assert parser.parse_args(["calibrate", "--json"]).run is cli.run_calibrate


def test_calibrate_json_records(capsys):
    assert cli.main(["calibrate", "--source", "closed-form", "--json"]) == 0
    out = capsys.readouterr()
    recs = json.loads(out.out)
    assert len(recs) == 20 and all(set(r) == RECORD_KEYS for r in recs)
    assert {r["source"] for r in recs} == {CLOSED_FORM}
    assert "closed form" in out.err  # says which source it used
    for r in recs:
        assert r["rel_error"] == pytest.approx(r["simulated_ms"] / r["measured_ms"] - 1)


def test_without_a_simulator_calibrate_says_closed_form_and_what_needs_one(capsys):
    source = resolve_source("auto")
    assert source.kind == CLOSED_FORM and "no simulator passed in" in source.description
    assert cli.main(["calibrate"]) == 0  # python -m calibration.cli calibrate
    out = capsys.readouterr().out
    assert out.startswith("source: closed form") and "bidikv calibrate compares with the simulator" in out
    assert "figures within 3 %" in out and "physical floors" in out
    assert cli.main(["calibrate", "--source", "sim"]) == 2
    assert cli.main(["calibrate", "--leave-one-model-out"]) == 2
    assert "--leave-one-model-out runs the simulator" in capsys.readouterr().err


def test_bidikv_calibrate_compares_with_the_simulator(capsys):
    assert calibration_cli.main(["calibrate", "--json"]) == 0
    out = capsys.readouterr()
    assert {r["source"] for r in json.loads(out.out)} == {SIMULATOR}
    assert "source: simulator: sim.replay.published.simulate_published_point (seed 0)" in out.err


def test_calibrate_says_closed_form_when_the_simulator_does_not_import(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "sim.replay.published", None)  # importing it now raises ImportError
    assert calibration_cli.main(["calibrate"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("source: closed form") and "not importable" in out
    assert calibration_cli.main(["calibrate", "--source", "sim"]) == 2


def test_calibrate_plots(tmp_path, capsys):
    assert cli.main(["calibrate", "--source", "closed-form", "--plots", str(tmp_path)]) == 0
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert len(pngs) == 4 and all(p.endswith(("-ttft.png", "-prefill-split.png")) for p in pngs)
    assert all((tmp_path / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)


@pytest.mark.parametrize("flag", ["--leave-one-model-out", "--leave-one-out"])
def test_leave_one_model_out_json(capsys, flag):
    assert calibration_cli.main(["calibrate", flag, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert len(rep["published"]) == 20 and {r["trained_on"] for r in rep["published"]} == {"Qwen3-32B", "GLM-5-FP8"}
    assert {r["model"] for r in rep["heldout"]} == {"Llama-3.3-70B (TP4)", "Llama-3.3-70B (TP8)"}
    assert {s["group"] for s in rep["summary"]} == {"transfer", "prefill/TTFT", "TPOT"}


def test_leave_one_model_out_table(capsys):
    assert calibration_cli.main(["calibrate", "--leave-one-model-out"]) == 0
    out = capsys.readouterr().out
    assert "Summary: |error| median / max" in out and "Llama-3.3-70B (TP4)" in out


@pytest.mark.parametrize("config,tp,block", [(QWEN3_32B, 8, 16), (GLM5_FP8, 8, 64), (QWEN3_32B, 2, 16)])
def test_profile_command(write_config, capsys, config, tp, block):
    path = write_config(config)
    assert calibration_cli.main(["profile", "--model-config", str(path), "--hardware", "p5en", "--tp", str(tp)]) == 0
    out = capsys.readouterr()
    profile = json.loads(out.out)
    assert profile["tp"] == tp and profile["block_size"] == block
    assert "physical floors" in out.err
    source = {id(QWEN3_32B): "Qwen3-32B", id(GLM5_FP8): "GLM-5-FP8"}[id(config)]
    assert f"prefill terms from {source}" in out.err and "its family was measured" in out.err
    assert "save this profile with -o PROFILE.json" in out.err
    assert (f"bidikv calibrate --from-bench fit.jsonl --base-profile PROFILE.json --block-size {block} "
            f"--kv-bytes-per-token {profile['kv_bytes_per_token']:.0f}") in out.err


def test_profile_command_names_the_bad_field(write_config, capsys):
    path = write_config({k: v for k, v in QWEN3_32B.items() if k != "num_key_value_heads"})
    assert cli.main(["profile", "--model-config", str(path), "--tp", "8"]) == 2
    assert "num_key_value_heads" in capsys.readouterr().err


def test_profile_command_writes_file(write_config, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert cli.main(["profile", "--model-config", str(write_config(QWEN3_32B)), "--tp", "8", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["kv_bytes_per_token"] == 262_144
    assert f"--base-profile {out} " in capsys.readouterr().err


def test_leave_one_model_out_standalone(capsys):
    from calibration import loo

    assert loo.main(["--markdown"]) == 2  # python -m calibration.loo: no simulator
    assert "python -m sim.commands.calibrate loo" in capsys.readouterr().err
    assert calibration_cli.main(["loo", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| trained on | predicted |") and "Llama-3.3-70B (TP4)" in out
