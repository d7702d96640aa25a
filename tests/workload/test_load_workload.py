"""load_workload: dispatch, seeding, and key validation of the [workload] table."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sim.workload import load_workload


def tokens(conversations):
    return [[(turn.prompt_tokens, turn.output_tokens) for turn in conversation.turns] for conversation in conversations]


def trace(tmp_path):
    rows = [{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
            {"timestamp": 60_000, "input_length": 1600, "output_length": 5, "hash_ids": [0, 1, 3, 4]}]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_synthetic_defaults_and_overrides():
    assert len(load_workload({"kind": "synthetic"}, seed=1)) == 24
    conversations = load_workload({"kind": "synthetic", "num_conversations": 3, "messages_per_conversation": 4,
                                   "user_tokens": "10..20", "output_tokens": {"kind": "constant", "value": 7},
                                   "conversation_prefix_tokens": 0, "common_prefix_tokens": 100}, seed=1)
    assert len(conversations) == 3
    for conversation in conversations:
        assert [turn.output_tokens for turn in conversation.turns] == [7, 7]
        assert 110 <= conversation.turns[0].prompt_tokens <= 120


def test_same_seed_same_workload_different_seed_different():
    for kind in ("synthetic", "agentic"):
        assert load_workload({"kind": kind}, 5) == load_workload({"kind": kind}, 5)
        assert tokens(load_workload({"kind": kind}, 5)) != tokens(load_workload({"kind": kind}, 6))


def test_gap_override_leaves_tokens_alone():
    baseline = load_workload({"kind": "synthetic"}, 3)
    changed = load_workload({"kind": "synthetic", "inter_turn_gap_s": {"kind": "exponential", "mean": 5}}, 3)
    assert tokens(changed) == tokens(baseline)


def test_agentic():
    sessions = load_workload({"kind": "agentic", "num_conversations": 2, "answer_prob": 0.0}, 1)
    assert len(sessions) == 2


def test_mooncake(tmp_path):
    conversations = load_workload({"kind": "mooncake", "path": trace(tmp_path)}, 1)
    assert [[turn.prompt_tokens for turn in c.turns] for c in conversations] == [[1100, 1600]]
    assert conversations == load_workload({"kind": "mooncake", "path": trace(tmp_path)}, 1)
    gap = conversations[0].turns[1].gap_before_s
    assert 57.0 < gap < 63.0


def test_gaps_resampled_from_a_trace(tmp_path):
    conversations = load_workload({"kind": "synthetic", "inter_turn_gap_s": {"kind": "mooncake_gaps",
                                                                              "path": trace(tmp_path)}}, 1)
    gaps = [turn.gap_before_s for conversation in conversations for turn in conversation.turns[1:]]
    assert len(set(gaps)) == 1 and 57.0 < gaps[0] < 63.0  # the trace's only gap, 60 s, jittered once


@pytest.mark.parametrize("spec, message", [
    ({}, "workload: missing key 'kind'"),
    ({"kind": "chat"}, "workload.kind: unknown workload kind 'chat'"),
    ({"kind": "synthetic", "num_conversation": 3}, "workload: unknown key 'num_conversation'"),
    ({"kind": "synthetic", "num_conversations": "3"}, "workload.num_conversations: expected an integer"),
    ({"kind": "synthetic", "num_conversations": 0}, "workload: num_conversations must be >= 1"),
    ({"kind": "synthetic", "history_rewrite_prob": 2}, "workload: history_rewrite_prob must be in"),
    ({"kind": "synthetic", "arrival_rate_per_s": float("nan")}, "workload.arrival_rate_per_s: expected a number"),
    ({"kind": "synthetic", "user_tokens": -3}, "workload.user_tokens: "),
    ({"kind": "synthetic", "user_tokens": {"kind": "uniform_int", "low": 1, "hi": 3}},
     "workload.user_tokens: unknown key 'hi'"),
    ({"kind": "synthetic", "inter_turn_gap_s": {"kind": "mooncake_gaps"}},
     "workload.inter_turn_gap_s: missing key 'path'"),
    ({"kind": "synthetic", "inter_turn_gap_s": {"kind": "mooncake_gaps", "path": "x", "seed": 1}},
     "workload.inter_turn_gap_s: unknown key 'seed'"),
    ({"kind": "agentic", "num_sessions": 3}, "workload: unknown key 'num_sessions'"),
    ({"kind": "mooncake", "path": "t.jsonl", "num_conversations": 3}, "workload: unknown key 'num_conversations'"),
    ({"kind": "mooncake"}, "workload: missing key 'path'"),
    ({"kind": "mooncake", "path": "t.jsonl", "rate": 2}, "workload: unknown key 'rate'"),
    ({"kind": "mooncake", "path": "t.jsonl", "min_parent_blocks": 1.5}, "workload.min_parent_blocks"),
])
def test_errors_name_the_key(spec, message):
    with pytest.raises(ValueError) as error:
        load_workload(spec, 1)
    assert message in str(error.value)


def test_seed_must_be_an_integer():
    with pytest.raises(ValueError, match="seed"):
        load_workload({"kind": "synthetic"}, "1")  # type: ignore[arg-type]


def test_string_seeds_do_not_depend_on_hash_randomisation():
    program = ("from sim.workload import load_workload; "
               "print([t.prompt_tokens for c in load_workload({'kind': 'synthetic'}, 7) for t in c.turns])")
    outputs = set()
    for hash_seed in ("0", "1", "12345"):
        environment = {**os.environ, "PYTHONHASHSEED": hash_seed}
        result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True,
                                env=environment, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        outputs.add(result.stdout)
    assert len(outputs) == 1
