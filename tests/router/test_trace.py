"""``--trace-out``: the per-turn trace (impl/trace/format.py) as the router writes it, on scripted upstreams."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from impl.trace.format import FORMAT, TraceTurn, keyed_hash, parse_header, parse_turn
from impl.router.trace_writer import TraceLineage, TraceWriter
from tests.router.harness import Deployment


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def read_trace(directory: Path) -> list[TraceTurn]:
    turns = []
    for path in sorted(directory.glob("trace-*.jsonl")):
        lines = path.read_text().splitlines()
        parse_header(json.loads(lines[0]), f"{path}:1")
        turns += [parse_turn(json.loads(line), f"{path}:{i}") for i, line in enumerate(lines[1:], 2)]
    return turns


async def wait_written(dep: Deployment, n: int) -> None:
    for _ in range(200):
        if dep.router.trace.written >= n:
            return
        time.sleep(0.01)
    raise AssertionError(f"only {dep.router.trace.written} of {n} lines written")


async def test_every_turn_is_a_line_with_names_hashed_and_conversations_linked(tmp_path):
    async with Deployment(trace_out=str(tmp_path)) as dep:
        history = [user("secret question one")]
        for turn in range(3):  # no id: linked by history
            r = await dep.chat(history)
            await dep.settle()
            history += [assistant(r.answer), user(f"secret follow-up {turn}")]
        r1 = await dep.chat([user("named q")], conversation_id="my-conversation-id")
        await dep.settle()
        await dep.chat([user("named q"), assistant(r1.answer), user("named q2")], conversation_id="my-conversation-id",
                       stream=False)
        await wait_written(dep, 5)
        metrics_text = (await dep.get("/metrics"))[1].decode()
    turns = read_trace(tmp_path)
    assert len(turns) == 5
    by_history, by_id = turns[:3], turns[3:]
    assert len({t.conversation for t in by_history}) == 1 and [t.turn for t in by_history] == [0, 1, 2]
    assert [t.match for t in by_history] == ["history"] * 3 and [t.miss for t in by_history] == ["no_history", None, None]
    assert by_history[0].offered == 0 and all(t.offered > 0 for t in by_history[1:])
    assert len({t.conversation for t in by_id}) == 1 and [t.turn for t in by_id] == [0, 1] and by_id[0].match == "id"
    assert by_history[0].conversation != by_id[0].conversation
    for t in turns:
        assert t.status == 200 and t.prompt_tokens == 100 and t.output_tokens == 4 and t.decode == "decode-0"
        assert t.ttft_s is not None and t.finish_s >= t.ttft_s and t.prefill == "prefill-0"
    raw = "".join(p.read_text() for p in tmp_path.glob("*.jsonl"))
    for secret in ("secret", "my-conversation-id", "named q", "default", "http://"):
        assert secret not in raw  # no text, no ids, no tenant names, no instance URLs
    assert 'bidikv_router_trace_lines_total{outcome="written"} 5' in metrics_text


async def test_a_failed_turn_is_traced_with_its_status(tmp_path):
    async with Deployment(trace_out=str(tmp_path), n_prefill=0, dead_prefill=1) as dep:
        r = await dep.chat([user("q")])
        assert r.status == 503
        await wait_written(dep, 1)
    (turn,) = read_trace(tmp_path)
    assert turn.status == 503 and turn.prefill is None and turn.output_tokens is None


async def test_sampling_keeps_whole_conversations(tmp_path):
    async with Deployment(trace_out=str(tmp_path), trace_sample_rate=0.5) as dep:
        for c in range(24):
            r = await dep.chat([user(f"c{c}")], conversation_id=f"c{c}")
            await dep.settle()
            await dep.chat([user(f"c{c}"), assistant(r.answer), user("more")], conversation_id=f"c{c}")
        dep.router.trace.close()
    turns = read_trace(tmp_path)
    per_conversation: dict[str, list[int]] = {}
    for t in turns:
        per_conversation.setdefault(t.conversation, []).append(t.turn)
    assert all(v == [0, 1] for v in per_conversation.values())  # all of a conversation or none
    assert 4 <= len(per_conversation) <= 20  # about half of 24


def test_rotation_bounds_the_disk(tmp_path):
    writer = TraceWriter(tmp_path, b"salt", max_file_bytes=4096, max_files=3)
    line = TraceTurn(t=1.0, conversation="0" * 16, tenant="1" * 16, turn=0, match="none", miss=None, status=200)
    for _ in range(1000):
        assert writer.submit(line)
        time.sleep(0)  # let the writer thread run: the queue is the only bound this test does not test
    writer.close()
    files = list(tmp_path.glob("trace-*.jsonl"))
    assert len(files) == 3 and all(f.stat().st_size <= 4096 + len(line.line()) + 1 for f in files)
    assert writer.written == 1000 and writer.dropped_full == 0


class SlowDiskWriter(TraceWriter):
    """A fake slow disk (a real one cannot be made slow on demand): every batch waits for a gate."""

    def __init__(self, *args, **kwargs) -> None:
        self.gate = threading.Event()
        super().__init__(*args, **kwargs)

    def _write(self, lines):
        self.gate.wait(10)
        super()._write(lines)


def test_a_writer_behind_drops_lines_instead_of_waiting(tmp_path):
    writer = SlowDiskWriter(tmp_path, b"salt", queue_lines=10)
    line = TraceTurn(t=1.0, conversation="0" * 16, tenant="1" * 16, turn=0, match="none", miss=None, status=200)
    started = time.monotonic()
    results = [writer.submit(line) for _ in range(100)]
    assert time.monotonic() - started < 1.0  # submit never waited for the disk
    assert results.count(False) == writer.dropped_full >= 80
    writer.gate.set()
    writer.close()
    assert writer.written == results.count(True)


def test_a_vanished_directory_costs_lines_not_the_router(tmp_path):
    target = tmp_path / "trace"
    writer = TraceWriter(target, b"salt")
    line = TraceTurn(t=1.0, conversation="0" * 16, tenant="1" * 16, turn=0, match="none", miss=None, status=200)
    writer.submit(line)
    writer.close()
    writer = TraceWriter(target, b"salt")
    for p in target.iterdir():
        p.unlink()
    target.rmdir()
    target.write_text("now a file: no directory to write into")  # what a failed mount can look like
    for _ in range(5):
        writer.submit(line)
    writer.close()
    assert writer.dropped_error == 5 and writer.written == 0


def test_lineage_names_conversations_under_the_salt_only():
    a, b = TraceLineage(b"salt-a", 100), TraceLineage(b"salt-b", 100)
    assert a.place("t", "id", None, None, 0, "r1")[0] == keyed_hash(b"salt-a", "conversation", "t", "id")
    assert a.place("t", "id", None, None, 0, "r2") == (keyed_hash(b"salt-a", "conversation", "t", "id"), 1)
    assert b.place("t", "id", None, None, 0, "r3")[0] != a.place("t", "id", None, None, 0, "r4")[0]
    assert a.tenant("t") != a.tenant("u")
    # a history turn continues the conversation of the turn stored under the key it looked up first
    conv, index = a.place("t", None, None, "k1", 0, "r5")
    assert a.place("t", None, "k1", "k2", 1, "r6") == (conv, index + 1)
    assert a.place("t", None, "k-unknown", None, 3, "r7")[1] == 3  # first seen mid-way


def test_the_header_names_the_format(tmp_path):
    writer = TraceWriter(tmp_path, b"salt")
    writer.submit(TraceTurn(t=1.0, conversation="0" * 16, tenant="1" * 16, turn=0, match="none", miss=None, status=200))
    writer.close()
    (path,) = tmp_path.glob("*.jsonl")
    header = json.loads(path.read_text().splitlines()[0])
    assert header["format"] == FORMAT and header["version"] == 1 and header["sample_rate"] == 1.0
