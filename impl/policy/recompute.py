"""Pull-vs-recompute: should a node read reusable KV from a peer, or compute it locally?

vLLM's rule (``kv_recompute_threshold``, NixlConnector, ``bidirectional_kv_xfer``): the node first
applies its own prefix-cache hit, rounded down to a whole block, then counts the remote tokens it
could still reuse::

    count = min(remote_num_tokens, prompt_tokens) - local_hit

Nothing is pulled when ``count <= 0``; otherwise it pulls iff ``count >= threshold`` (strictly below
recomputes) and a threshold of 0 disables the check. Upstream applies it only on the D->P path of
later turns (vLLM #55801); here the same rule serves the ordinary P->D path too, chosen by
:class:`TransferPath`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

from impl.policy.fastinit import frozen_init


class TransferPath(enum.Enum):
    """Direction of the read: the reader is always the node that needs the KV."""

    DECODE_TO_PREFILL = "d_to_p"  # later turn: P reads what D kept from the previous turn
    PREFILL_TO_DECODE = "p_to_d"  # ordinary disaggregation: D reads what P just computed


class DecisionReason(enum.Enum):
    NOTHING_TO_PULL = "nothing_to_pull"  # count <= 0: the local cache already covers it
    THRESHOLD_DISABLED = "threshold_disabled"  # threshold 0: pull whatever there is
    AT_OR_ABOVE_THRESHOLD = "at_or_above_threshold"
    BELOW_THRESHOLD = "below_threshold"
    PULL_CHEAPER = "pull_cheaper"  # break-even: predicted pull < predicted recompute
    RECOMPUTE_CHEAPER = "recompute_cheaper"


@frozen_init  # built per turn: see impl.policy.fastinit
@dataclass(frozen=True, slots=True)
class PullCandidate:
    """What the reading node knows when it decides.

    ``local_hit_tokens`` is the local prefix-cache hit as reported by the cache; it need not be
    block-aligned, the policy aligns it (vLLM only ever reuses whole local blocks).
    """

    prompt_tokens: int
    remote_num_tokens: int
    local_hit_tokens: int
    block_size: int
    path: TransferPath = TransferPath.DECODE_TO_PREFILL

    def __post_init__(self) -> None:
        # built once per request (per turn in the simulator): the fields are named in the loop only on failure
        if self.prompt_tokens < 0 or self.remote_num_tokens < 0 or self.local_hit_tokens < 0:
            for name in ("prompt_tokens", "remote_num_tokens", "local_hit_tokens"):
                if getattr(self, name) < 0:
                    raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")

    @property
    def aligned_local_hit(self) -> int:
        return (self.local_hit_tokens // self.block_size) * self.block_size

    @property
    def reusable_tokens(self) -> int:
        """vLLM's ``count``; negative means the local cache covers more than the peer holds."""
        # aligned_local_hit and min() inline: read on every request (a property and a builtin call less)
        block, remote, prompt = self.block_size, self.remote_num_tokens, self.prompt_tokens
        return (prompt if prompt < remote else remote) - self.local_hit_tokens // block * block

    def peer_block_span(self, tokens: int) -> tuple[int, int]:
        """``(first, stop)``: indices of the peer's blocks that hold the ``tokens`` pulled after the local hit.

        The reader fills positions ``aligned_local_hit .. aligned_local_hit + tokens`` of its prompt,
        and the peer's block ``i`` holds positions ``i*block_size .. (i+1)*block_size``, counted from
        the start of the peer's sequence. So the peer's blocks ``first .. stop`` are the ones to read,
        and blocks from ``stop`` on are never read -- in particular not the peer's *last* blocks when
        the prompt is shorter than what the peer holds (they hold later positions).
        """
        if tokens < 0 or self.aligned_local_hit + tokens > min(self.remote_num_tokens, self.prompt_tokens):
            raise ValueError(f"cannot pull {tokens} tokens after a local hit of {self.aligned_local_hit} "
                             f"(peer holds {self.remote_num_tokens}, prompt has {self.prompt_tokens})")
        first = self.aligned_local_hit // self.block_size
        stop = -(-(self.aligned_local_hit + tokens) // self.block_size)
        return first, stop


@frozen_init  # built per turn: see impl.policy.fastinit
@dataclass(frozen=True, slots=True)
class RecomputeDecision:
    """The choice, the tokens it concerns and why (carried into metrics and simulator traces)."""

    pull: bool
    tokens: int  # tokens that are pulled if ``pull``, else the tokens that will be recomputed instead
    reason: DecisionReason
    predicted_pull_s: float | None = None
    predicted_recompute_s: float | None = None


@runtime_checkable
class KVCostModel(Protocol):
    """Predicted costs a break-even decision compares; calibration profiles implement it."""

    def pull_time_s(self, tokens: int, blocks: int) -> float:
        """Time to read ``tokens`` of KV held in ``blocks`` descriptors from a peer."""
        ...

    def recompute_time_s(self, tokens: int, cached_context_tokens: int) -> float:
        """Time to compute ``tokens`` new tokens on top of ``cached_context_tokens`` already cached."""
        ...


class RecomputePolicy(Protocol):
    def decide(self, candidate: PullCandidate) -> RecomputeDecision: ...


_NOTHING_TO_PULL = RecomputeDecision(False, 0, DecisionReason.NOTHING_TO_PULL)  # frozen: one serves every request
# the members the policies below return, read once: on CPython 3.11 reading a member off its class goes
# through EnumType's __getattr__ hook (~150 ns), and a decision is made per request
_THRESHOLD_DISABLED = DecisionReason.THRESHOLD_DISABLED
_AT_OR_ABOVE_THRESHOLD = DecisionReason.AT_OR_ABOVE_THRESHOLD
_BELOW_THRESHOLD = DecisionReason.BELOW_THRESHOLD
_PULL_CHEAPER = DecisionReason.PULL_CHEAPER
_RECOMPUTE_CHEAPER = DecisionReason.RECOMPUTE_CHEAPER


@dataclass(frozen=True, slots=True)
class FixedThreshold:
    """vLLM's ``kv_recompute_threshold`` (default 64 tokens), usable on either path."""

    tokens: int = 64

    def __post_init__(self) -> None:
        if self.tokens < 0:
            raise ValueError(f"kv_recompute_threshold must be >= 0, got {self.tokens}")

    def decide(self, candidate: PullCandidate) -> RecomputeDecision:
        count = candidate.reusable_tokens
        if count <= 0:
            return _NOTHING_TO_PULL
        if self.tokens == 0:
            return RecomputeDecision(True, count, _THRESHOLD_DISABLED)
        if count >= self.tokens:
            return RecomputeDecision(True, count, _AT_OR_ABOVE_THRESHOLD)
        return RecomputeDecision(False, count, _BELOW_THRESHOLD)


@dataclass(frozen=True, slots=True)
class BreakEvenThreshold:
    """Pull iff the predicted pull is faster than recomputing the same tokens.

    The recompute is priced on top of the aligned local hit (the context that is cached anyway),
    since attention over a longer cached context makes each recomputed token dearer.
    """

    cost_model: KVCostModel

    def decide(self, candidate: PullCandidate) -> RecomputeDecision:
        count = candidate.reusable_tokens
        if count <= 0:
            return _NOTHING_TO_PULL
        blocks = -(-count // candidate.block_size)
        return cheaper(count, self.cost_model.pull_time_s(count, blocks),
                       self.cost_model.recompute_time_s(count, candidate.aligned_local_hit))

    def break_even_tokens(self, block_size: int, cached_context_tokens: int = 0, limit: int = 1 << 20) -> int | None:
        """Smallest token count for which pulling wins, or None if it never does below ``limit``.

        Assumes the pull/recompute gap is monotone in tokens (true for the affine cost models
        calibration ships); a binary search keeps it cheap.
        """

        def wins(n: int) -> bool:
            blocks = -(-n // block_size)
            return self.cost_model.pull_time_s(n, blocks) < self.cost_model.recompute_time_s(n, cached_context_tokens)

        return smallest_winning(wins, limit)


def cheaper(count: int, pull_s: float, recompute_s: float) -> RecomputeDecision:
    """The break-even rule, whatever the tier: pull ``count`` tokens iff the predicted pull (``pull_s``) is
    faster than recomputing them (``recompute_s``); the decision carries both predictions."""
    pull = pull_s < recompute_s
    return RecomputeDecision(pull, count, _PULL_CHEAPER if pull else _RECOMPUTE_CHEAPER, pull_s, recompute_s)


def smallest_winning(wins: Callable[[int], bool], limit: int) -> int | None:
    """Smallest n in 1..``limit`` with ``wins(n)``, or None if even ``limit`` does not win; ``wins`` is
    monotone (false up to some n, true from there), so a binary search finds it."""
    if not wins(limit):
        return None
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi) // 2
        if wins(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
