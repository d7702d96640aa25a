"""`bidikv simulate` from the outside: flags, outputs, clear errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from impl.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "impl.cli", *args], capture_output=True, text=True)


def test_compare_prints_ttft_by_prompt_length(capsys):
    assert main(["simulate", "--compare", "--conversations", "6"]) == 0
    out = capsys.readouterr().out
    assert "TTFT p50 on" in out and "TTFT p50 off" in out and "speed-up" in out


def test_json_summary_and_flags_reach_the_simulation(capsys):
    assert main(["simulate", "--json", "--no-bidirectional", "--conversations", "4", "--seed", "3"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tokens_reused"] == 0 and summary["completed"] == summary["turns"] > 4
    assert main(["simulate", "--json", "--decoder-kv-blocks-ttl", "inf", "--kv-recompute-threshold", "0",
                 "--conversations", "4", "--seed", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens_reused"] > 0


def test_out_dir_is_byte_identical_for_the_same_seed(tmp_path):
    for name in ("a", "b"):
        assert main(["simulate", "--conversations", "5", "--seed", "11", "--out", str(tmp_path / name)]) == 0
    for f in ("records.csv", "series.csv", "summary.json", "config.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    header = (tmp_path / "a" / "records.csv").read_text().splitlines()[0]
    assert header.startswith("conversation,turn,tenant,prompt_tokens")


@pytest.mark.parametrize("toml, field", [
    ("[policy]\ndecoder_kv_blocks_ttl = -3\n", "policy.decoder_kv_blocks_ttl"),
    ("[policy]\nretention = 'forever'\n", "policy.retention"),
    ("[topology]\nnum_decode = 'two'\n", "num_decode"),
    ("[topolgy]\nnum_decode = 2\n", "topolgy"),
    ("seed = [\n", "invalid TOML"),
    ("[workload]\nkind = 'synthetic'\nnum_conversations = -1\n", "num_conversations"),
])
def test_bad_config_is_a_clear_error_naming_the_field(tmp_path, toml, field):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    result = run_cli("simulate", "--config", str(path))
    assert result.returncode == 2
    assert field in result.stderr and "Traceback" not in result.stderr


def test_bad_trace_line_is_named(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}\n'
                     '{"timestamp": 3000, "input_length": "many", "output_length": 10, "hash_ids": [1, 2]}\n')
    result = run_cli("simulate", "--trace", str(trace))
    assert result.returncode == 2 and "line 2" in result.stderr and "input_length" in result.stderr


def test_unknown_profile_lists_the_shipped_ones():
    result = run_cli("simulate", "--profile", "nope")
    assert result.returncode == 2 and "qwen3-32b@p5en-tp8" in result.stderr
