"""The shipped published-decode table (calibration/data/decode_published.csv) and its loader's checks."""

from __future__ import annotations

import csv
import pathlib

import pytest

from calibration.decode_published import (COLUMNS, DECODE_CSV, GPUS, PRECISIONS, coverage, load_decode_published)

FIGURES = load_decode_published()


def test_every_row_names_its_page_and_quotes_it():
    assert len(FIGURES) >= 20
    for f in FIGURES:
        assert f.source_url.startswith("https://"), f
        assert len(f.quote) >= 20, f


def test_every_row_has_a_positive_decode_figure_and_known_names():
    for f in FIGURES:
        assert f.decode_ms_per_token > 0, f
        assert f.precision in PRECISIONS and f.gpu in GPUS, f


def test_vllm_rows_alone_cover_four_models_two_gpus_dense_and_moe_bf16_and_fp8():
    vllm = [f for f in FIGURES if f.is_vllm]
    assert len({f.model for f in vllm}) >= 4
    assert len({f.gpu for f in vllm}) >= 2
    assert {f.architecture for f in vllm} == {"dense", "moe"}
    assert {"BF16", "FP8"} <= {f.precision for f in vllm}
    assert len(coverage(vllm)) >= 5  # distinct (model, gpu) pairs


def test_exactly_the_pr32553_row_is_held_out():
    held = [f for f in FIGURES if f.heldout]
    assert len(held) == 1
    assert held[0].source_url == "https://github.com/vllm-project/vllm/pull/32553"
    assert held[0].model.startswith("Llama-3.3-70B") and held[0].gpu == "H200"
    # the PR's "without the PR" statistics summary: tpot_ms mean 21.88 over 129 requests
    assert held[0].tpot_ms == pytest.approx(21.88) and held[0].num_requests == 129


def test_rows_with_a_batch_say_what_kind_of_batch_it_is():
    for f in FIGURES:
        if f.batch_or_concurrency is not None:
            assert f.concurrency_kind, f


def test_tpot_and_per_user_rate_agree_where_both_are_given():
    # InferenceX's interactivity is per-request tokens/s, so 1000 / TPOT should be close to it
    both = [f for f in FIGURES if f.tpot_ms is not None and f.output_tok_s_per_user is not None]
    assert both
    for f in both:
        assert 1000.0 / f.tpot_ms == pytest.approx(f.output_tok_s_per_user, rel=0.1), f


def _write(tmp_path: pathlib.Path, change: dict[str, str] | None = None, drop: str | None = None,
           extra_field: bool = False) -> pathlib.Path:
    """The shipped file's first data row, changed, under a comment line."""
    with open(DECODE_CSV) as fh:
        lines = [line for line in fh if not line.startswith("#")]
    row = next(csv.DictReader(lines))
    row.update(change or {})
    columns = [c for c in COLUMNS if c != drop]
    path = tmp_path / "decode.csv"
    with open(path, "w", newline="") as fh:
        fh.write("# a comment line\n")
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(columns)
        writer.writerow([row[c] for c in columns] + (["surplus"] if extra_field else []))
    return path


def test_the_unchanged_row_loads(tmp_path):
    assert len(load_decode_published(_write(tmp_path))) == 1


@pytest.mark.parametrize("change, message", [
    ({"source_url": ""}, "field 'source_url' is empty"),
    ({"source_url": "github.com/x"}, "field 'source_url' must be an http(s) address"),
    ({"precision": "fp8"}, "field 'precision' must be one of"),
    ({"gpu": "H100"}, "field 'gpu' must be one of"),
    ({"architecture": "hybrid"}, "field 'architecture' must be one of"),
    ({"tpot_ms": "", "itl_ms": "", "output_tok_s_per_user": ""}, "no decode figure"),
    ({"tpot_ms": "-3"}, "field 'tpot_ms' must be > 0"),
    ({"tpot_ms": "fast"}, "field 'tpot_ms' must be a number"),
    ({"num_gpus_tp": "8.5"}, "field 'num_gpus_tp' must be an integer"),
    ({"heldout": "yes"}, "field 'heldout' must be true or false"),
    ({"concurrency_kind": "lots"}, "field 'concurrency_kind' must be one of"),
])
def test_a_malformed_row_is_named_with_its_field(tmp_path, change, message):
    path = _write(tmp_path, change)
    with pytest.raises(ValueError) as err:
        load_decode_published(path)
    assert f"{path} row 1" in str(err.value) and message in str(err.value)


def test_a_missing_column_and_a_surplus_field_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"row 1: field 'gpu' is missing"):
        load_decode_published(_write(tmp_path, drop="gpu"))
    with pytest.raises(ValueError, match=r"row 1: more fields than the header"):
        load_decode_published(_write(tmp_path, extra_field=True))
