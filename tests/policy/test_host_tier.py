"""The host tier's decisions (impl.policy.host_tier) against independent statements of their rules."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import given, strategies as st

from impl.policy import DecisionReason, PullCandidate, RecomputeDecision
from impl.policy.host_tier import (HostPullBreakEven, HostPullMinimum, HostTierSettings, KVSource, choose_source)

tokens = st.integers(min_value=0, max_value=200_000)
blocks = st.sampled_from([1, 16, 64])


@given(prompt=tokens, remote=tokens, local=tokens, block=blocks, minimum=st.integers(0, 20_000))
def test_the_minimum_is_llm_d_min_cached_token_delta(prompt, remote, local, block, minimum):
    # written out: the lead in cached tokens beyond the local (whole-block) hit, pulled iff >= the minimum
    lead = min(remote, prompt) - local // block * block
    decision = HostPullMinimum(minimum).decide(PullCandidate(prompt, remote, local, block))
    assert decision.pull == (lead > 0 and lead >= minimum)
    assert decision.tokens == max(lead, 0)


@dataclass(frozen=True)
class Affine:
    """Costs written independently of calibration: a pull floor plus bytes, recompute per token."""

    floor_s: float
    pull_per_token_s: float
    recompute_per_token_s: float

    def host_pull_time_s(self, tokens: int) -> float:
        return self.floor_s + self.pull_per_token_s * tokens

    def recompute_time_s(self, tokens: int, cached_context_tokens: int) -> float:
        return self.recompute_per_token_s * tokens


costs = st.builds(Affine, st.floats(0.0, 3.0), st.floats(0.0, 5e-5), st.floats(1e-6, 2e-4))


@given(costs=costs, prompt=tokens, remote=tokens, local=tokens, block=blocks, minimum=st.integers(0, 20_000))
def test_break_even_pulls_only_above_the_minimum_and_when_cheaper(costs, prompt, remote, local, block, minimum):
    decision = HostPullBreakEven(costs, minimum).decide(PullCandidate(prompt, remote, local, block))
    lead = min(remote, prompt) - local // block * block
    cheaper = lead > 0 and costs.host_pull_time_s(lead) < costs.recompute_time_s(lead, 0)
    assert decision.pull == (lead >= minimum and cheaper)
    if decision.reason in (DecisionReason.PULL_CHEAPER, DecisionReason.RECOMPUTE_CHEAPER):
        assert decision.predicted_pull_s == costs.host_pull_time_s(lead)


@given(costs=costs)
def test_break_even_tokens_is_where_the_pull_starts_to_win(costs):
    policy = HostPullBreakEven(costs, 0)
    n = policy.break_even_tokens(limit=1 << 22)
    if costs.recompute_per_token_s <= costs.pull_per_token_s:
        assert n is None  # floor + p n < r n has no solution when r <= p
        return
    expected = math.floor(costs.floor_s / (costs.recompute_per_token_s - costs.pull_per_token_s)) + 1
    if expected > 1 << 22:
        assert n is None
    else:
        assert n is not None and abs(n - expected) <= 1  # float rounding at the edge


def _d(pull: bool) -> RecomputeDecision:
    return RecomputeDecision(pull, 100, DecisionReason.AT_OR_ABOVE_THRESHOLD)


@pytest.mark.parametrize("hbm, host, expected", [
    (_d(True), _d(True), KVSource.HBM), (_d(True), None, KVSource.HBM), (_d(False), _d(True), KVSource.HOST),
    (None, _d(True), KVSource.HOST), (None, _d(False), KVSource.RECOMPUTE), (_d(False), None, KVSource.RECOMPUTE),
    (None, None, KVSource.RECOMPUTE)])
def test_hbm_first_then_the_host_tier_then_recompute(hbm, host, expected):
    assert choose_source(hbm, host) is expected


@given(prompt=tokens, extra=st.integers(0, 5_000), chunk=st.sampled_from([16, 64]), prompt_only=st.booleans())
def test_what_d_offloads(prompt, extra, chunk, prompt_only):
    settings = HostTierSettings(1e9, offload_prompt_only=prompt_only)
    held = settings.offloaded_tokens(prompt, prompt + extra, chunk)
    span = prompt if prompt_only else prompt + extra
    assert held % chunk == 0 and span - chunk < held <= span


@pytest.mark.parametrize("kwargs, field", [
    ({"cpu_bytes_to_use": 0}, "cpu_bytes_to_use"), ({"cpu_bytes_to_use": math.inf}, "cpu_bytes_to_use"),
    ({"cpu_bytes_to_use": 1e9, "eviction_policy": "fifo"}, "eviction_policy"),
    ({"cpu_bytes_to_use": 1e9, "min_cached_token_delta": -1}, "min_cached_token_delta"),
    ({"cpu_bytes_to_use": 1e9, "min_cached_token_delta": 1.5}, "min_cached_token_delta")])
def test_settings_name_the_field_they_reject(kwargs, field):
    with pytest.raises(ValueError, match=field):
        HostTierSettings(**kwargs)
