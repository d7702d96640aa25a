"""TPOT when tokens reach the client in bursts: the bench client counts the tokens that came in the same
read as the first, and leaves them out of the time after TTFT.

On the 2-core rehearsal (three vLLM servers, the router, the client) a server's frontend or the client
falls behind and a turn's tokens arrive together: with two busy loops beside tests/e2e/test_validate_live.py,
4 of its 12 held-out turns and 5 of 12 fit turns brought all 32 tokens in the first read, so (total - ttft)
/ (output - 1) read 0.01 ms against ~6 ms, and the held-out TPOT median |error| went to 98.9 % (102.1 %
failed CI once). The stream here is a real HTTP server writing bursts with pauses between them.
"""

from __future__ import annotations

import asyncio
import json
import math

import aiohttp
import pytest
from aiohttp import web

from sim.bench.client import _turn, turn_record
from sim.bench.config import BenchConfig
from calibration.bench_records import BenchRecord, read_jsonl, write_jsonl
from calibration.busy import decode_loads

# long enough that a scheduler hiccup on a loaded 2-core host does not merge two bursts into one read
PAUSE_S = 0.2
TEXT_ONLY = 0  # a burst of this size: one event with text and no token ids


def _event(token: int | None) -> bytes:
    choice = {"text": "x", "token_ids": [] if token is None else [token]}
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"


async def _serve(bursts: list[int]):
    """A completions endpoint that writes ``bursts[i]`` token events in one write, pausing between writes
    (a burst of TEXT_ONLY: one event of text without ids)."""

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        token = 0
        for i, size in enumerate(bursts):
            if i:
                await asyncio.sleep(PAUSE_S)
            await resp.write(_event(None) if size == TEXT_ONLY else b"".join(_event(token + k) for k in range(size)))
            token += size
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()  # the OS picks the port: no window for another to take it
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


async def _record(bursts: list[int]) -> BenchRecord:
    runner, url = await _serve(bursts)
    try:
        config = BenchConfig(url=url, mode="on")
        async with aiohttp.ClientSession() as session:
            result = await _turn(session, config, "m", "c", [1, 2, 3], sum(bursts))
        assert not result.error, result.error
        return turn_record(config, "c", 0, 3, 0.0, result)
    finally:
        await runner.cleanup()


async def test_tokens_that_came_with_the_first_are_left_out_of_the_time_after_it():
    record = await _record([3, 1, 1, 1, 1])
    assert record.output_tokens == 7 and record.first_read_tokens == 3
    after = record.total_s - record.ttft_s
    assert after > 3 * PAUSE_S  # four pauses came after the first read (less a stall before it was parsed)
    assert record.tpot_s == after / 4  # the 4 tokens decoded after TTFT, not 6
    # one token per read: the first read brought only the first token (the usual case, n - 1)
    steady = await _record([1, 1, 1])
    assert steady.first_read_tokens == 1 and steady.tpot_s == (steady.total_s - steady.ttft_s) / 2


async def test_a_first_event_of_text_alone_stamps_ttft_and_every_token_came_after_it():
    record = await _record([TEXT_ONLY, 2, 1])
    assert record.output_tokens == 3 and record.first_read_tokens == 0
    assert record.tpot_s == (record.total_s - record.ttft_s) / 3


async def test_a_turn_whose_tokens_all_came_at_once_has_no_tpot():
    record = await _record([5])
    assert record.first_read_tokens == 5
    assert math.isnan(record.tpot_s)
    assert decode_loads([record]) == [None]  # the decode fit does not see it either


def _line(**fields) -> dict:
    return {"conversation": "c", "turn": 0, "mode": "on", "prompt_tokens": 10, "output_tokens": 8, "start_s": 0.0,
            "ttft_s": 0.1, "total_s": 0.8, "reuse_offered_tokens": 0, "prefill_cached_tokens": None,
            "format": "bidikv-bench/1", **fields}


def test_a_record_without_the_field_reads_as_before(tmp_path):
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps(_line()) + "\n")  # written before first_read_tokens existed
    (old,) = read_jsonl(str(path))
    assert old.first_read_tokens is None
    assert old.tpot_s == pytest.approx(0.7 / 7)  # (total - ttft) / (output - 1), what it always meant
    path.write_text(json.dumps(_line(first_read_tokens=3)) + "\n")
    (new,) = read_jsonl(str(path))
    assert new.tpot_s == pytest.approx(0.7 / 5)
    write_jsonl([new], str(tmp_path / "again.jsonl"))
    assert read_jsonl(str(tmp_path / "again.jsonl")) == [new]


@pytest.mark.parametrize("value", [9, -1, True, "2", 1.5])
def test_a_bad_first_read_count_is_named(tmp_path, value):
    path = tmp_path / "b.jsonl"
    path.write_text(json.dumps(_line(first_read_tokens=value)) + "\n")
    with pytest.raises(ValueError, match="line 1: field first_read_tokens must be null or an integer from 0 to "
                                         r"output_tokens \(8\)"):
        read_jsonl(str(path))
