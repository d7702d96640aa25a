"""A ``bidikv router --trace-out`` trace (impl/trace/format.py) read back as conversations to replay.

Each conversation (its keyed hash, within its tenant's) becomes one :class:`Conversation` whose turns
arrive when the router saw them (``arrival_s``, seconds from the trace's first arrival) with the prompt
and output lengths vLLM reported. A turn P verified less of than was offered carries that agreement
(``reuse_agreement_tokens``): the history the client resent diverged there from what D held.

What the trace cannot know, and the replay therefore assumes (say so wherever it is printed):

* shared prefixes between conversations (a common system prompt): none (``shared_prefix_tokens`` 0);
* a turn the router served without a vLLM usage (``prompt_tokens`` or ``output_tokens`` null), one that
  failed (``status`` not 200), and the unsampled conversations (``sample_rate`` < 1): left out, and
  counted in :attr:`RouterTraceSummary`;
* where a turn not offered (a miss) would have diverged: it is taken as a faithful continuation.

Input may be one file or a directory of ``trace-*.jsonl`` files (rotated files of one or several
replicas: they join when their headers name the same salt). Bad lines are errors naming the file, line
and field; nothing is skipped silently.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from impl.trace.format import FORMAT, TraceError, TraceTurn, parse_header, parse_turn
from sim.workload.model import Conversation, Turn


@dataclass
class RouterTraceSummary:
    files: int = 0
    turns: int = 0
    conversations: int = 0
    failed: int = 0  # status != 200: not replayed
    without_counts: int = 0  # no prompt or output token count: not replayed
    sample_rates: set[float] = field(default_factory=set)

    def describe(self) -> str:
        rates = ", ".join(f"{r:g}" for r in sorted(self.sample_rates)) or "1"
        return (f"router trace: {self.conversations} conversations, {self.turns} turns from {self.files} file(s) "
                f"(sample rate {rates}); left out: {self.failed} failed turns, {self.without_counts} without "
                "token counts; assumed: no prefix shared between conversations, misses continue faithfully")


def trace_files(path: str | os.PathLike[str]) -> list[Path]:
    p = Path(path)
    files = sorted(p.glob("trace-*.jsonl")) if p.is_dir() else [p]
    if not files:
        raise ValueError(f"{path}: a directory without trace-*.jsonl files")
    return files


def is_router_trace(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` (a file, or a directory of trace files) holds a router trace."""
    p = Path(path)
    if p.is_dir():
        return any(p.glob("trace-*.jsonl"))
    try:
        with open(p, encoding="utf-8") as f:
            first = f.readline()
    except OSError:
        return False
    return f'"format":"{FORMAT}"' in first.replace(" ", "")


def read_turns(path: str | os.PathLike[str], summary: RouterTraceSummary | None = None) -> list[TraceTurn]:
    summary = summary if summary is not None else RouterTraceSummary()
    salts: set[str] = set()
    turns: list[TraceTurn] = []
    for file in trace_files(path):
        summary.files += 1
        with open(file, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                where = f"{file}:{number}"
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise TraceError(f"{where}: not JSON ({e.msg})") from None
                if number == 1:
                    header = parse_header(obj, where)
                    salts.add(header.salt_id)
                    summary.sample_rates.add(header.sample_rate)
                    continue
                turns.append(parse_turn(obj, where))
    if len(salts) > 1:
        raise TraceError(f"{path}: files with different salts ({', '.join(sorted(salts))}): their names cannot be "
                         "joined; replay them apart")
    turns.sort(key=lambda t: t.t)
    return turns


def load_router_trace(path: str | os.PathLike[str], summary: RouterTraceSummary | None = None) -> list[Conversation]:
    summary = summary if summary is not None else RouterTraceSummary()
    turns = read_turns(path, summary)
    if not turns:
        return []
    t0 = turns[0].t
    chains: dict[tuple[str, str], list[TraceTurn]] = {}
    for t in turns:
        if t.status != 200:
            summary.failed += 1
            continue
        if t.prompt_tokens is None or t.output_tokens is None or t.output_tokens < 1 or t.prompt_tokens < 1:
            summary.without_counts += 1
            continue
        chains.setdefault((t.tenant, t.conversation), []).append(t)
    conversations = []
    for (tenant, name), chain in chains.items():
        built = []
        previous_end = None
        for t in chain:
            arrival = t.t - t0
            agreement = t.verified if (t.offered and t.verified is not None and t.verified < t.offered) else None
            built.append(Turn(prompt_tokens=t.prompt_tokens, output_tokens=t.output_tokens,
                              gap_before_s=0.0 if previous_end is None else max(0.0, arrival - previous_end),
                              arrival_s=arrival, reuse_agreement_tokens=agreement))
            previous_end = arrival + (t.finish_s or 0.0)
        conversations.append(Conversation(conversation_id=name, start_s=built[0].arrival_s, turns=tuple(built),
                                          tenant=tenant))
        summary.turns += len(built)
    conversations.sort(key=lambda c: (c.start_s, c.conversation_id))
    summary.conversations = len(conversations)
    return conversations
