"""Prefill on D in the router: a later turn goes whole to the D that holds its conversation, as an ordinary
request with no P leg, when impl.policy.prefill_on_d says so (``--prefill-on-d``).

What the router knows is its store's entry (the D, the tokens it holds, the messages or prompt they
cover), the request (the new messages beyond those), the suffix work it sent each D and has not seen a
first token for, and the prompt tokens it has in flight on each P. It has no tokenizer: the suffix is
bounded from the new messages' UTF-8 bytes (:func:`impl.policy.prefill_on_d.suffix_token_bound`, never
under; a token-id prompt is counted exactly). It does not see D's running sequences or KV use, so those
guards of the policy do not apply here.

D is sent ``kv_transfer_params = {"do_remote_decode": false, "do_remote_prefill": false}``: nothing to pull
(vLLM's NixlConnector loads remote KV only when ``do_remote_prefill`` is set), D's prefix cache supplies
what it holds, and a non-empty params dict makes a bidirectional D keep the finished turn and return its
params as on the P->D path (vllm ``kv_connector/v1/nixl/pull_scheduler.py`` ``request_finished``: a request
with params and no ``do_remote_decode`` is a D-side one, retained for ``decoder_kv_blocks_ttl``).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from impl.policy import ConversationEntry
from impl.policy.prefill_on_d import (
    SUPERSEDES_KEY,
    HoldState,
    PathDecision,
    PathReason,
    PrefillOnD,
    TurnPath,
    TurnSignals,
    suffix_token_bound,
    superseding,
)
from impl.router.request import TurnRequest
from impl.router.upstreams import Upstream, UpstreamPool

ON_D_PARAMS: dict[str, Any] = {"do_remote_decode": False, "do_remote_prefill": False}


def on_d_params(entry: ConversationEntry | None) -> dict[str, Any]:
    """D's kv_transfer_params for a turn served on it whole: nothing to pull, and the retained turn it
    continues (``entry``, taken from the store: no one else can be offered it) to release once it finished
    (:data:`impl.policy.prefill_on_d.SUPERSEDES_KEY`)."""
    params = dict(ON_D_PARAMS)
    supersedes = superseding(entry.kv_params) if entry is not None else None
    if supersedes is not None:
        params[SUPERSEDES_KEY] = supersedes
    return params


# D's running sequences and KV use are not visible to the router: the policy's guards on them never bind
_UNSEEN = 1 << 31


def suffix_bound(turn: TurnRequest, entry: ConversationEntry) -> int:
    """Tokens the request adds beyond what ``entry`` holds, at most (what D would compute)."""
    body = turn.body
    if turn.prompt_kind == "tokens":
        return max(1, len(body["prompt"]) - entry.num_tokens)
    if turn.prompt_kind == "text":
        return suffix_token_bound(len(body["prompt"][entry.held_len:].encode("utf-8", "surrogatepass")), 0)
    messages = body.get("messages") if turn.prompt_kind == "chat" else None
    if not isinstance(messages, list):
        return turn.estimated_tokens
    new = messages[entry.held_len:]  # the held sequence's digest items are its messages, answer included
    size = 0
    for message in new:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            size += len(content.encode("utf-8", "surrogatepass"))
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                if isinstance(text, str):
                    size += len(text.encode("utf-8", "surrogatepass"))
        if isinstance(message, dict) and message.get("tool_calls") is not None:
            size += len(repr(message["tool_calls"]).encode("utf-8", "surrogatepass"))
    return suffix_token_bound(size, len(new))


class OnDRouting:
    """Which later turns go to the D holding them, and the work sent to each D not yet answered."""

    def __init__(self, policy: PrefillOnD, prefill: UpstreamPool, decode: UpstreamPool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock  # the router's clock, the one its store stamps entries with
        self.prefill = prefill
        self._decode = {u.name: u for u in decode}
        self.pending: dict[str, int] = {}  # D -> suffix tokens sent to it whose first token has not come

    def choose(self, turn: TurnRequest, entry: ConversationEntry, *, lapsed: bool = False,
               now: float | None = None) -> tuple[PathDecision, Upstream | None]:
        """The decision for a turn the store offered ``entry`` for, and the D to send it to (None: P).

        ``lapsed``: D gave the entry back (its answer to the renewal before a read): the blocks may still be in
        D's prefix cache. How long ago D freed them the router does not know; it counts the time since it
        stored the entry, which is never less (``prefill_on_d_lapsed_s`` bounds it)."""
        d = self._decode.get(entry.decode_instance)
        suffix = suffix_bound(turn, entry)
        queued = [p.in_flight_tokens for p in self.prefill if p.healthy]
        hold, lapsed_for = HoldState.RETAINED, 0.0
        if lapsed:
            hold = HoldState.LAPSED
            lapsed_for = max(0.0, (self.clock() if now is None else now) - entry.stored_at)
        signals = TurnSignals(entry.num_tokens + suffix, entry.num_tokens, hold, lapsed_for, 0, _UNSEEN, 0,
                              _UNSEEN, self.pending.get(entry.decode_instance, 0), min(queued) if queued else 0)
        decision = self.policy.decide(signals)
        if decision.path is not TurnPath.PREFILL_ON_D:
            return decision, None
        if d is None or not d.healthy:  # the D that holds it is out of rotation: P pulls (or recomputes)
            return PathDecision(TurnPath.PULL_TO_P, PathReason.D_UNAVAILABLE, decision.suffix_tokens), None
        return decision, d

    def sent(self, d: Upstream, tokens: int) -> None:
        self.pending[d.name] = self.pending.get(d.name, 0) + tokens

    def answered(self, d: Upstream, tokens: int) -> None:
        """D's first token came (or the request ended): its suffix is computed."""
        left = self.pending.get(d.name, 0) - tokens
        if left > 0:
            self.pending[d.name] = left
        else:
            self.pending.pop(d.name, None)
