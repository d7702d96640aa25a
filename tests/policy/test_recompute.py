"""FixedThreshold against an independent statement of vLLM's rule; BreakEvenThreshold against its costs."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from impl.policy import BreakEvenThreshold, DecisionReason, FixedThreshold, PullCandidate, TransferPath


def reference_pull(prompt: int, remote: int, local_hit: int, block: int, threshold: int) -> tuple[bool, int]:
    """vLLM's rule written out independently: (pull?, count)."""
    aligned = local_hit - local_hit % block
    count = min(remote, prompt) - aligned
    if count <= 0:
        return False, 0
    if threshold == 0:
        return True, count
    return count >= threshold, count


tokens = st.integers(min_value=0, max_value=40_000)


@given(prompt=tokens, remote=tokens, local_hit=tokens, block=st.sampled_from([1, 16, 64, 128]),
       threshold=st.integers(min_value=0, max_value=2_000), path=st.sampled_from(list(TransferPath)))
def test_fixed_threshold_matches_reference(prompt, remote, local_hit, block, threshold, path):
    decision = FixedThreshold(threshold).decide(PullCandidate(prompt, remote, local_hit, block, path))
    expected_pull, expected_count = reference_pull(prompt, remote, local_hit, block, threshold)
    assert decision.pull == expected_pull
    assert decision.tokens == expected_count


@pytest.mark.parametrize("path", list(TransferPath))
def test_fixed_threshold_edges(path):
    policy = FixedThreshold(64)
    # count == threshold pulls; one less recomputes
    assert policy.decide(PullCandidate(1000, 64, 0, 16, path)).pull
    below = policy.decide(PullCandidate(1000, 63, 0, 16, path))
    assert not below.pull and below.reason is DecisionReason.BELOW_THRESHOLD and below.tokens == 63
    # remote larger than the prompt counts only the prompt
    assert policy.decide(PullCandidate(100, 5000, 0, 16, path)).tokens == 100
    # local hit not block-aligned: 47 rounds down to 32, so 96 - 32 = 64 pulls
    assert policy.decide(PullCandidate(96, 96, 47, 16, path)).tokens == 64
    # local cache covers everything: nothing to pull, whatever the threshold
    for thr in (0, 64):
        d = FixedThreshold(thr).decide(PullCandidate(96, 96, 96, 16, path))
        assert not d.pull and d.reason is DecisionReason.NOTHING_TO_PULL
    # threshold 0 disables the check: one token still pulls
    d = FixedThreshold(0).decide(PullCandidate(96, 1, 0, 16, path))
    assert d.pull and d.reason is DecisionReason.THRESHOLD_DISABLED


def test_bad_inputs_rejected_with_field_name():
    with pytest.raises(ValueError, match="kv_recompute_threshold"):
        FixedThreshold(-1)
    with pytest.raises(ValueError, match="block_size"):
        PullCandidate(1, 1, 0, 0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        PullCandidate(-1, 1, 0, 16)


class AffineCosts:
    """A stand-in for a calibration profile: pull = setup + per-block + per-token; compute per token grows with context."""

    def __init__(self, setup=0.020, per_block=0.0, per_token=4.4e-6, compute_per_token=26e-6, attn_per_token_ctx=0.0):
        self.setup, self.per_block, self.per_token = setup, per_block, per_token
        self.compute_per_token, self.attn = compute_per_token, attn_per_token_ctx

    def pull_time_s(self, tokens, blocks):
        return self.setup + self.per_block * blocks + self.per_token * tokens

    def recompute_time_s(self, tokens, cached_context_tokens):
        return tokens * (self.compute_per_token + self.attn * (cached_context_tokens + tokens / 2))


@given(prompt=tokens, remote=tokens, local_hit=tokens, block=st.sampled_from([16, 64]))
def test_break_even_follows_its_costs(prompt, remote, local_hit, block):
    costs = AffineCosts()
    cand = PullCandidate(prompt, remote, local_hit, block)
    d = BreakEvenThreshold(costs).decide(cand)
    count = cand.reusable_tokens
    if count <= 0:
        assert not d.pull and d.reason is DecisionReason.NOTHING_TO_PULL
        return
    pull_s = costs.pull_time_s(count, -(-count // block))
    recompute_s = costs.recompute_time_s(count, cand.aligned_local_hit)
    assert d.pull == (pull_s < recompute_s)
    assert d.predicted_pull_s == pytest.approx(pull_s) and d.predicted_recompute_s == pytest.approx(recompute_s)


def test_break_even_tokens_is_the_crossover():
    costs = AffineCosts()
    policy = BreakEvenThreshold(costs)
    n = policy.break_even_tokens(block_size=16)
    # 20 ms setup / (26 - 4.4) us per token: 925.9.. tokens, so 926 is the first that wins
    assert n == 926
    assert policy.decide(PullCandidate(n, n, 0, 16)).pull
    assert not policy.decide(PullCandidate(n - 1, n - 1, 0, 16)).pull
    never = BreakEvenThreshold(AffineCosts(per_token=1.0))
    assert never.break_even_tokens(16) is None


def test_break_even_tie_recomputes():
    """Pull only when strictly cheaper: a tie keeps the compute local (no transfer to set up or fail)."""
    tie = BreakEvenThreshold(AffineCosts(setup=0.0, per_token=26e-6, compute_per_token=26e-6))
    d = tie.decide(PullCandidate(1000, 1000, 0, 16))
    assert d.predicted_pull_s == d.predicted_recompute_s
    assert not d.pull and d.reason is DecisionReason.RECOMPUTE_CHEAPER


@given(prompt=tokens, remote=tokens, local_hit=tokens, block=st.sampled_from([1, 16, 64, 128]), data=st.data())
def test_peer_block_span_covers_exactly_the_positions_read(prompt, remote, local_hit, block, data):
    cand = PullCandidate(prompt, remote, local_hit, block)
    hit = local_hit - local_hit % block
    readable = min(remote, prompt) - hit
    if readable < 0:
        return
    n = data.draw(st.integers(0, readable), label="tokens read")
    first, stop = cand.peer_block_span(n)
    # the peer's block i holds positions [i*block, (i+1)*block): the span is the fewest blocks covering [hit, hit+n)
    assert first * block == hit
    if n == 0:
        assert stop == first
    else:
        assert stop * block >= hit + n > (stop - 1) * block
    with pytest.raises(ValueError):
        cand.peer_block_span(readable + 1)
