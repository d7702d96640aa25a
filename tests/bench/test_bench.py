"""bidikv bench against the router in front of scripted upstreams (fakes: the real-vLLM run is in tests/e2e)."""

from __future__ import annotations

import asyncio
import json

import pytest

from sim.bench.client import run_bench
from sim.bench.config import BenchConfig
from calibration.bench_records import read_jsonl, write_jsonl
from sim.workload.model import Conversation, Turn
from tests.router.harness import Deployment


def _convs():
    # 3 turns of growing prompts; the fake D answers 4 tokens per turn whatever max_tokens says
    return [Conversation(f"bench-{i}", 0.0, (Turn(40, 4), Turn(60, 4), Turn(90, 4)), 0) for i in range(3)]


async def test_records_measure_each_turn_and_carry_what_the_router_reused(tmp_path):
    async with Deployment(style="final_chunk") as dep:
        config = BenchConfig(url=dep.url, mode="on", concurrency=2, seed=1)
        records = await run_bench(config, _convs())
    assert len(records) == 9 and all(r.ok for r in records)
    by_turn = {(r.conversation, r.turn): r for r in records}
    for conv in _convs():
        for index, turn in enumerate(conv.turns):
            r = by_turn[(conv.conversation_id, index)]
            assert r.prompt_tokens == turn.prompt_tokens  # exact: token-id prompts
            assert r.output_tokens == 4 and 0 < r.ttft_s <= r.total_s
            # turn 1 has nothing to reuse; later turns are offered turn k-1's KV, and P reports using it
            assert (r.reuse_offered_tokens > 0) == (index > 0)
            assert r.prefill_cached_tokens == r.reuse_offered_tokens
    path = tmp_path / "bench.jsonl"
    write_jsonl(records, str(path))
    assert read_jsonl(str(path)) == records


def test_concurrency_and_mode_are_validated():
    with pytest.raises(ValueError, match="mode"):
        BenchConfig(url="http://x", mode="maybe")
    with pytest.raises(ValueError, match="concurrency"):
        BenchConfig(url="http://x", mode="on", concurrency=0)


@pytest.mark.parametrize("line, field", [
    ("not json", "invalid JSON"),
    ('{"format": "bidikv-bench/1", "turn": -1}', "turn"),
    ('{"format": "other"}', "format"),
])
def test_bad_bench_lines_are_named(tmp_path, line, field):
    path = tmp_path / "b.jsonl"
    good = {"conversation": "c", "turn": 0, "mode": "on", "prompt_tokens": 10, "output_tokens": 2, "start_s": 0.0,
            "ttft_s": 0.1, "total_s": 0.2, "reuse_offered_tokens": 0, "prefill_cached_tokens": None,
            "format": "bidikv-bench/1"}
    path.write_text(json.dumps(good) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=f"line 2.*{field}"):
        read_jsonl(str(path))


def test_a_failed_turn_without_ttft_round_trips(tmp_path):
    from calibration.bench_records import BenchRecord, write_jsonl

    failed = BenchRecord(conversation="c", turn=1, mode="on", prompt_tokens=10, output_tokens=0, start_s=1.0,
                         ttft_s=float("nan"), total_s=0.5, reuse_offered_tokens=0, prefill_cached_tokens=None,
                         error="HTTP 503: no decode instance")
    path = tmp_path / "b.jsonl"
    write_jsonl([failed], str(path))
    assert '"ttft_s": null' in path.read_text()  # strict JSON, no NaN token
    (back,) = read_jsonl(str(path))
    assert back.error == failed.error and back.ttft_s != back.ttft_s  # NaN again


def test_null_ttft_on_a_successful_turn_is_rejected(tmp_path):
    path = tmp_path / "b.jsonl"
    line = {"conversation": "c", "turn": 0, "mode": "on", "prompt_tokens": 10, "output_tokens": 2, "start_s": 0.0,
            "ttft_s": None, "total_s": 0.2, "reuse_offered_tokens": 0, "prefill_cached_tokens": None,
            "format": "bidikv-bench/1"}
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError, match="line 1.*ttft_s"):
        read_jsonl(str(path))

