"""The router's side of D's host tier: where a turn D no longer holds in HBM may still be, and the stamp.

When a conversation's HBM entry is gone (D gave it back, its hold expired, the store forgot it) but the
D that served the previous turn runs vLLM's host tier (impl/connector/two_tier.py), the router asks P
to pull from that tier by adding to P's ``kv_transfer_params``::

    "remote_kv_source": {"kv_request_id": <this turn's id>, "remote_host": <D's host>, "remote_port": <D's P2P port>}

These are the identifiers vLLM's P2P tier reads (``vllm/v1/kv_offload/tiering/p2p/manager.py``,
``_parse_source``: a ``remote_kv_source`` sub-dict with a non-empty ``kv_request_id`` and both
``remote_host`` and ``remote_port``, else ignored; ``peer_id = f"{remote_host}:{remote_port}"`` is the
peer's ZMQ control address, ``kv_request_id`` correlates this request's probe and fetch on the
session). P's P2P tier then probes D for the prompt's block hashes beyond P's own prefix-cache hit
and pulls what D's tier holds; what it does not hold P computes. ``remote_port`` is D's configured
P2P port; vLLM adds D's data-parallel index to it (DP=1 here: the index is 0).

What D's tier still holds is estimated (impl.policy.host_residency): per D, the router counts the
tokens it sent there since each turn (a conversation's next turn on the same D counts only its
growth: the shared prefix is stored once), and a D that went down since the turn (health probes or a
refused connection) may have restarted with an empty tier. Whether to ask is host_residency's
likelihood rule, then impl.policy.host_tier's minimum (``min_cached_token_delta``, as llm-d's router).
Which tier served the turn is told after P answers: P's ``usage.prompt_tokens_details.cached_tokens``
above what P's own prefix cache could have held (the tokens P last prefilled for the conversation, if
the same P) means the pull landed; P's /metrics say it exactly
(``vllm:prompt_tokens_by_source_total``, CacheHitSource.P2P).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from impl.policy import PullCandidate
from impl.policy.host_residency import HostSpan, host_hit_likelihood, worth_asking
from impl.policy.host_tier import HostPullMinimum
from impl.router.metrics import Counter, RouterMetrics
from impl.router.upstreams import Upstream

REMOTE_KV_SOURCE = "remote_kv_source"  # vLLM's key (tiering/p2p/manager.py _remote_kv_source_params)
# turn tiers, as headers, trace and metrics name them
TIER_HBM, TIER_HOST, TIER_NONE = "hbm", "host", "none"
_BLOCK = 1  # the router does not know the engines' block size; the minimum is far above one block anyway


@dataclass(slots=True)
class _Span:
    decode: str  # D's upstream name
    host: str  # D's host, as the router reaches it (the P2P tier binds the same host)
    tokens: int
    taken_in_at: int  # D's running count of tokens taken in, when this span was stored
    downs_at: int  # how many times D had gone down, when this span was stored


@dataclass(frozen=True, slots=True)
class HostOffer:
    """A span D's host tier may still hold, and the router's estimate that it does."""

    decode: str
    host: str
    tokens: int
    likelihood: float
    gone: str | None = None  # known not held: "restarted" (D went down since), "too_large" (never fit)


class HostTierRouter:
    """Per D, tokens its host tier took in; per conversation key, its latest span; the stamp and its metrics."""

    def __init__(self, capacity_tokens: int, p2p_port: int, min_cached_token_delta: int, max_entries: int,
                 metrics: RouterMetrics) -> None:
        if capacity_tokens < 1:
            raise ValueError(f"host tier capacity must be >= 1 token, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self.p2p_port = p2p_port
        self.minimum = HostPullMinimum(min_cached_token_delta)
        self.max_entries = max_entries
        self._taken_in: dict[str, int] = {}
        self._decode: dict[str, Upstream] = {}  # name -> D, for its down count
        self._spans: collections.OrderedDict[tuple[str, str], _Span] = collections.OrderedDict()
        p = "bidikv_router_"
        self.asks = metrics.registry.add(Counter(
            p + "host_tier_asks_total", "Turns D no longer held in HBM whose previous turn went through a D with a host "
            "tier, by the router's decision: asked (P got remote_kv_source), restarted (D went down since: its tier is "
            "empty), too_large (the span never fit the tier), evicted (estimated evicted: impl.policy.host_residency), below_minimum (too few tokens beyond P's own hit), prefill_error (P failed "
            "with the stamp; retried without).", ("decision",)))
        self.tiers = metrics.registry.add(Counter(
            p + "turns_by_tier_total", "Turns by the tier their previous turn's KV came from: hbm (D's retained blocks "
            "offered), host (P pulled from D's host tier: it reported more cached tokens than its own prefix cache "
            "could hold), host_miss (asked, nothing landed: P recomputed), none.", ("tier",)))

    # -- what D's tier took in ---------------------------------------------------------------------
    def turn_finished(self, looked_up: tuple[str, str] | None, stored: tuple[str, str] | None, upstream: Upstream,
                      tokens: int) -> None:
        """D finished a turn holding ``tokens`` tokens of KV (prompt and answer: D runs offload_prompt_only
        false), so its host tier took them in. ``looked_up``: the key of the conversation's previous turn,
        whose span on the same D shares this one's prefix keys (stored once: only the growth counts);
        ``stored``: the key the next turn will look this one up under (None: not reusable)."""
        if tokens <= 0:
            return
        decode = upstream.name
        self._decode[decode] = upstream
        previous = self._spans.pop(looked_up, None) if looked_up is not None else None
        same = previous is not None and previous.decode == decode and previous.downs_at == upstream.downs
        grown = tokens - previous.tokens if same else tokens
        if tokens <= self.capacity_tokens:  # a span larger than the tier is never stored (prepare_store)
            self._taken_in[decode] = self._taken_in.get(decode, 0) + max(grown, 0)
        if stored is not None:
            self._spans[stored] = _Span(decode, upstream.host, tokens, self._taken_in.get(decode, 0), upstream.downs)
            self._spans.move_to_end(stored)
            while len(self._spans) > self.max_entries:
                self._spans.popitem(last=False)

    # -- the offer and the stamp ---------------------------------------------------------------------
    def offer(self, key: tuple[str, str] | None) -> HostOffer | None:
        """The span of ``key``'s previous turn and the likelihood that D's tier still holds it."""
        span = self._spans.get(key) if key is not None else None
        if span is None:
            return None
        since = self._taken_in.get(span.decode, 0) - span.taken_in_at
        same = self._decode[span.decode].downs == span.downs_at
        residency = HostSpan(span_tokens=span.tokens, taken_in_since=max(since, 0), capacity_tokens=self.capacity_tokens,
                             same_incarnation=same)
        gone = "restarted" if not same else "too_large" if span.tokens > self.capacity_tokens else None
        return HostOffer(span.decode, span.host, span.tokens, host_hit_likelihood(residency), gone)

    def decide(self, offer: HostOffer) -> str:
        """``asked``, or why not (the metric's label): what is known gone, the likelihood rule, then the
        minimum on the span. The span is a prefix of the new prompt (the key matched), and the router
        does not know P's own prefix cache (a P may run without one), so the minimum counts the whole
        span: P's P2P lookup starts after P's actual hit anyway, so a stamp never pulls what P holds."""
        if offer.gone is not None:
            return offer.gone
        if not worth_asking(offer.likelihood):
            return "evicted"
        candidate = PullCandidate(prompt_tokens=offer.tokens, remote_num_tokens=offer.tokens, local_hit_tokens=0,
                                  block_size=_BLOCK)
        return "asked" if self.minimum.decide(candidate).pull else "below_minimum"

    def ask(self, offer: HostOffer, kv_request_id: str) -> dict[str, Any] | None:
        """The ``remote_kv_source`` sub-dict for P's request (module docstring), or None; counted."""
        decision = self.decide(offer)
        self.asks.inc(decision)
        if decision != "asked":
            return None
        return {"kv_request_id": kv_request_id, "remote_host": offer.host, "remote_port": self.p2p_port}

    def prefill_failed(self) -> None:
        self.asks.inc("prefill_error")

    def account(self, info: dict[str, str], hbm: bool, host_local_tokens: int | None, cached_tokens: int | None) -> None:
        """Which tier the turn's reused KV came from: the X-Bidikv-Reuse-Tier header and the metric."""
        if hbm:
            tier = TIER_HBM
        elif host_local_tokens is not None:
            tier = TIER_HOST if served_by_host(cached_tokens, host_local_tokens) else "host_miss"
        else:
            tier = TIER_NONE
        self.tiers.inc(tier)
        info["X-Bidikv-Reuse-Tier"] = tier


def served_by_host(cached_tokens: int | None, local_hit_tokens: int) -> bool:
    """Whether P's reported cached tokens exceed what its own prefix cache could have held: the pull landed."""
    return cached_tokens is not None and cached_tokens > local_hit_tokens


__all__ = ["HostOffer", "HostTierRouter", "REMOTE_KV_SOURCE", "TIER_HBM", "TIER_HOST", "TIER_NONE", "served_by_host"]
