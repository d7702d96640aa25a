"""vLLM's multi-turn benchmark config read as is.

``data/vllm_generate_multi_turn.json`` is a verbatim copy of vLLM's published example,
https://github.com/vllm-project/vllm/blob/07b13497a9b52274d334090a9a8e04d5ec9ca7e9/benchmarks/multi_turn/generate_multi_turn.json
(Apache-2.0, copyright the vLLM project contributors). The expected distributions are closed forms
of what vLLM's ``bench_dataset.py`` draws (scipy's, not this code's), checked statistically.
"""

from __future__ import annotations

import collections
import copy
import json
import math
import pathlib
import random
import statistics

import numpy as np
import pytest

from sim.workload.chat_template import TEMPLATE_FAMILIES, ChatTemplateOverhead, parse_template
from scipy import stats

from sim.workload import load_workload
from sim.workload.vllm_multi_turn import (
    generate,
    load_config,
    parse_config,
    requests_for_messages,
    user_tokens,
)

EXAMPLE = pathlib.Path(__file__).parent / "data" / "vllm_generate_multi_turn.json"


def _example(**changes) -> dict:
    data = json.loads(EXAMPLE.read_text())
    for path, value in changes.items():
        node = data
        *parents, last = path.split("__")
        for key in parents:
            node = node[key]
        node[last] = value
    return data


def _many(data: dict, count: int, seed: int = 0):
    data = copy.deepcopy(data)
    data["num_conversations"] = count
    return generate(parse_config(data), random.Random(seed), TEMPLATE_FAMILIES["none"])  # content tokens only


def test_the_published_example_is_read_as_is():
    config = load_config(str(EXAMPLE))
    assert config.num_conversations == 24 and config.text_files == ("pg1184.txt",) and not config.print_stats
    # vLLM's own labels for them (its __repr__), so a user can match its printout
    assert config.num_turns.label == "UniformDistribution[12, 18]"
    assert config.common_prefix_num_tokens.label == "Constant[500]"
    assert config.prefix_num_tokens.label == "LognormalDistribution[1000, 0.85, 5000]"
    assert config.input_num_tokens.label == "UniformDistribution[120, 160]"
    assert config.output_num_tokens.label == "UniformDistribution[80, 120]"
    conversations = load_workload({"kind": "vllm_multi_turn", "path": str(EXAMPLE)}, seed=3)
    assert [c.conversation_id for c in conversations] == [f"CONV_ID_{i}" for i in range(24)]
    assert all(c.start_s == 0 and all(t.gap_before_s == 0 for t in c.turns) for c in conversations)  # no think time


@pytest.mark.parametrize("messages, requests", [(0, 1), (1, 1), (2, 1), (3, 2), (12, 6), (13, 7), (17, 9), (18, 9)])
def test_num_turns_counts_messages(messages, requests):
    # vLLM: at least 2 messages, rounded up to even; one request per user message
    assert requests_for_messages(messages) == requests


def test_requests_per_conversation_follow_uniform_12_to_18_messages():
    conversations = _many(_example(), 7000)
    counts = collections.Counter(len(c.turns) for c in conversations)
    # messages 12..18 uniform: 12 -> 6 requests, 13,14 -> 7, 15,16 -> 8, 17,18 -> 9
    expected = {6: 1 / 7, 7: 2 / 7, 8: 2 / 7, 9: 2 / 7}
    assert set(counts) == set(expected)
    observed = [counts[k] for k in sorted(expected)]
    assert stats.chisquare(observed, [expected[k] * 7000 for k in sorted(expected)]).pvalue > 1e-4


def test_user_and_answer_lengths_are_uniform_over_their_closed_ranges():
    conversations = _many(_example(), 3000)
    later_users = [u for c in conversations for u in user_tokens(c)[1:]]
    answers = [t.output_tokens for c in conversations for t in c.turns]
    for values, low, high in ((later_users, 120, 160), (answers, 80, 120)):
        assert min(values) == low and max(values) == high
        dist = stats.randint(low, high + 1)
        n = len(values)
        assert statistics.fmean(values) == pytest.approx(dist.mean(), abs=5 * dist.std() / math.sqrt(n))
        assert statistics.pvariance(values) == pytest.approx(dist.var(), rel=0.05)


def test_first_prompt_is_common_prefix_then_conversation_prefix():
    conversations = _many(_example(), 3000)
    assert all(c.shared_prefix_tokens == 500 for c in conversations)
    # vLLM counts the common prefix inside the first user message's 120-160 tokens (it is longer, so the
    # message is the common prefix) and adds the conversation prefix on top
    prefixes = [c.turns[0].prompt_tokens - 500 for c in conversations]
    mu, sigma = math.log(0.85 * 1000), math.sqrt(2 * math.log(1 / 0.85))
    lognormal = stats.lognorm(s=sigma, scale=math.exp(mu))
    below_cap = [p for p in prefixes if p < 5000]
    # below the clip the draws follow the lognormal conditioned on < 5000 (rescaling by ~1 per 3,000 draws)
    assert stats.kstest(below_cap, lambda x: lognormal.cdf(x) / lognormal.cdf(5000)).pvalue > 1e-4
    assert statistics.median(prefixes) == pytest.approx(850, rel=0.05)


def test_a_small_first_message_exceeds_no_common_prefix():
    conversations = _many(_example(prompt_input__common_prefix_num_tokens={"distribution": "constant", "value": 0},
                                   prompt_input__prefix_num_tokens={"distribution": "constant", "value": 7}), 200)
    for c in conversations:
        assert c.shared_prefix_tokens == 0
        assert 120 + 7 <= c.turns[0].prompt_tokens <= 160 + 7


def test_lognormal_average_batches_are_rescaled_to_the_exact_average():
    # vLLM scales each batch so its mean is the average, then clips, then rounds: a batch of all the
    # conversations' prefixes has mean 1000 within rounding when nothing is clipped
    conversations = _many(_example(prompt_input__prefix_num_tokens={"distribution": "lognormal", "average": 1000}), 50)
    prefixes = [c.turns[0].prompt_tokens - 500 for c in conversations]
    assert abs(statistics.fmean(prefixes) - 1000) <= 0.5
    # a batch of one (the common prefix) is the average itself
    one = _many(_example(prompt_input__common_prefix_num_tokens={"distribution": "lognormal", "average": 321}), 5)
    assert {c.shared_prefix_tokens for c in one} == {321}


def test_lognormal_mean_sigma_is_the_underlying_normal():
    conversations = _many(_example(prompt_input__prefix_num_tokens={"distribution": "lognormal", "mean": 6.0,
                                                                    "sigma": 0.5}), 3000)
    prefixes = [c.turns[0].prompt_tokens - 500 for c in conversations]
    assert statistics.median(prefixes) == pytest.approx(math.exp(6.0), rel=0.05)
    assert stats.kstest(prefixes, stats.lognorm(s=0.5, scale=math.exp(6.0)).cdf).pvalue > 1e-4


def test_prompts_resend_the_whole_history():
    for c in _many(_example(), 50):
        for previous, turn, added in zip(c.turns, c.turns[1:], user_tokens(c)[1:]):
            assert turn.prompt_tokens == previous.prompt_tokens + previous.output_tokens + added
            assert 120 <= added <= 160


def test_same_file_and_seed_same_conversations_other_seed_other():
    spec = {"kind": "vllm_multi_turn", "path": str(EXAMPLE)}
    assert load_workload(spec, 7) == load_workload(spec, 7)
    assert load_workload(spec, 7) != load_workload(spec, 8)


def test_zipf_and_poisson_fields():
    data = _example(prompt_output__num_tokens={"distribution": "poisson", "alpha": 200, "max": 230},
                    prompt_input__num_turns={"distribution": "zipf", "alpha": 2.0, "max": 6})
    conversations = _many(data, 2000)
    answers = [t.output_tokens for c in conversations for t in c.turns]
    assert max(answers) <= 230
    assert statistics.fmean(answers) == pytest.approx(stats.poisson(200).expect(lambda k: np.minimum(k, 230)), abs=1.0)
    # zipf(2) messages clipped at 6: 1 or 2 messages -> 1 request (P = 1 - sf(2)), 5 or 6 -> 3
    ones = sum(len(c.turns) == 1 for c in conversations) / len(conversations)
    assert ones == pytest.approx(stats.zipf.cdf(2, 2.0), abs=5 * math.sqrt(0.25 / len(conversations)))


@pytest.mark.parametrize("change, message", [
    ({"extra": 1}, "unknown key 'extra' in the top level"),
    ({"prompt_input__num_tokens": {"distribution": "lognormal", "average": 10, "meadian_ratio": 0.5}},
     "field 'prompt_input.num_tokens': unknown key 'meadian_ratio' for lognormal"),
    ({"filetype": "conversations"}, "field 'filetype' must be 'generate_conversations'"),
    ({"num_conversations": 0}, "field 'num_conversations' must be an integer >= 1"),
    ({"num_conversations": "24"}, "field 'num_conversations'"),
    ({"prompt_input__num_turns": {"distribution": "uniform", "min": 18, "max": 12}},
     r"field 'prompt_input.num_turns.max' \(12\) must be >= min \(18\)"),
    ({"prompt_input__num_turns": {"distribution": "uniform", "min": 0, "max": 12}},
     "field 'prompt_input.num_turns.min' must be an integer >= 1"),
    ({"prompt_input__num_turns": {"distribution": "uniform", "min": 12.0, "max": 18}},
     "field 'prompt_input.num_turns.min' must be an integer"),
    ({"prompt_input__num_turns": {"distribution": "zipf", "alpha": 1}}, "'prompt_input.num_turns.alpha' must be > 1"),
    ({"prompt_input__num_turns": {"distribution": "normal", "mean": 3}}, "field 'prompt_input.num_turns': unknown distribution kind 'normal'"),
    ({"prompt_input__num_turns": {"min": 3}}, "field 'prompt_input.num_turns': missing key 'distribution'"),
    ({"prompt_input__num_turns": {"distribution": "poisson"}}, "field 'prompt_input.num_turns': missing key 'alpha' for poisson"),
    ({"prompt_input__num_turns": {"distribution": "constant", "value": -1}}, "prompt_input.num_turns.value"),
    ({"prompt_input__num_turns": {"distribution": "lognormal", "average": 10, "median_ratio": 1.0}},
     r"'prompt_input.num_turns.median_ratio' must be in \(0, 1\)"),
    ({"prompt_input__num_turns": {"distribution": "lognormal", "average": 0.5}}, "'prompt_input.num_turns.average' must be >= 1"),
    ({"prompt_input__num_turns": {"distribution": "lognormal", "average": 10, "sigma": 1}}, "cannot also take"),
    ({"prompt_input__num_turns": {"distribution": "lognormal", "mean": 3}}, "missing field 'prompt_input.num_turns.sigma'"),
    ({"prompt_input__num_turns": {"distribution": "lognormal", "mean": 3, "sigma": 1, "median_ratio": 0.5}},
     "'prompt_input.num_turns.median_ratio' needs 'average'"),
    ({"prompt_input__num_turns": {"distribution": "lognormal", "mean": 3, "sigma": 1, "max": 2.5}},
     "'prompt_input.num_turns.max' must be an integer"),
    ({"prompt_input": [1]}, "field 'prompt_input' must be an object"),
    ({"prompt_input__tokens": 5}, "unknown key 'tokens' in 'prompt_input'"),
    ({"print_stats": "no"}, "field 'print_stats' must be true or false"),
    ({"text_files": "pg1184.txt"}, "field 'text_files' must be a list"),
])
def test_bad_configs_name_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        parse_config(_example(**change))


@pytest.mark.parametrize("missing, message", [
    ("prompt_output", "missing field 'prompt_output'"),
    ("num_conversations", "missing field 'num_conversations'"),
])
def test_missing_top_level_fields_are_named(missing, message):
    data = _example()
    del data[missing]
    with pytest.raises(ValueError, match=message):
        parse_config(data)


def test_missing_distribution_fields_are_named():
    data = _example()
    del data["prompt_input"]["prefix_num_tokens"]
    with pytest.raises(ValueError, match="missing field 'prompt_input.prefix_num_tokens'"):
        parse_config(data)
    data = _example()
    del data["prompt_input"]["common_prefix_num_tokens"]  # optional in vLLM: no common prefix
    assert {c.shared_prefix_tokens for c in generate(parse_config(data), random.Random(0), TEMPLATE_FAMILIES["none"])} == {0}


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(ValueError, match=f"vLLM multi-turn config {bad}: invalid JSON"):
        load_config(str(bad))
    with pytest.raises(ValueError, match="No such file"):
        load_config(str(tmp_path / "missing.json"))
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text('[{"id": "a", "messages": []}]')
    with pytest.raises(ValueError, match="ShareGPT input\\) is not supported"):
        load_config(str(sharegpt))


def test_workload_table_keys_are_checked():
    with pytest.raises(ValueError, match="missing key 'path'"):
        load_workload({"kind": "vllm_multi_turn"}, 0)
    with pytest.raises(ValueError, match="unknown key 'num_conversations' for kind 'vllm_multi_turn'"):
        load_workload({"kind": "vllm_multi_turn", "path": str(EXAMPLE), "num_conversations": 3}, 0)
    with pytest.raises(ValueError, match="workload.early_stop: expected true or false"):
        load_workload({"kind": "vllm_multi_turn", "path": str(EXAMPLE), "early_stop": "no"}, 0)
    with pytest.raises(ValueError, match="max_active_conversations must be an integer >= 0"):
        load_workload({"kind": "vllm_multi_turn", "path": str(EXAMPLE), "max_active_conversations": -2}, 0)


def test_draws_are_rounded_half_to_even_as_np_round():
    # a lognormal "average" batch of one is the average itself, then rounded
    for average, expected in ((321.6, 322), (320.5, 320), (321.5, 322)):
        one = _many(_example(prompt_input__common_prefix_num_tokens={"distribution": "lognormal",
                                                                     "average": average}), 2)
        assert {c.shared_prefix_tokens for c in one} == {expected}


def test_a_max_of_zero_is_no_clip():
    conversations = _many(_example(prompt_output__num_tokens={"distribution": "poisson", "alpha": 50, "max": 0}), 300)
    answers = [t.output_tokens for c in conversations for t in c.turns]
    assert statistics.fmean(answers) == pytest.approx(50, abs=1.5)


def test_the_chat_template_adds_its_tokens_to_every_prompt_and_keeps_them_prefix_consistent():
    data = json.loads(EXAMPLE.read_text())
    plain = generate(parse_config(data), random.Random(5), TEMPLATE_FAMILIES["none"])
    llama = generate(parse_config(data), random.Random(5), TEMPLATE_FAMILIES["llama3"])
    for p, t in zip(plain, llama):
        for k, (a, b) in enumerate(zip(p.turns, t.turns)):
            assert b.prompt_tokens == a.prompt_tokens + 26 + 5 * (2 * k + 1) + 4 and b.output_tokens == a.output_tokens
            if k:  # the new prompt still starts with the previous prompt and its answer
                assert b.prompt_tokens > t.turns[k - 1].prompt_tokens + t.turns[k - 1].output_tokens
        assert t.shared_prefix_tokens == 26 + (5 + p.shared_prefix_tokens if p.shared_prefix_tokens else 0)


def test_a_template_is_a_family_or_three_integers():
    assert parse_template("chatml") == ChatTemplateOverhead(5, 0, 3)
    assert parse_template("7,30,4") == ChatTemplateOverhead(7, 30, 4)
    for bad in ("llama2", "1,2", "a,b,c", 5, None, "1,-2,3"):
        with pytest.raises(ValueError, match="chat_template"):
            parse_template(bad)
    with pytest.raises(ValueError, match="workload.chat_template"):
        load_workload({"kind": "vllm_multi_turn", "path": str(EXAMPLE), "chat_template": "mistral"}, 0)
