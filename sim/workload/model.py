"""What a workload is: conversations made of turns, independent of where they came from.

A turn's ``prompt_tokens`` is the whole context it sends (history included), as vLLM sees it.
``history_revision`` changes when the client rewrites history (e.g. strips reasoning): the sequence D
holds from an earlier revision no longer prefixes the prompt, so the router's guard must refuse reuse.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Turn:
    prompt_tokens: int  # whole context sent this turn (shared prefix + history + new input)
    output_tokens: int
    # closed loop: think/tool time between the previous turn's completion and this turn's arrival
    gap_before_s: float = 0.0
    # trace replay: the turn's absolute arrival in the trace (it is released at
    # max(arrival_s, previous turn's completion)); None for closed-loop generators
    arrival_s: float | None = None
    history_revision: int = 0
    # the model's output is a tool call: the client (an agent) runs the tool and sends the next turn itself,
    # so it knows it will return; after a turn that answers the user it does not (sim/clients.py)
    tool_call: bool = False


@dataclass(frozen=True, slots=True)
class Conversation:
    conversation_id: str
    start_s: float  # arrival of the first turn
    turns: tuple[Turn, ...]
    shared_prefix_tokens: int = 0  # leading tokens common to all conversations (a system prompt)
    tenant: str = "default"
