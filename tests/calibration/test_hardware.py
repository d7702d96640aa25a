"""The shipped hardware presets: each loads, each value names its source, and ``bidikv profile`` follows them.

``bidikv profile --hardware NAME`` builds its physics from the preset (HBM, FLOP/s, EFA) and, off p5en, must
say that the fitted terms are p5en's carried over, and on trn2 that vLLM's engine overheads on Neuron are
unknown to this project.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from calibration import cli
from calibration.build import profile_from_architecture
from calibration.hardware import DATA_DIR, MEASURED_ON, PRESETS, load_hardware
from impl.cli import main as bidikv_main

REPO = pathlib.Path(__file__).resolve().parents[2]
QWEN3_CONFIG = REPO / "calibration" / "data" / "config_qwen3-32b.json"


def _raw(key: str) -> dict:
    return json.loads((DATA_DIR / f"hardware_{key}.json").read_text())


def _numeric_fields(data: dict) -> list[str]:
    """Every number in a preset, nested mappings as ``field.key`` (dense_flops_per_s_per_gpu.bf16)."""
    names = []
    for name, value in data.items():
        if name.startswith("_"):
            continue
        if isinstance(value, dict):
            names += [f"{name}.{k}" for k, v in value.items() if isinstance(v, (int, float))]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            names.append(name)
    return names


def test_the_shipped_files_are_the_presets():
    assert sorted(p.stem.removeprefix("hardware_") for p in DATA_DIR.glob("hardware_*.json")) == sorted(PRESETS)
    assert list(PRESETS) == ["p5", "p5e", "p5en", "p6-b200", "trn2"]


@pytest.mark.parametrize("key", list(PRESETS))
def test_every_preset_loads(key):
    hw = load_hardware(key)
    assert hw.key == key and hw.name == PRESETS[key] == _raw(key)["name"]
    assert load_hardware(PRESETS[key]) == hw  # by instance type too
    assert set(hw.dense_flops_per_s_per_gpu) == {"bf16", "fp8"}
    assert hw.efa_bytes_per_s_per_gpu * hw.gpus_per_node * 8 == pytest.approx(_raw(key)["efa_bits_per_s_total"])
    hw.check_tp(hw.gpus_per_node)


@pytest.mark.parametrize("key", list(PRESETS))
def test_every_numeric_field_has_a_source_url(key):
    data = _raw(key)
    sources = data["_sources"]
    numeric = _numeric_fields(data)
    assert {"gpus_per_node", "hbm_bytes_per_gpu", "hbm_bytes_per_s_per_gpu", "dense_flops_per_s_per_gpu.bf16",
            "dense_flops_per_s_per_gpu.fp8", "nvlink_bytes_per_s_per_gpu", "efa_bits_per_s_total",
            "efa_bytes_per_s_per_gpu", "vcpus", "host_ram_bytes"} <= set(numeric)
    missing = [name for name in numeric if not str(sources.get(name, "")).startswith("https://")]
    assert missing == []
    stale = [name for name in sources if name.split(".")[0] not in data]  # a source for a field that is gone
    assert stale == []
    assert data["_source"] and data["efa_generation"].startswith("EFA v") and sources["efa_generation"]


def test_the_presets_say_what_their_sources_do_not():
    trn2 = _raw("trn2")
    assert any(note.startswith("UNKNOWN: vLLM's engine overheads on Neuron") for note in trn2["_notes"])
    for key in set(PRESETS) - {MEASURED_ON}:
        assert any("carried over" in note or "UNKNOWN" in note for note in _raw(key)["_notes"]), key


def _profile(capsys, hardware: str) -> tuple[dict, str]:
    assert bidikv_main(["profile", "--hardware", hardware, "--model-config", str(QWEN3_CONFIG), "--tp", "8"]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err


def test_profile_on_p6_b200_follows_the_preset(capsys):
    b200, err = _profile(capsys, "p6-b200")
    p5en, p5en_err = _profile(capsys, "p5en")
    assert b200["hardware"] == "p6-b200.48xlarge" and p5en["hardware"] == "p5en.48xlarge"
    hw, ref = load_hardware("p6-b200"), load_hardware("p5en")
    # HBM capacity: the KV budget grows by TP x the extra HBM x the same memory utilisation
    util = b200["provenance"]["efficiencies"]["gpu_memory_utilization"]
    assert b200["decode_hbm_kv_bytes"] - p5en["decode_hbm_kv_bytes"] == pytest.approx(
        8 * (hw.hbm_bytes_per_gpu - ref.hbm_bytes_per_gpu) * util)
    # HBM bandwidth: reading a context token's KV is faster by the bandwidth ratio
    assert b200["decode_per_ctx_token_s"] / p5en["decode_per_ctx_token_s"] == pytest.approx(
        ref.hbm_bytes_per_s_per_gpu / hw.hbm_bytes_per_s_per_gpu)
    # dense BF16 peak: the GEMM cost per token shrinks by the FLOP/s ratio
    assert b200["prefill_per_token_s"] / p5en["prefill_per_token_s"] == pytest.approx(
        ref.dense_flops_per_s_per_gpu["bf16"] / hw.dense_flops_per_s_per_gpu["bf16"])
    assert "fitted on p5en (H200) measurements and carried over to p6-b200" in err
    assert b200["provenance"]["hardware_caveats"] and "Neuron" not in err
    assert "WARNING" not in p5en_err and "hardware_caveats" not in p5en["provenance"]


def test_profile_on_trn2_says_neuron_overheads_are_unknown(capsys):
    trn2, err = _profile(capsys, "trn2")
    assert trn2["hardware"] == "trn2.48xlarge"
    assert "vLLM's engine overheads on Neuron (Trainium2) are unknown to this project" in err
    assert "carried over to trn2" in err
    assert trn2["transfer_bytes_per_s"] < _profile(capsys, "p5en")[0]["transfer_bytes_per_s"]  # 25 vs 50 GB/s a chip


def test_given_efficiencies_are_not_called_carried(tmp_path):
    p = profile_from_architecture(QWEN3_CONFIG, "trn2", 8, "p5en")
    caveats = p.provenance["hardware_caveats"]
    assert len(caveats) == 1 and "unknown to this project" in caveats[0] and "borrowed" not in caveats[0]
    assert "hardware_caveats" not in profile_from_architecture(QWEN3_CONFIG, "p6-b200", 8, "p5en").provenance


def test_tp_beyond_the_preset_is_refused():
    with pytest.raises(ValueError, match=r"1\.\.8 on p6-b200\.48xlarge"):
        profile_from_architecture(QWEN3_CONFIG, "p6-b200", 16)
    assert profile_from_architecture(QWEN3_CONFIG, "trn2", 16).tp == 16


@pytest.mark.parametrize("bad", ["p4d", "h100", "p6-b300.48xlarge", "no/such/file.json"])
def test_a_bad_hardware_name_errors_naming_the_choices(capsys, bad):
    assert cli.main(["profile", "--hardware", bad, "--model-config", str(QWEN3_CONFIG), "--tp", "8"]) == 2
    err = capsys.readouterr().err
    assert f"unknown hardware {bad!r}" in err and "choose one of p5, p5e, p5en, p6-b200, trn2" in err


def test_help_lists_the_presets(capsys):
    with pytest.raises(SystemExit):
        cli.main(["profile", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "p5, p5e, p5en, p6-b200, trn2" in out
