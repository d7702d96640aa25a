"""The ON/OFF table from two bench JSONLs, and the merged file the report hands to calibrate."""

from __future__ import annotations

import subprocess
import sys

import pytest

from calibration.bench_records import BenchRecord, read_jsonl, write_jsonl
from tests.deploy.conftest import ROOT


def _record(mode: str, turn: int, prompt: int, ttft_ms: float, cached: int = 0, error: str = "") -> BenchRecord:
    return BenchRecord(conversation=f"c{turn % 3}", turn=turn, mode=mode, prompt_tokens=prompt, output_tokens=10,
                       start_s=float(turn), ttft_s=ttft_ms / 1e3, total_s=ttft_ms / 1e3 + 1.0,
                       reuse_offered_tokens=cached, prefill_cached_tokens=cached, error=error)


@pytest.fixture
def runs(tmp_path):
    # 1-2k bucket: OFF 200/400 ms, ON 100/200 ms -> p50 300 vs 150 (2.00x); 4-8k: OFF 900, ON 300 (3.00x)
    off = [_record("off", 1, 1500, 200), _record("off", 2, 1600, 400), _record("off", 3, 5000, 900)]
    on = [_record("on", 1, 1500, 100, cached=750), _record("on", 2, 1600, 200, cached=800),
          _record("on", 3, 5000, 300, cached=4000), _record("on", 4, 5000, 50, error="stream cut after the first token")]
    on_path, off_path = tmp_path / "on.jsonl", tmp_path / "off.jsonl"
    write_jsonl(on, str(on_path))
    write_jsonl(off, str(off_path))
    return on_path, off_path


def _row(table: str, label: str) -> list[str]:
    [line] = [ln for ln in table.splitlines() if ln.startswith(f"| {label} |")]
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_table_and_merged_file(runs, tmp_path):
    on_path, off_path = runs
    merged = tmp_path / "both.jsonl"
    done = subprocess.run([sys.executable, "-m", "impl.deploy", "compare", str(on_path), str(off_path),
                           "--merged", str(merged)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    table = done.stdout
    assert "4 ON turns, 1 failed; 3 OFF turns, 0 failed" in table
    assert _row(table, "1-2k") == ["1-2k", "2/2", "300", "150", "2.00x", "380", "190", "2.00x", "50.0%"]
    assert _row(table, "4-8k") == ["4-8k", "1/1", "900", "300", "3.00x", "900", "300", "3.00x", "80.0%"]
    assert table.index("| 1-2k |") < table.index("| 4-8k |") < table.index("| all |")
    both = read_jsonl(str(merged))
    assert sorted(r.mode for r in both) == ["off"] * 3 + ["on"] * 4


def test_swapped_files_are_refused(runs):
    on_path, off_path = runs
    done = subprocess.run([sys.executable, "-m", "impl.deploy", "compare", str(off_path), str(on_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"{off_path}: expected a --mode on run" in done.stderr


def test_the_merged_file_fits_with_calibrate(runs, tmp_path):
    """The report's second command accepts what its first one wrote (OFF turns pin prefill terms)."""
    from calibration.from_bench import fit_from_bench
    from calibration.profile import LatencyProfile
    from impl.deploy.compare import compare

    on_path, off_path = runs
    merged = tmp_path / "both.jsonl"
    compare(str(on_path), str(off_path), str(merged))
    profile, report = fit_from_bench(read_jsonl(str(merged)), LatencyProfile.load("qwen3-32b@p5en-tp8"))
    assert report["turns"] == 6  # the failed ON turn is left out
