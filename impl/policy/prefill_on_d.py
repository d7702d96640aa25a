"""Where a later turn's prompt is computed: pulled to P, prefilled on the D that holds the conversation, or
recomputed on P.

A later turn's history already sits on the D that served the previous turn (retained, or still in D's
prefix cache after the retention lapsed, until vLLM's free queue reuses the blocks). Sending the whole
request to that D as an ordinary request makes D compute only the new suffix between its decode steps: no
KV crosses the network and P is not involved, but D's other sequences wait for the suffix's compute in
the steps that carry it (their time per output token rises). Sending it to P instead either pulls the
held KV (D->P) or recomputes it; which of the two is P's decision (:mod:`impl.policy.recompute`), made on
the token ids it verified, so the router only predicts it.

The rules are those of NVIDIA Dynamo's conditional disaggregation (router flag
``--router-conditional-disagg-policy``; https://github.com/ai-dynamo/dynamo/pull/11357, design
https://github.com/ai-dynamo/dynamo/issues/11514), restated for a router that knows what D holds from its
conversation store rather than from D's KV events:

* ``isl_bounding`` -- the suffix D would compute ("effective ISL": the prompt less what D holds) is below an
  absolute bound (Dynamo's ``eff_isl_threshold``, default 2048 tokens) and below a share of the prompt
  (``eff_isl_ratio_threshold``, default 0.7);
* ``prefill_load`` -- P is busy (Dynamo: the chosen prefill worker is over its busy threshold; here P's
  queued prefill tokens);
* ``isl_or_load`` -- either.

Dynamo's optional decode-busy guard (no bypass while the chosen decode worker is over a share of its KV
capacity) and a cap on the prefill work a decode worker has already taken on apply to every policy here:
D full (no free sequence slot, or its KV use at or above ``d_busy_fraction``) or D already committed to
``d_pending_tokens`` of suffix work sends the turn to P. The PPD paper (Li et al., "Not All Prefills Are
Equal: PPD Disaggregation for Multi-turn LLM Serving", https://arxiv.org/abs/2603.13358) makes the same
choice per turn from a weighted score of the TTFT gained against the TPOT lost; the thresholds here are
that trade-off's knobs, and the simulator (``bidikv simulate --prefill-on-d ...``) prices both sides.

What the router cannot know for certain, and what a wrong guess costs:

* whether D still holds the history. A stored, unexpired entry means D retains it (unless D gave it back
  under pressure since, which the router learns only when it asks). After the entry's expiry, or a
  give-back, the blocks stay in D's prefix cache until the free queue reuses them: ``lapsed_s`` says how
  long after the lapse the router still counts on that (default 0: never). If D no longer holds them, the
  request is still served correctly (vLLM's prefix cache is keyed by chained block hashes: a miss
  recomputes, it never reuses wrong KV), but D computes the whole prompt, and its other sequences pay for
  that prompt's compute rather than a suffix's;
* the suffix's length, when the router has no tokenizer: :func:`suffix_token_bound` bounds it from the new
  messages' UTF-8 bytes. A byte-level BPE token covers at least one byte, so the bound never undercounts
  (a turn never lands on D with more work than the thresholds allow); it overcounts by the tokenizer's
  bytes per token (~1.8 for the tests' 512-token BPE on English, measured in
  tests/policy/test_prefill_on_d.py; around 4 for a large-vocabulary tokenizer, an assumption): turns that
  would have qualified go to P. The cost of that error is the reuse forgone, never D's TPOT.

Pure: standard library only, ``now`` is not needed (the caller states how long ago a hold lapsed).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from impl.policy.recompute import PullCandidate, RecomputePolicy, TransferPath

POLICIES = ("off", "isl_bounding", "prefill_load", "isl_or_load")

# The key of a turn's kv_transfer_params, sent to the D it is served on whole, naming the retained turn it
# continues ({"request_id": D's id of it, "engine_id": D's engine}): once the turn finished, D releases
# that one instead of pinning it to its TTL. Nothing can read it any more: the router's store hands an
# entry out once (the turn took it), and the turn's own retained blocks cover what the two share.
SUPERSEDES_KEY = "bidikv_supersedes"
_MAX_ID_LEN = 512


class TurnPath(enum.Enum):
    """The three ways a later turn is served."""

    PULL_TO_P = "pull_to_p"  # P pulls D's KV (D->P), computes the suffix, hands off to a D
    PREFILL_ON_D = "prefill_on_d"  # the whole request goes to the D holding the conversation
    RECOMPUTE_ON_P = "recompute_on_p"  # P computes the whole prompt (nothing worth pulling)


class HoldState(enum.Enum):
    """What the router knows of D's copy of the conversation."""

    NONE = "none"  # no D is known to hold it
    RETAINED = "retained"  # a stored entry, unexpired: D pins the blocks (unless it gave them back since)
    LAPSED = "lapsed"  # the entry expired or was given back: maybe still in D's prefix cache


class PathReason(enum.Enum):
    OFF = "off"
    NOTHING_HELD = "nothing_held"  # no D known to hold any of the prompt
    LAPSED_TOO_LONG = "lapsed_too_long"  # the hold lapsed longer ago than lapsed_s
    D_FULL = "d_full"  # D has no free sequence slot, or its KV use is at the busy line
    D_PREFILL_BUSY = "d_prefill_busy"  # D already took on d_pending_tokens of suffix work
    D_UNAVAILABLE = "d_unavailable"  # the D that holds it is out of rotation, or failed before answering
    SHORT_SUFFIX = "short_suffix"  # isl_bounding: the suffix is short in tokens and as a share
    SUFFIX_TOO_LONG = "suffix_too_long"  # isl_bounding: at or above suffix_tokens
    SUFFIX_SHARE_TOO_HIGH = "suffix_share_too_high"  # isl_bounding: at or above suffix_ratio of the prompt
    P_BUSY = "p_busy"  # prefill_load: P's queue is at or above p_busy_tokens
    P_NOT_BUSY = "p_not_busy"  # prefill_load: it is not


@dataclass(frozen=True, slots=True)
class TurnSignals:
    """What the router knows when a later turn arrives.

    ``held_tokens``: leading tokens of the prompt the router believes D holds (the stored entry's
    ``remote_num_tokens``, at most the prompt). ``prompt_tokens``: the prompt's length, or an upper bound
    of it when the router has no tokenizer (held + :func:`suffix_token_bound`). ``lapsed_for_s``: how long
    ago the hold lapsed (LAPSED only). D's load: running sequences against ``d_max_running``, KV blocks in
    use (running and arriving) against ``d_total_blocks``, suffix tokens it was sent to compute and has not
    finished (``d_pending_tokens``). ``p_queued_tokens``: prefill tokens queued on the P the turn would go
    to."""

    prompt_tokens: int
    held_tokens: int
    hold: HoldState
    lapsed_for_s: float = 0.0
    d_running: int = 0
    d_max_running: int = 1
    d_used_blocks: int = 0
    d_total_blocks: int = 1
    d_pending_tokens: int = 0
    p_queued_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "held_tokens", "d_running", "d_used_blocks", "d_pending_tokens",
                     "p_queued_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("d_max_running", "d_total_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lapsed_for_s >= 0:
            raise ValueError(f"lapsed_for_s must be >= 0, got {self.lapsed_for_s}")

    @property
    def usable_held(self) -> int:
        """What D's cache can serve: vLLM computes at least the prompt's last token."""
        return max(0, min(self.held_tokens, self.prompt_tokens - 1))

    @property
    def suffix_tokens(self) -> int:
        """Tokens D would compute (Dynamo's effective ISL)."""
        return self.prompt_tokens - self.usable_held


@dataclass(frozen=True, slots=True)
class PathDecision:
    path: TurnPath
    reason: PathReason
    suffix_tokens: int  # what D would compute (PREFILL_ON_D: what it is sent to compute)


@dataclass(frozen=True, slots=True)
class PrefillOnD:
    """The per-turn choice. ``policy`` is one of :data:`POLICIES` ("off": every turn goes to P).

    Defaults: ``suffix_tokens`` 2048 and ``suffix_ratio`` 0.7 are Dynamo's ``eff_isl_threshold`` and
    ``eff_isl_ratio_threshold`` defaults (PR #11357's router-configuration page); ``p_busy_tokens`` (Dynamo
    leaves its busy threshold unset) is two steps of vLLM's default 8192-token prefill budget;
    ``d_pending_tokens`` is one such step; ``d_busy_fraction`` 1.0 declines only a full D."""

    policy: str = "off"
    suffix_tokens: int = 2048
    suffix_ratio: float = 0.7
    p_busy_tokens: int = 16384
    d_pending_tokens: int = 8192
    d_busy_fraction: float = 1.0
    lapsed_s: float = 0.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.suffix_tokens < 1:
            raise ValueError(f"suffix_tokens must be >= 1, got {self.suffix_tokens}")
        if not 0.0 < self.suffix_ratio <= 1.0:
            raise ValueError(f"suffix_ratio must be in (0, 1], got {self.suffix_ratio}")
        if self.p_busy_tokens < 0:
            raise ValueError(f"p_busy_tokens must be >= 0, got {self.p_busy_tokens}")
        if self.d_pending_tokens < 1:
            raise ValueError(f"d_pending_tokens must be >= 1, got {self.d_pending_tokens}")
        if not 0.0 < self.d_busy_fraction <= 1.0:
            raise ValueError(f"d_busy_fraction must be in (0, 1], got {self.d_busy_fraction}")
        if not 0.0 <= self.lapsed_s < float("inf"):
            raise ValueError(f"lapsed_s must be finite and >= 0, got {self.lapsed_s}")

    @property
    def enabled(self) -> bool:
        return self.policy != "off"

    def decide(self, s: TurnSignals, p_policy: RecomputePolicy | None = None, block_size: int = 1) -> PathDecision:
        """The path for one turn. Sent to P, the path is P's predicted choice (``p_policy`` deciding on
        what D holds, as offered, with no local hit on P; without it, a turn with a retained hold is
        predicted to pull)."""
        suffix = s.suffix_tokens
        reason = self._on_d_reason(s, suffix)
        if reason is None:
            return PathDecision(TurnPath.PREFILL_ON_D, self._arm_reason(s, suffix), suffix)
        return PathDecision(self._p_path(s, p_policy, block_size), reason, suffix)

    def _on_d_reason(self, s: TurnSignals, suffix: int) -> PathReason | None:
        """Why the turn goes to P, or None if it goes to D."""
        if not self.enabled:
            return PathReason.OFF
        if s.hold is HoldState.NONE or s.usable_held <= 0:
            return PathReason.NOTHING_HELD
        if s.hold is HoldState.LAPSED and s.lapsed_for_s > self.lapsed_s:
            return PathReason.LAPSED_TOO_LONG
        if s.d_running >= s.d_max_running or s.d_used_blocks >= self.d_busy_fraction * s.d_total_blocks:
            return PathReason.D_FULL
        if s.d_pending_tokens + suffix > self.d_pending_tokens:
            return PathReason.D_PREFILL_BUSY
        isl = self._isl_reason(s, suffix)
        if self.policy == "isl_bounding":
            return isl
        load = None if s.p_queued_tokens >= self.p_busy_tokens else PathReason.P_NOT_BUSY
        if self.policy == "prefill_load":
            return load
        return None if isl is None or load is None else isl  # isl_or_load: either arm sends it to D

    def _isl_reason(self, s: TurnSignals, suffix: int) -> PathReason | None:
        if suffix >= self.suffix_tokens:
            return PathReason.SUFFIX_TOO_LONG
        if suffix >= self.suffix_ratio * max(s.prompt_tokens, 1):
            return PathReason.SUFFIX_SHARE_TOO_HIGH
        return None

    def _arm_reason(self, s: TurnSignals, suffix: int) -> PathReason:
        if self.policy != "prefill_load" and self._isl_reason(s, suffix) is None:
            return PathReason.SHORT_SUFFIX
        return PathReason.P_BUSY

    @staticmethod
    def _p_path(s: TurnSignals, p_policy: RecomputePolicy | None, block_size: int) -> TurnPath:
        if s.hold is not HoldState.RETAINED or s.held_tokens <= 0:
            return TurnPath.RECOMPUTE_ON_P  # nothing the store can offer P
        if p_policy is None:
            return TurnPath.PULL_TO_P
        candidate = PullCandidate(s.prompt_tokens, s.held_tokens, 0, block_size, TransferPath.DECODE_TO_PREFILL)
        return TurnPath.PULL_TO_P if p_policy.decide(candidate).pull else TurnPath.RECOMPUTE_ON_P


def superseding(entry_params: object) -> dict[str, str] | None:
    """The value of :data:`SUPERSEDES_KEY` for a turn continuing the retained turn whose params D returned
    (``remote_request_id`` and ``remote_engine_id``), or None when they do not name one."""
    if not isinstance(entry_params, dict):
        return None
    request_id, engine_id = entry_params.get("remote_request_id"), entry_params.get("remote_engine_id")
    if not (isinstance(request_id, str) and isinstance(engine_id, str) and request_id and engine_id):
        return None
    return {"request_id": request_id, "engine_id": engine_id}


def superseded(params: object) -> tuple[tuple[str, str] | None, str | None]:
    """What D reads of :data:`SUPERSEDES_KEY` in a request's params: ``((request_id, engine_id), None)``;
    ``(None, None)`` when absent; ``(None, why)`` when malformed (D then releases nothing)."""
    if not isinstance(params, dict) or SUPERSEDES_KEY not in params:
        return None, None
    value = params[SUPERSEDES_KEY]
    if not isinstance(value, dict):
        return None, f"{SUPERSEDES_KEY} must be an object, got {type(value).__name__}"
    ids = []
    for name in ("request_id", "engine_id"):
        v = value.get(name)
        if not isinstance(v, str) or not v or len(v) > _MAX_ID_LEN:
            return None, f"{SUPERSEDES_KEY}.{name} must be a non-empty string of at most {_MAX_ID_LEN} characters"
        ids.append(v)
    return (ids[0], ids[1]), None


def suffix_token_bound(new_text_bytes: int, new_messages: int, per_message_tokens: int = 8) -> int:
    """An upper bound on the tokens a suffix of ``new_messages`` messages holding ``new_text_bytes`` UTF-8
    bytes of content adds to the prompt, for a router without the model's tokenizer: a byte-level BPE
    token covers at least one byte, plus the chat template's tokens around each message (role header and
    end-of-turn markers: ``per_message_tokens``, 8 by default, more than the 4-6 of common templates) and
    the generation prompt (counted as one more message). Overcounts by the tokenizer's bytes per token;
    never undercounts a byte-level BPE tokenizer with a template within that allowance."""
    if new_text_bytes < 0 or new_messages < 0 or per_message_tokens < 0:
        raise ValueError("suffix_token_bound takes counts >= 0")
    return new_text_bytes + per_message_tokens * (new_messages + 1)
