"""Token-exact verification (impl.policy.prefix_check): never a false agreement, and a bounded loss.

The expected values are derived independently of the module's hashing: the true common prefix is
computed by comparing the token lists, and the expected verified prefix from the checkpoint list by
:func:`verified_blocks` (the simulator's model), which the hash-based :func:`verify_prefix` must
reproduce exactly.
"""

from __future__ import annotations

import json
import math

from hypothesis import assume, given, settings, strategies as st

from impl.policy.prefix_check import (CHECK_KEY, MAX_CHECKPOINTS, VerifyReason, chain_block_hashes, checkpoint_blocks,
                                      lost_blocks_bound, publish, scheme_tag, verified_blocks, verified_tokens_model,
                                      verify_prefix)

SCHEME = scheme_tag("sha256", 16, "tiny-model", b"seed")


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@st.composite
def divergent_pair(draw):
    """A held sequence and a prompt that agrees with it up to a drawn point, then differs."""
    held = draw(st.lists(st.integers(0, 50), min_size=1, max_size=600))
    split = draw(st.integers(0, len(held)))
    suffix = draw(st.lists(st.integers(0, 50), max_size=200))
    if split < len(held) and suffix:
        # make position `split` really differ (else the drawn split is not the divergence point)
        suffix[0] = (held[split] + 1 + suffix[0]) % 51
    prompt = held[:split] + suffix
    return held, prompt


@settings(max_examples=400, deadline=None)
@given(divergent_pair(), st.integers(1, 32), st.integers(1, 12), st.integers(0, 600), st.data())
def test_verification_never_agrees_beyond_the_common_prefix_and_loses_at_most_the_bound(pair, block_size, dense,
                                                                                      anchor_tokens, data):
    held, prompt = pair
    num_tokens = data.draw(st.integers(1, len(held)), label="num_tokens")  # KV held for a prefix of `held`
    check = publish(chain_block_hashes(held, block_size), held, num_tokens, scheme=SCHEME,
                    block_size=block_size, anchor_tokens=[anchor_tokens], dense=dense)
    assert check is not None
    result = verify_prefix(json.loads(json.dumps(check)), chain_block_hashes(prompt, block_size), prompt,
                           scheme=SCHEME, block_size=block_size)
    truth = min(common_prefix(held[:num_tokens], prompt), num_tokens)
    assert result.tokens <= truth  # never a false agreement
    assert result.tokens <= len(prompt)
    # exactly what the simulator's model says, from counts alone
    full = num_tokens // block_size
    assert result.tokens == verified_tokens_model(num_tokens, anchor_tokens, truth, len(prompt), block_size, dense)
    if not (truth == num_tokens and len(prompt) >= num_tokens):  # and that model is the checkpoint rule
        points = checkpoint_blocks(full, [anchor_tokens // block_size], dense)
        assert result.tokens == verified_blocks(truth // block_size, points) * block_size
    lost_blocks = truth // block_size - result.tokens // block_size
    assert lost_blocks <= lost_blocks_bound(full, truth // block_size, [anchor_tokens // block_size], dense)
    assert result.reason in (VerifyReason.FULL, VerifyReason.PARTIAL)
    assert (result.reason is VerifyReason.FULL) == (result.tokens >= min(num_tokens, len(prompt)))


@given(st.integers(0, 100_000), st.integers(0, 100_000), st.integers(1, 16))
def test_checkpoints_are_few_distinct_in_range_and_end_at_the_end(num_blocks, anchor, dense):
    points = checkpoint_blocks(num_blocks, [anchor], dense)
    assert points == sorted(set(points), reverse=True)
    assert all(1 <= p <= num_blocks for p in points)
    if num_blocks:
        assert points[0] == num_blocks
        assert len(points) <= dense + 3 * math.log2(num_blocks) + 4
    else:
        assert points == []


def test_a_128k_token_conversation_publishes_a_small_check():
    tokens = list(range(128 * 1024))
    check = publish(chain_block_hashes(tokens, 16), tokens, len(tokens) - 5, scheme=SCHEME, block_size=16,
                    anchor_tokens=[120_000])
    assert len(check["cp"]) <= 48
    assert len(json.dumps(check)) < 1500  # against ~800 KB for the token ids themselves


def test_other_scheme_or_block_size_verifies_nothing():
    tokens = list(range(100))
    check = publish(chain_block_hashes(tokens, 16), tokens, 100, scheme=SCHEME, block_size=16)
    chain = chain_block_hashes(tokens, 16)
    other = scheme_tag("xxhash", 16, "tiny-model", b"random-seed")
    assert verify_prefix(check, chain, tokens, scheme=other, block_size=16).reason is VerifyReason.SCHEME
    assert verify_prefix(check, chain_block_hashes(tokens, 8), tokens, scheme=SCHEME, block_size=8).tokens == 0
    assert verify_prefix(check, chain, tokens, scheme=SCHEME, block_size=16).tokens == 100


def test_hashes_of_another_seed_salt_never_agree():
    tokens = list(range(64))
    check = publish(chain_block_hashes(tokens, 16, seed=b"tenant-a"), tokens, 64, scheme=SCHEME, block_size=16)
    result = verify_prefix(check, chain_block_hashes(tokens, 16, seed=b"tenant-b"), tokens, scheme=SCHEME,
                           block_size=16)
    assert result.tokens == 0 and result.reason is VerifyReason.PARTIAL


def test_no_check_is_reported_as_such():
    assert verify_prefix(None, [], [1, 2, 3], scheme=SCHEME, block_size=16).reason is VerifyReason.NO_CHECK


json_values = st.recursive(st.none() | st.booleans() | st.integers(-5, 10**6) | st.text(max_size=20) |
                           st.floats(allow_nan=True), lambda c: st.lists(c, max_size=5) |
                           st.dictionaries(st.text(max_size=5), c, max_size=5), max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(json_values, st.data())
def test_malformed_checks_verify_nothing_and_never_raise(junk, data):
    tokens = list(range(80))
    chain = chain_block_hashes(tokens, 16)
    good = publish(chain, tokens, 80, scheme=SCHEME, block_size=16)
    # either junk outright, or the good check with one field replaced by junk
    field = data.draw(st.sampled_from([None, "v", "n", "bs", "cp", "tail"]))
    check = junk if field is None else {**good, field: junk}
    assume(check != good and not (field == "tail" and junk is None))
    result = verify_prefix(check, chain, tokens, scheme=SCHEME, block_size=16)
    assert 0 <= result.tokens <= len(tokens)
    if field in (None, "v", "bs", "cp"):
        assert result.tokens == 0  # nothing verifiable is left


def test_oversized_check_is_malformed():
    tokens = list(range(32))
    chain = chain_block_hashes(tokens, 16)
    check = publish(chain, tokens, 32, scheme=SCHEME, block_size=16)
    check["cp"] = check["cp"] * (MAX_CHECKPOINTS + 1)
    assert verify_prefix(check, chain, tokens, scheme=SCHEME, block_size=16).reason is VerifyReason.MALFORMED


def test_check_key_is_namespaced():
    assert CHECK_KEY.startswith("bidikv_")
