"""Mooncake FAST'25 trace replay: requests regrouped into conversations by shared KV blocks.

Trace format (JSONL, one request a line, sorted by time)::

    {"timestamp": ms since start, "input_length": tokens, "output_length": tokens,
     "hash_ids": [one id per 512-token block of the prompt, the last one possibly partial]}

The trace does not label sessions. A request *continues* an earlier one (its parent) when its
``hash_ids`` start with all of that request's *full* blocks (``input_length // 512`` of them); among
several we take the longest, and among equally long the latest (the most recent turn of that
session). ``input_length`` is the whole context the request sends, i.e. ``prompt_tokens``.

With ``min_parent_blocks = 2`` and ties going to the latest, the parent->child links of the
public trace reproduce the published gap statistics exactly (33.0 % continue; p10 42 s, p50 126 s, p90 480 s; 88 %
within 450 s; see :func:`trace_gap_stats`). Why those two:

* ``min_parent_blocks = 2``: every request of the public trace starts with the same block (a system
  prompt), so a one-block match is no evidence of a session; with 1, 99.9 % of requests would
  "continue" something.
* latest among equally long parents: the earliest would tie a request to a session's first turn
  instead of its last one (p50 would read 147 s, and 663 requests would look like branches).

A request that continues a parent which already has a child is a *branch* (a regenerated or edited
turn): it starts a new conversation whose first turn is that request, and later requests continuing
it join that new conversation. A :class:`Conversation` is a chain, and the original line keeps its
first continuation. 43 of the public trace's 3,975 links are branches, so :func:`gap_stats` over
the conversations sees 3,932 continuations, while :func:`trace_gap_stats` counts every link.

Timestamps are quantised to 3 s, so each arrival gets a uniform offset in [0, 3) s from the
caller's rng (order within a quantum is then not an artefact); a child that would land before its
parent is redrawn uniformly between the parent's arrival and the end of its own quantum.

The lookup is a trie over block ids: inserting a request's full blocks and walking a new request's
blocks both cost their length, so the whole rebuild is linear in the trace's total number of blocks.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from impl.bench.stats import percentile
from sim.workload.model import Conversation, Turn

MOONCAKE_BLOCK_TOKENS = 512
MOONCAKE_TIMESTAMP_QUANTUM_S = 3.0
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    line_number: int  # 1-based line in the file, so any later complaint can point at it
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: str | os.PathLike[str], *, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[TraceRequest]:
    """Every request of the trace, validated; ValueError names the line and the field.

    Blank lines are skipped; keys other than the four fields are ignored.
    """
    requests: list[TraceRequest] = []
    with open(path, encoding="utf-8") as trace:
        for line_number, line in enumerate(trace, start=1):
            if not line.strip():
                continue
            request = _parse_line(line, line_number, block_tokens)
            if requests and request.timestamp_ms < requests[-1].timestamp_ms:
                previous = requests[-1]
                raise ValueError(f"{path}: line {line_number}: field 'timestamp' goes back in time "
                                 f"({request.timestamp_ms} ms < {previous.timestamp_ms} ms on line "
                                 f"{previous.line_number}); the trace must be sorted by time")
            requests.append(request)
    return requests


def _parse_line(line: str, line_number: int, block_tokens: int) -> TraceRequest:
    where = f"line {line_number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for field in FIELDS:
        if field not in record:
            raise ValueError(f"{where}: missing field {field!r}")

    def count(field: str, minimum: int) -> int:
        value = record[field]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: field {field!r} must be an integer, got {value!r}")
        if value < minimum:
            raise ValueError(f"{where}: field {field!r} must be >= {minimum}, got {value}")
        return value

    timestamp_ms = count("timestamp", 0)
    input_length = count("input_length", 1)
    output_length = count("output_length", 0)
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list):
        raise ValueError(f"{where}: field 'hash_ids' must be a list of integers, got {type(hash_ids).__name__}")
    for position, block_id in enumerate(hash_ids):
        if isinstance(block_id, bool) or not isinstance(block_id, int):
            raise ValueError(f"{where}: field 'hash_ids'[{position}] must be an integer, got {block_id!r}")
    expected_blocks = -(-input_length // block_tokens)
    if len(hash_ids) != expected_blocks:
        raise ValueError(f"{where}: field 'hash_ids' has {len(hash_ids)} block ids but input_length "
                         f"{input_length} needs {expected_blocks} (one per {block_tokens} tokens)")
    return TraceRequest(line_number, timestamp_ms, input_length, output_length, tuple(hash_ids))


class _FullBlockTrie:
    """Full-block prefixes of earlier requests, each node remembering the latest request ending there."""

    def __init__(self) -> None:
        self._children: list[dict[int, int]] = [{}]  # node -> {block id -> child node}; node 0 is the root
        self._owner: dict[int, int] = {}  # node -> index of the latest request whose full blocks end here

    def insert(self, blocks: Iterable[int], request_index: int) -> None:
        node = 0
        for block_id in blocks:
            child = self._children[node].get(block_id)
            if child is None:
                child = len(self._children)
                self._children.append({})
                self._children[node][block_id] = child
            node = child
        self._owner[node] = request_index

    def deepest_owner(self, blocks: Iterable[int]) -> int | None:
        """The request owning the deepest node on ``blocks``' path: the longest (then latest) parent."""
        node, owner = 0, None
        for block_id in blocks:
            child = self._children[node].get(block_id)
            if child is None:
                break
            node = child
            owner = self._owner.get(node, owner)
        return owner


def find_parents(requests: Sequence[TraceRequest], *, min_parent_blocks: int = 2,
                 block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[int | None]:
    """For each request, the index of the earlier request it continues, or None."""
    if min_parent_blocks < 1:
        raise ValueError(f"min_parent_blocks must be >= 1 (an empty prefix matches everything), "
                         f"got {min_parent_blocks!r}")
    trie = _FullBlockTrie()
    parents: list[int | None] = []
    for index, request in enumerate(requests):
        parents.append(trie.deepest_owner(request.hash_ids))
        full_blocks = request.input_length // block_tokens
        if full_blocks >= min_parent_blocks:
            trie.insert(request.hash_ids[:full_blocks], index)
    return parents


def load_trace(path: str | os.PathLike[str], rng: random.Random, *, min_parent_blocks: int = 2,
               block_tokens: int = MOONCAKE_BLOCK_TOKENS,
               timestamp_quantum_s: float = MOONCAKE_TIMESTAMP_QUANTUM_S) -> list[Conversation]:
    """The trace as conversations, by start time; ``rng`` only jitters arrivals within a quantum.

    Turns carry ``arrival_s`` (absolute, seconds from the trace's time 0) and, informationally,
    ``gap_before_s`` = arrival gap to the parent (0 on a conversation's first turn).
    ``shared_prefix_tokens`` is the full-block prefix every request of the trace starts with.
    """
    requests = read_trace(path, block_tokens=block_tokens)
    return conversations_from_requests(requests, rng, min_parent_blocks=min_parent_blocks,
                                       block_tokens=block_tokens, timestamp_quantum_s=timestamp_quantum_s)


def conversations_from_requests(requests: Sequence[TraceRequest], rng: random.Random, *,
                                min_parent_blocks: int = 2, block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                                timestamp_quantum_s: float = MOONCAKE_TIMESTAMP_QUANTUM_S) -> list[Conversation]:
    """:func:`load_trace` on requests already read (sorted by time)."""
    if not (timestamp_quantum_s >= 0.0 and math.isfinite(timestamp_quantum_s)):
        raise ValueError(f"timestamp_quantum_s must be a finite number >= 0, got {timestamp_quantum_s!r}")
    parents = find_parents(requests, min_parent_blocks=min_parent_blocks, block_tokens=block_tokens)
    arrivals = _jittered_arrivals(requests, parents, rng, timestamp_quantum_s)

    chains: list[list[int]] = []  # request indices of each conversation, in order
    chain_of: list[int] = []  # request index -> its chain
    for index, parent in enumerate(parents):
        if parent is not None and chains[chain_of[parent]][-1] == parent:
            chain = chain_of[parent]
            chains[chain].append(index)
        else:  # no parent, or a branch off a request that already has its continuation
            chain = len(chains)
            chains.append([index])
        chain_of.append(chain)

    shared_prefix = _common_full_block_prefix(requests, block_tokens) * block_tokens if len(chains) > 1 else 0
    conversations = []
    for chain in chains:
        turns = tuple(
            Turn(prompt_tokens=requests[index].input_length, output_tokens=requests[index].output_length,
                 gap_before_s=0.0 if position == 0 else arrivals[index] - arrivals[chain[position - 1]],
                 arrival_s=arrivals[index])
            for position, index in enumerate(chain))
        first = requests[chain[0]]
        conversations.append(Conversation(conversation_id=f"mooncake-line{first.line_number}",
                                          start_s=arrivals[chain[0]], turns=turns,
                                          shared_prefix_tokens=shared_prefix))
    conversations.sort(key=lambda conversation: conversation.start_s)  # stable: ties keep trace order
    return conversations


def _jittered_arrivals(requests: Sequence[TraceRequest], parents: Sequence[int | None], rng: random.Random,
                       quantum_s: float) -> list[float]:
    arrivals: list[float] = []
    for request, parent in zip(requests, parents):
        quantum_start_s = request.timestamp_ms / 1000.0
        arrival_s = quantum_start_s + rng.uniform(0.0, quantum_s)
        if parent is not None and arrival_s < arrivals[parent]:
            # the trace says the parent came first; keep it so, uniformly over what is left
            arrival_s = rng.uniform(arrivals[parent], max(arrivals[parent], quantum_start_s + quantum_s))
        arrivals.append(arrival_s)
    return arrivals


def _common_full_block_prefix(requests: Sequence[TraceRequest], block_tokens: int) -> int:
    """How many leading full blocks every request shares (a trace-wide system prompt)."""
    if not requests:
        return 0
    common = list(requests[0].hash_ids[: requests[0].input_length // block_tokens])
    for request in requests[1:]:
        full = request.hash_ids[: request.input_length // block_tokens]
        length = 0
        while length < min(len(common), len(full)) and common[length] == full[length]:
            length += 1
        del common[length:]
        if not common:
            break
    return len(common)


@dataclass(frozen=True, slots=True)
class GapStats:
    """What to compare with the published trace statistics: share of requests that continue an earlier one, and their gaps."""

    requests: int
    continuations: int
    continuing_fraction: float
    p10_s: float | None  # None when there is no continuation
    p50_s: float | None
    p90_s: float | None
    within_s: float
    fraction_within: float | None  # share of gaps <= within_s


def gap_stats(conversations: Iterable[Conversation], *, within_s: float = 450.0) -> GapStats:
    """Gap statistics over the turns after a conversation's first, read from ``gap_before_s``.

    For a replayed trace that is the parent->child arrival gap within a conversation. A branch
    starts its own conversation, so here it counts as a start, not a continuation; to count every
    parent->child link as those statistics do, use :func:`trace_gap_stats` (in the public trace the two
    differ by the 43 branches: 32.7 % vs 33.0 % continuing, p50 123 s vs 126 s).
    """
    gaps: list[float] = []
    requests = 0
    for conversation in conversations:
        requests += len(conversation.turns)
        gaps.extend(turn.gap_before_s for turn in conversation.turns[1:])
    return _gap_stats(gaps, requests, within_s)


def trace_gap_stats(path: str | os.PathLike[str], rng: random.Random | None = None, *,
                    min_parent_blocks: int = 2, within_s: float = 450.0) -> GapStats:
    """Gap statistics over every parent->child link of the trace, branches included (the published statistics' way).

    Without ``rng`` the gaps are the trace's own timestamps (multiples of the 3 s quantum), so the
    result is exact and reproducible; with it, arrivals are jittered as in :func:`load_trace`.
    """
    requests = read_trace(path)
    return _gap_stats(_link_gaps(requests, rng, min_parent_blocks), len(requests), within_s)


def sample_gaps(path: str | os.PathLike[str], rng: random.Random | None = None, *,
                min_parent_blocks: int = 2) -> list[float]:
    """Every parent->child arrival gap (s) of the trace, branches included, e.g. for ``Empirical``.

    Without ``rng`` the gaps come from the trace's own timestamps; with it, from arrivals jittered
    as in :func:`load_trace`.
    """
    return _link_gaps(read_trace(path), rng, min_parent_blocks)


def _link_gaps(requests: Sequence[TraceRequest], rng: random.Random | None, min_parent_blocks: int) -> list[float]:
    parents = find_parents(requests, min_parent_blocks=min_parent_blocks)
    quantum_s = MOONCAKE_TIMESTAMP_QUANTUM_S if rng is not None else 0.0
    arrivals = _jittered_arrivals(requests, parents, rng if rng is not None else random.Random(0), quantum_s)
    return [arrivals[index] - arrivals[parent] for index, parent in enumerate(parents) if parent is not None]


def _gap_stats(gaps: list[float], requests: int, within_s: float) -> GapStats:
    gaps = sorted(gaps)
    if not gaps:
        return GapStats(requests, 0, 0.0, None, None, None, within_s, None)
    return GapStats(
        requests=requests,
        continuations=len(gaps),
        continuing_fraction=len(gaps) / requests,
        p10_s=percentile(gaps, 10.0),
        p50_s=percentile(gaps, 50.0),
        p90_s=percentile(gaps, 90.0),
        within_s=within_s,
        fraction_within=sum(gap <= within_s for gap in gaps) / len(gaps),
    )
