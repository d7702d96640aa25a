"""What a workload is: conversations made of turns, independent of where they came from.

A turn's ``prompt_tokens`` is the whole context it sends (history included), as vLLM sees it.

What a turn can reuse ends at its first divergence from what D holds: D holds the previous turn's
prompt and output (``prompt + output - 1`` tokens: the last sampled token has no KV yet), and the new
prompt shares a leading part of it, ``reuse_agreement_tokens``: all of it for a faithful continuation,
less when the chat template drops the previous answer's reasoning, when the answer retokenizes
differently near its tail, or when the client edited its history. P verifies token ids
(impl.policy.prefix_check), so this count, not a message-level guard, decides what is pulled.
``history_revision`` names a rewritten history (caches keyed by revision never serve across it); a
revision change that states no agreement shares nothing with what D holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from impl.policy.fastinit import frozen_init


@frozen_init  # built per turn: see impl.policy.fastinit
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
    # so it knows it will return; after a turn that answers the user it does not (sim/clients/renewal.py)
    tool_call: bool = False
    # leading tokens of what D holds from the previous turn (its prompt + output - 1) that this prompt
    # shares; None: a faithful continuation (all of it, up to this prompt's length), or nothing when
    # history_revision changed
    reuse_agreement_tokens: int | None = None


@frozen_init  # one per conversation: see impl.policy.fastinit
@dataclass(frozen=True, slots=True)
class Conversation:
    conversation_id: str
    start_s: float  # arrival of the first turn
    turns: tuple[Turn, ...]
    shared_prefix_tokens: int = 0  # leading tokens common to all conversations (a system prompt)
    tenant: str = "default"


def held_tokens(turn: Turn) -> int:
    """What D holds after ``turn`` finishes: its prompt and every output token but the last (whose KV
    is never computed), as D's ``remote_num_tokens`` says."""
    output = turn.output_tokens - 1
    return turn.prompt_tokens + (output if output > 0 else 0)  # max(), without the builtin call (once per turn)


def agreement(previous: Turn, turn: Turn) -> int:
    """Leading tokens of what D holds after ``previous`` that ``turn``'s prompt shares."""
    held = held_tokens(previous)
    if turn.reuse_agreement_tokens is not None:
        agree = turn.reuse_agreement_tokens
    elif turn.history_revision == previous.history_revision:
        agree = held
    else:
        agree = 0  # a rewritten history with no stated agreement: what the old all-or-nothing guard assumed
    # max(0, min(agree, turn.prompt_tokens, held)), without the builtin calls (once per turn)
    if turn.prompt_tokens < agree:
        agree = turn.prompt_tokens
    if held < agree:
        agree = held
    return agree if agree > 0 else 0


class Lineage:
    """What each prompt of a conversation shares with what its earlier turns left on P and D.

    ``agreement[k]`` (k >= 1) is the longest common prefix of prompt ``k`` and what D held after turn
    ``k - 1``. Further back the common prefix is the minimum along the chain (prompt ``i`` is a prefix
    of what D held after turn ``i``, and a common prefix of two sequences that each share one with a
    third is at least the shorter), a lower bound that is exact unless two divergences fall on the
    same token: the simulator never credits reuse a token-exact check could not find.
    """

    __slots__ = ("prompt_tokens", "agreement")

    def __init__(self, turns: Sequence[Turn]) -> None:
        # list comprehensions, not generators: one per conversation, no generator resume per turn
        self.prompt_tokens = tuple([t.prompt_tokens for t in turns])
        self.agreement = (0, *[agreement(previous, turn) for previous, turn in zip(turns, turns[1:])])

    def held_agreement(self, turn: int, held_turn: int) -> int:
        """Leading tokens of what D held after ``held_turn`` (< ``turn``) that prompt ``turn`` shares."""
        agreements = self.agreement
        if not 0 <= held_turn < turn < len(agreements):
            raise ValueError(f"held turn {held_turn} is not before turn {turn} of {len(agreements)}")
        if held_turn == turn - 1:  # the previous turn (nearly always): the chain is one link long
            return agreements[turn]
        return min(agreements[held_turn + 1:turn + 1])

    def prompt_agreement(self, turn: int, other: int) -> int:
        """Leading tokens of prompt ``other`` (<= ``turn``) that prompt ``turn`` shares."""
        if other == turn:
            return self.prompt_tokens[turn]
        return min(self.held_agreement(turn, other), self.prompt_tokens[other])
