"""PrefillOnD against an independent statement of Dynamo's conditional-disaggregation rules plus our guards;
suffix_token_bound against a real byte-level BPE tokenizer and chat template."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from impl.policy import FixedThreshold
from impl.policy.prefill_on_d import (
    POLICIES,
    HoldState,
    PathReason,
    PrefillOnD,
    TurnPath,
    TurnSignals,
    suffix_token_bound,
)


def reference_on_d(policy: str, prompt: int, held: int, hold: str, lapsed_for: float, d_running: int, d_max: int,
                   d_used: int, d_total: int, d_pending: int, p_queued: int, *, suffix_tokens: int, suffix_ratio: float,
                   p_busy: int, d_pending_max: int, d_busy: float, lapsed_s: float) -> bool:
    """Does the turn go to D? Written out from the rules (Dynamo's router docs, PR #11357), not the code."""
    if policy == "off" or hold == "none":
        return False
    reusable = min(held, prompt - 1)  # D computes the last prompt token whatever it holds
    if reusable <= 0:
        return False
    if hold == "lapsed" and lapsed_for > lapsed_s:
        return False
    eff_isl = prompt - reusable
    if d_running >= d_max or d_used >= d_busy * d_total or d_pending + eff_isl > d_pending_max:
        return False
    isl_arm = eff_isl < suffix_tokens and eff_isl / prompt < suffix_ratio
    load_arm = p_queued >= p_busy
    return {"isl_bounding": isl_arm, "prefill_load": load_arm, "isl_or_load": isl_arm or load_arm}[policy]


@given(policy=st.sampled_from(POLICIES), prompt=st.integers(1, 50_000), held=st.integers(0, 60_000),
       hold=st.sampled_from(["none", "retained", "lapsed"]), lapsed_for=st.floats(0, 1000),
       d_max=st.integers(1, 300), d_running=st.integers(0, 300), d_total=st.integers(1, 10_000),
       d_used=st.integers(0, 10_000), d_pending=st.integers(0, 20_000), p_queued=st.integers(0, 50_000),
       suffix_tokens=st.integers(1, 8192), suffix_ratio=st.floats(0.05, 1.0), p_busy=st.integers(0, 40_000),
       d_pending_max=st.integers(1, 20_000), d_busy=st.floats(0.05, 1.0), lapsed_s=st.sampled_from([0.0, 30.0, 600.0]))
def test_decision_matches_the_rules_written_out(policy, prompt, held, hold, lapsed_for, d_max, d_running, d_total,
                                                d_used, d_pending, p_queued, suffix_tokens, suffix_ratio, p_busy,
                                                d_pending_max, d_busy, lapsed_s):
    settings = PrefillOnD(policy, suffix_tokens, suffix_ratio, p_busy, d_pending_max, d_busy, lapsed_s)
    held = min(held, prompt)
    signals = TurnSignals(prompt, held, HoldState(hold), lapsed_for, d_running, d_max, d_used, d_total, d_pending,
                          p_queued)
    decision = settings.decide(signals)
    on_d = reference_on_d(policy, prompt, held, hold, lapsed_for, d_running, d_max, d_used, d_total, d_pending,
                          p_queued, suffix_tokens=suffix_tokens, suffix_ratio=suffix_ratio, p_busy=p_busy,
                          d_pending_max=d_pending_max, d_busy=d_busy, lapsed_s=lapsed_s)
    assert (decision.path is TurnPath.PREFILL_ON_D) == on_d, decision
    assert decision.suffix_tokens == prompt - max(0, min(held, prompt - 1))
    if on_d:
        assert decision.reason in (PathReason.SHORT_SUFFIX, PathReason.P_BUSY)
        assert decision.suffix_tokens >= 1  # D always computes something: the last prompt token at least
    else:
        # sent to P: pull predicted only when the store still offers D's blocks
        assert decision.path is (TurnPath.PULL_TO_P if hold == "retained" and held > 0 else TurnPath.RECOMPUTE_ON_P)


@given(prompt=st.integers(2, 50_000), held=st.integers(1, 50_000), threshold=st.integers(0, 5000))
def test_a_turn_sent_to_p_is_predicted_as_p_s_own_policy_decides(prompt, held, threshold):
    held = min(held, prompt)
    signals = TurnSignals(prompt, held, HoldState.RETAINED)
    decision = PrefillOnD("off").decide(signals, FixedThreshold(threshold), 16)
    assert decision.reason is PathReason.OFF
    pull = threshold == 0 or held >= threshold  # vLLM: count = min(remote, prompt) - local hit (0 here)
    assert decision.path is (TurnPath.PULL_TO_P if pull else TurnPath.RECOMPUTE_ON_P)


def test_each_guard_names_why_the_turn_went_to_p():
    isl = PrefillOnD("isl_bounding", suffix_tokens=1000, suffix_ratio=0.5, d_pending_tokens=500, d_busy_fraction=0.9)
    ok = dict(prompt_tokens=4000, held_tokens=3800, hold=HoldState.RETAINED, d_max_running=8, d_total_blocks=100)
    assert isl.decide(TurnSignals(**ok)).path is TurnPath.PREFILL_ON_D
    cases = [
        (dict(hold=HoldState.NONE), PathReason.NOTHING_HELD),
        (dict(held_tokens=0), PathReason.NOTHING_HELD),
        (dict(hold=HoldState.LAPSED, lapsed_for_s=1.0), PathReason.LAPSED_TOO_LONG),
        (dict(d_running=8), PathReason.D_FULL),
        (dict(d_used_blocks=90), PathReason.D_FULL),
        (dict(d_pending_tokens=301), PathReason.D_PREFILL_BUSY),
        (dict(held_tokens=2000), PathReason.D_PREFILL_BUSY),  # 2000 suffix tokens > the 500 D may take on
    ]
    for change, reason in cases:
        assert isl.decide(TurnSignals(**{**ok, **change})).reason is reason, change
    roomy = PrefillOnD("isl_bounding", suffix_tokens=1000, suffix_ratio=0.5)
    assert roomy.decide(TurnSignals(**{**ok, "held_tokens": 2000})).reason is PathReason.SUFFIX_TOO_LONG
    assert roomy.decide(TurnSignals(**{**ok, "prompt_tokens": 1000, "held_tokens": 400})).reason is \
        PathReason.SUFFIX_SHARE_TOO_HIGH
    load = PrefillOnD("prefill_load", p_busy_tokens=100)
    assert load.decide(TurnSignals(**ok, p_queued_tokens=99)).reason is PathReason.P_NOT_BUSY
    assert load.decide(TurnSignals(**ok, p_queued_tokens=100)).reason is PathReason.P_BUSY
    # a hold that lapsed within lapsed_s still counts on D's prefix cache
    assert PrefillOnD("isl_bounding", lapsed_s=60.0).decide(
        TurnSignals(**{**ok, "hold": HoldState.LAPSED, "lapsed_for_s": 59.0})).path is TurnPath.PREFILL_ON_D


@pytest.mark.parametrize("kwargs, message", [
    (dict(policy="sometimes"), "policy must be one of"),
    (dict(suffix_tokens=0), "suffix_tokens must be >= 1"),
    (dict(suffix_ratio=0.0), "suffix_ratio must be in"),
    (dict(suffix_ratio=1.5), "suffix_ratio must be in"),
    (dict(p_busy_tokens=-1), "p_busy_tokens must be >= 0"),
    (dict(d_pending_tokens=0), "d_pending_tokens must be >= 1"),
    (dict(d_busy_fraction=0.0), "d_busy_fraction must be in"),
    (dict(lapsed_s=float("inf")), "lapsed_s must be finite"),
    (dict(lapsed_s=float("nan")), "lapsed_s must be finite"),
])
def test_bad_settings_name_the_setting(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PrefillOnD(**kwargs)


def test_bad_signals_name_the_field():
    with pytest.raises(ValueError, match="held_tokens must be >= 0"):
        TurnSignals(10, -1, HoldState.RETAINED)
    with pytest.raises(ValueError, match="d_max_running must be >= 1"):
        TurnSignals(10, 5, HoldState.RETAINED, d_max_running=0)
    with pytest.raises(ValueError, match="lapsed_for_s must be >= 0"):
        TurnSignals(10, 5, HoldState.LAPSED, lapsed_for_s=float("nan"))


# -- the suffix estimate, against the tests' real byte-level BPE tokenizer and chat template ------------

@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.e2e.tiny_model import build_tokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return AutoTokenizer.from_pretrained(str(out))


def _tokens(tokenizer, messages, generation_prompt: bool) -> int:
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return len(tokenizer(rendered, add_special_tokens=False)["input_ids"])


text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=300)


@pytest.mark.extra("impl")  # transformers, which vllm brings
@given(history=st.lists(text, min_size=1, max_size=4), new=st.lists(text, min_size=1, max_size=3))
def test_the_suffix_bound_never_undercounts_what_the_template_adds(tokenizer, history, new):
    roles = ["user", "assistant"]
    held = [{"role": roles[i % 2], "content": c} for i, c in enumerate(history)]
    if held[-1]["role"] == "user":
        held.append({"role": "assistant", "content": "ok"})
    added = [{"role": "user" if i % 2 == 0 else "tool", "content": c} for i, c in enumerate(new)]
    before = _tokens(tokenizer, held, False)
    after = _tokens(tokenizer, held + added, True)
    assert before > 0
    bound = suffix_token_bound(sum(len(m["content"].encode()) for m in added), len(added))
    assert after - before <= bound


@pytest.mark.extra("impl")
def test_the_suffix_bound_overcounts_by_about_the_tokenizer_s_bytes_per_token(tokenizer):
    # what a wrong (high) estimate costs is reuse forgone, never D's TPOT. The tests' 512-token BPE packs
    # English at ~1.8 bytes per token (a large-vocabulary one at ~4): the bound is that factor high
    message = "Could you summarise the previous answer in three short bullet points, please? " * 4
    held = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]
    added = [{"role": "user", "content": message}]
    exact = _tokens(tokenizer, held + added, True) - _tokens(tokenizer, held, False)
    bound = suffix_token_bound(len(message.encode()), 1)
    assert 0 < exact <= bound <= 2.5 * exact
