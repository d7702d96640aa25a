"""``bidikv trace``: the router's trace (impl/trace/format.py) to and from the Mooncake trace format.

Mooncake (https://github.com/kvcache-ai/Mooncake/tree/main/FAST25-release/traces) has, per request, a
timestamp in ms, the input and output lengths and ``hash_ids``: one id per 512-token block of the prompt,
equal ids for equal prefixes. To Mooncake: each conversation's blocks get fresh ids, and a turn's prompt
repeats the ids of the blocks it shares with what the previous turn left (its prompt and output, up to
where P verified it diverged), so Mooncake's own parent search finds the conversation again -- for
prompts of at least two blocks (``min_parent_blocks``, 1,024 tokens): shorter conversations come back
as separate requests, and so does a turn that diverged from the previous one (Mooncake continues a
request only from one whose whole prompt it starts with; its shared blocks still say what it reuses),
limits of the format. From Mooncake: conversations as :mod:`sim.workload.mooncake`
finds them, each turn a trace line with what Mooncake holds (arrival, lengths) and nothing else (no
reuse, no latencies: those fields are null or 0).
"""

from __future__ import annotations

import json
import os
import random

from impl.trace.format import TraceHeader, TraceTurn, keyed_hash, salt_id
from sim.workload.model import Conversation, agreement
from sim.workload.mooncake import MOONCAKE_BLOCK_TOKENS

_FROM_MOONCAKE_SALT = b"bidikv: converted from a Mooncake trace"


def to_mooncake(conversations: list[Conversation], out: str | os.PathLike[str],
                block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> int:
    """Write ``conversations`` (e.g. a router trace's) as a Mooncake JSONL trace; returns the requests written."""
    next_id = 0
    rows = []
    for conv in conversations:
        held_ids: list[int] = []
        previous = None
        for turn in conv.turns:
            shared = agreement(previous, turn) if previous is not None else 0
            keep = min(shared // block_tokens, len(held_ids))
            ids = held_ids[:keep]
            while len(ids) * block_tokens < turn.prompt_tokens:
                ids.append(next_id)
                next_id += 1
            # what D holds after this turn: the prompt's full blocks (its last partial one is new with
            # the output), then fresh ids for the rest
            held_ids = ids[:turn.prompt_tokens // block_tokens]
            while len(held_ids) * block_tokens < turn.prompt_tokens + turn.output_tokens:
                held_ids.append(next_id)
                next_id += 1
            arrival = turn.arrival_s if turn.arrival_s is not None else conv.start_s
            rows.append((round(arrival * 1000), turn.prompt_tokens, turn.output_tokens, ids))
            previous = turn
    rows.sort(key=lambda r: r[0])
    with open(out, "w", encoding="utf-8") as f:
        for ts, prompt, output, ids in rows:
            f.write(json.dumps({"timestamp": ts, "input_length": prompt, "output_length": output, "hash_ids": ids},
                               separators=(",", ":")) + "\n")
    return len(rows)


def from_mooncake(path: str | os.PathLike[str], out: str | os.PathLike[str], started_at: float = 0.0) -> int:
    """Write a Mooncake trace as a router trace (one file with its header); returns the turns written."""
    from sim.workload.mooncake import load_trace

    conversations = load_trace(path, random.Random(0), )
    tenant = keyed_hash(_FROM_MOONCAKE_SALT, "tenant", "default")
    turns = []
    for conv in conversations:
        name = keyed_hash(_FROM_MOONCAKE_SALT, "conversation", conv.conversation_id)
        for index, turn in enumerate(conv.turns):
            arrival = turn.arrival_s if turn.arrival_s is not None else conv.start_s
            turns.append(TraceTurn(t=round(started_at + arrival, 6), conversation=name, tenant=tenant, turn=index,
                                   match="history", miss=None, status=200, prompt_tokens=turn.prompt_tokens,
                                   output_tokens=turn.output_tokens))
    turns.sort(key=lambda t: t.t)
    with open(out, "w", encoding="utf-8") as f:
        f.write(TraceHeader(started_at=started_at, salt_id=salt_id(_FROM_MOONCAKE_SALT), sample_rate=1.0,
                            router="converted from Mooncake").line() + "\n")
        for t in turns:
            f.write(t.line() + "\n")
    return len(turns)
