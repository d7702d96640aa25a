"""`bidikv simulate` from the outside: flags, outputs, clear errors for bad input."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from impl.cli import main
from sim.engine.config import load_config


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "impl.cli", *args], capture_output=True, text=True)


def test_compare_prints_ttft_by_prompt_length(capsys):
    assert main(["simulate", "--compare", "--conversations", "6"]) == 0
    out = capsys.readouterr().out
    assert "later p50 on" in out and "later p50 off" in out and "speed-up" in out and "first p50 on" in out
    assert "queue on" in out and out.startswith("workload: synthetic") and "6 conversations" in out


def test_json_summary_and_flags_reach_the_simulation(capsys):
    assert main(["simulate", "--json", "--no-bidirectional", "--conversations", "4", "--seed", "3"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert list(payload["runs"]) == ["off"]
    summary = payload["runs"]["off"]
    assert summary["tokens_reused"] == 0 and summary["completed"] == summary["turns"] > 4
    assert main(["simulate", "--json", "--decoder-kv-blocks-ttl", "inf", "--kv-recompute-threshold", "0",
                 "--conversations", "4", "--seed", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"]["on"]["tokens_reused"] > 0


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


def _strict_loads(text: str):
    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def _trace(path, rows):
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 10,
                                        "hash_ids": list(range(h, h + -(-n // 512)))}) + "\n" for t, n, h in rows))
    return path


def test_one_turn_json_is_strict_and_says_no_value_with_null(tmp_path):
    trace = _trace(tmp_path / "one.jsonl", [(0, 3000, 0)])
    result = run_cli("simulate", "--trace", str(trace), "--json", "--decoder-kv-blocks-ttl", "inf", "--out",
                     str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    payload = _strict_loads(result.stdout)
    run = payload["runs"]["on"]
    assert run["reuse_hit_rate"] is None  # no later turn: no rate, not NaN
    [bucket] = run["prompt_buckets"]
    assert bucket["later_turns"]["n"] == 0 and bucket["later_turns"]["p50_ms"] is None
    assert bucket["first_turns"]["n"] == 1 and bucket["first_turns"]["p50_ms"] > 0
    config = _strict_loads((tmp_path / "out" / "config.json").read_text())
    assert config["policy"]["decoder_kv_blocks_ttl"] is None and config["max_sim_time_s"] is None  # "no limit"
    _strict_loads((tmp_path / "out" / "summary.json").read_text())


def test_json_shape_does_not_depend_on_compare_and_buckets_are_in_numeric_order():
    one = _strict_loads(run_cli("simulate", "--json", "--conversations", "12", "--seed", "2").stdout)
    two = _strict_loads(run_cli("simulate", "--json", "--conversations", "12", "--seed", "2", "--compare").stdout)
    assert one.keys() == two.keys() == {"format", "workload", "runs", "warnings"}
    assert list(one["runs"]) == ["on"] and list(two["runs"]) == ["on", "off"]
    assert one["runs"]["on"].keys() == two["runs"]["off"].keys()
    buckets = two["runs"]["on"]["prompt_buckets"]
    lows = [b["min_tokens"] for b in buckets]
    assert lows == sorted(lows) and len(buckets) >= 3  # "16-32k" after "2-4k" and "8-16k"
    for b in buckets:
        assert b["bucket"] == f"{b['min_tokens'] // 1024}-{b['max_tokens'] // 1024}k"
        assert b["turns"] == b["first_turns"]["n"] + b["later_turns"]["n"]
    workload = two["workload"]
    assert sum(b["turns"] for b in buckets) == workload["turns"] == two["runs"]["on"]["turns"]
    assert sum(b["first_turns"]["n"] for b in buckets) == workload["conversations"] == 12


def test_simulate_and_tune_default_to_the_same_stated_workload():
    from impl.cli import build_parser

    parser = build_parser()
    sim_defaults = run_cli("simulate", "--help").stdout
    tune_defaults = run_cli("tune", "--help").stdout
    for text in (sim_defaults, tune_defaults):
        assert "200 conversations arriving as a Poisson stream at 0.05/s" in " ".join(text.split())
    sim_cfg = __import__("sim.commands.simulate", fromlist=["config_from_args"]).config_from_args(parser.parse_args(["simulate"]))
    tune_cfg = __import__("sim.commands.simulate", fromlist=["config_from_args"]).config_from_args(parser.parse_args(["tune"]))
    assert sim_cfg.workload == tune_cfg.workload == {"kind": "synthetic", "num_conversations": 200,
                                                     "arrival_rate_per_s": 0.05}


def test_queueing_and_saturation_are_called_out(tmp_path):
    burst = tmp_path / "burst.toml"  # the generator's own default: every conversation at 0 s on one P
    burst.write_text("[workload]\nkind = 'synthetic'\n")
    result = run_cli("simulate", "--config", str(burst))
    assert result.returncode == 0, result.stderr
    assert "first turns: queueing is" in result.stderr and "--num-prefill 2" in result.stderr
    # 20k-token prompts every 0.3 s keep one P busy all the time; a short TTL keeps D's memory out of it
    # (at vLLM's 480 s the 200 retained prompts fill D and the last turns wait at D, not at P)
    hot = _trace(tmp_path / "hot.jsonl", [(i * 300, 20000, i * 1000) for i in range(200)])
    ttl = ("--decoder-kv-blocks-ttl", "10")
    result = run_cli("simulate", "--trace", str(hot), "--json", *ttl)
    payload = _strict_loads(result.stdout)
    assert payload["runs"]["on"]["prefill_utilisation"]["p0"] >= 0.95
    assert any("prefill utilisation p0" in w for w in payload["warnings"]) and "warning: [on] prefill" in result.stderr
    # the suggested prefill count carries that load: with it, no instance is saturated and nothing queues long
    import re

    suggested = int(re.search(r"--num-prefill (\d+) keeps them", result.stderr).group(1))
    assert suggested >= 2
    calmer = _strict_loads(run_cli("simulate", "--trace", str(hot), "--json", "--num-prefill", str(suggested),
                                   *ttl).stdout)
    assert max(calmer["runs"]["on"]["prefill_utilisation"].values()) < 0.95 and calmer["warnings"] == []
    quiet = _strict_loads(run_cli("simulate", "--json", "--conversations", "20").stdout)
    assert quiet["warnings"] == []


@pytest.mark.parametrize("make, says", [
    (lambda p: p / "missing.jsonl", "No such file or directory"),
    (lambda p: p, "Is a directory"),
    (lambda p: (p / "empty.jsonl").write_text("") and None or p / "empty.jsonl", "no conversations"),
])
def test_bad_trace_files_are_one_line(tmp_path, make, says):
    result = run_cli("simulate", "--trace", str(make(tmp_path)))
    assert result.returncode == 2 and says in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_out_that_is_a_file_fails_before_simulating(tmp_path):
    (tmp_path / "f").write_text("")
    result = run_cli("simulate", "--out", str(tmp_path / "f"))
    assert result.returncode == 2 and result.stderr.strip() == \
        f"bidikv simulate: error: --out {tmp_path / 'f'}: exists and is not a directory"


def test_a_run_that_would_not_fit_in_memory_is_refused_before_it_starts(monkeypatch):
    import sim.commands.simulate

    # the machine's free memory is the one input this cannot choose: pretend it is 100 kB
    monkeypatch.setattr(sim.commands.simulate, "available_memory_bytes", lambda: 100_000)
    config = load_config(overrides={"workload": {"kind": "synthetic", "num_conversations": 50}})
    with pytest.raises(ValueError, match=r"turns need about .* GB for their records, more than the 0.0 GB available"):
        sim.commands.simulate.load_conversations(config)
    monkeypatch.setattr(sim.commands.simulate, "available_memory_bytes", lambda: None)  # unknown: no refusal
    assert len(sim.commands.simulate.load_conversations(config)) == 50


@pytest.mark.extra("parquet")
def test_parquet_records_hold_what_records_csv_holds(tmp_path):
    import pyarrow.parquet as pq  # the 'parquet' extra, which tools/test.sh installs: missing is a failure

    # a clock limit: turns not sent or not finished by then (NaN times, reasons) are rows too
    out = tmp_path / "run"
    assert main(["simulate", "--conversations", "8", "--seed", "4", "--max-sim-time-s", "900", "--out", str(out),
                 "--parquet"]) == 0
    table = pq.read_table(out / "records.parquet").to_pylist()
    with open(out / "records.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(table) == len(rows) > 8
    reasons = {row["rejected"] for row in rows}
    assert "" in reasons and len(reasons) > 1, reasons  # completed and cut-off turns both
    for parquet_row, csv_row in zip(table, rows):
        for field, value in parquet_row.items():
            # the CSV's cell for each value: repr of a float (nan too), '' for None, str of the rest
            cell = repr(value) if isinstance(value, float) else "" if value is None else str(value)
            assert cell == csv_row[field], (field, value, csv_row[field])


@pytest.mark.extra("parquet")  # with pyarrow, a missing --out is the first thing said
def test_parquet_without_pyarrow_or_out_fails_before_simulating(tmp_path, monkeypatch, capsys):
    import sim.engine.runner

    def no_run(*_a, **_k):
        raise AssertionError("simulated before refusing the flags")

    monkeypatch.setattr(sim.engine.runner, "run_config", no_run)
    assert main(["simulate", "--conversations", "3", "--parquet"]) == 2
    assert "--parquet writes records.parquet into --out" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # what an environment without pyarrow imports
    assert main(["simulate", "--conversations", "3", "--out", str(tmp_path / "o"), "--parquet"]) == 2
    assert "--parquet needs pyarrow" in capsys.readouterr().err


@pytest.mark.parametrize("flags, says", [
    (["--give-back-headroom", "1.5"], "give_back_headroom must be in [0, 1), got 1.5"),
    (["--give-back-publish-window-s", "3"], "give_back_publish_window_s must exceed the expiry margin"),
    (["--retained-under-pressure", "free"], "invalid choice: 'free'"),
])
def test_bad_decode_memory_settings_are_refused_naming_the_flag(flags, says):
    result = run_cli("simulate", "--conversations", "2", *flags)
    assert result.returncode == 2 and says in result.stderr and "Traceback" not in result.stderr, result.stderr
