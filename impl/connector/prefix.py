"""The connector's side of token-exact reuse (:mod:`impl.policy.prefix_check`) on vLLM's requests.

vLLM already keeps a chained hash per block of every request (``Request.block_hashes``: each covers
its parent, the block's token ids and extra keys such as ``cache_salt``), computed when prefix
caching is on *or a KV connector is configured*, so also on a P without prefix caching, and
extended as generated tokens fill blocks. Publishing and verifying checkpoints therefore costs a
few dozen short hashes per request, not a pass over the tokens.

Two nodes' hashes are comparable only if they use the same algorithm, seed (``NONE_HASH``: fixed
for sha256 unless ``PYTHONHASHSEED`` is set, random per process for xxhash), hash block size and
model; all four go into the scheme tag, so incomparable peers disagree (reason ``scheme``) instead of
agreeing by accident. The scheme is read lazily: vLLM initialises ``NONE_HASH`` after it builds the
scheduler, i.e. after this connector.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from impl.policy.prefix_check import (CHECK_KEY, PrefixVerification, VerifyReason, publish, scheme_tag,
                                      verify_prefix)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("bidikv.connector")


def hash_block_size_of(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", fallback: int) -> int:
    """The granularity of ``Request.block_hashes`` (vLLM resolves it next to the scheduler's block size)."""
    try:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    except ImportError:  # a vLLM without it hashes at the scheduler's block size
        return fallback
    try:
        return int(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1])
    except Exception as e:  # a config this vLLM cannot resolve here: verification then disagrees, safely
        log.warning("bidikv: cannot resolve vLLM's hash block size (%s); assuming %d", e, fallback)
        return fallback


@dataclass(frozen=True, slots=True)
class ReuseReport:
    """What the reader of a request offered, verified and pulled: counted, and returned to the router."""

    path: str
    offered: int  # tokens the peer offered beyond the local hit: min(peer's, prompt) - local hit
    verified: int  # of those, tokens whose ids are verified equal to the prompt's
    pulled: int
    reason: str  # the verification's outcome (impl.policy.prefix_check.VerifyReason, or "unverified")

    def as_params(self) -> dict[str, Any]:
        return {"path": self.path, "offered": self.offered, "verified": self.verified, "pulled": self.pulled,
                "reason": self.reason}


class PrefixChecker:
    """Publishes the checkpoints of what a node holds and verifies a peer's against a prompt."""

    def __init__(self, vllm_config: "VllmConfig", hash_block_size: int) -> None:
        self.hash_block_size = hash_block_size
        self._model = str(getattr(vllm_config.model_config, "served_model_name", None)
                          or vllm_config.model_config.model)
        self._algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
        self._scheme: str | None = None

    @property
    def scheme(self) -> str:
        if self._scheme is None:
            from vllm.v1.core import kv_cache_utils

            none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
            self._scheme = scheme_tag(self._algo, self.hash_block_size, self._model,
                                      bytes(none_hash) if none_hash is not None else b"uninitialised")
        return self._scheme

    def publish(self, request: "Request", num_tokens: int, anchor_tokens: tuple[int, ...] = ()) -> dict[str, Any] | None:
        """The checkpoints of the first ``num_tokens`` tokens of ``request`` (whose KV this node holds)."""
        chain = request.block_hashes
        if not chain and num_tokens >= self.hash_block_size:
            return None  # no hasher in this engine: nothing to publish, readers refuse (no_check)
        return publish(chain, request.all_token_ids, num_tokens, scheme=self.scheme,
                       block_size=self.hash_block_size, anchor_tokens=anchor_tokens)

    def verify(self, request: "Request", params: dict[str, Any]) -> PrefixVerification:
        prompt = request.prompt_token_ids or []
        return verify_prefix(params.get(CHECK_KEY), request.block_hashes, prompt, scheme=self.scheme,
                             block_size=self.hash_block_size)


def report_of(path: str, offered: int, verification: PrefixVerification | None, verified: int,
              pulled: int) -> ReuseReport:
    reason = "unverified" if verification is None else verification.reason.value
    return ReuseReport(path, max(0, offered), max(0, verified), max(0, pulled), reason)


__all__ = ["CHECK_KEY", "PrefixChecker", "ReuseReport", "VerifyReason", "hash_block_size_of", "report_of"]
