"""``bidikv bench`` against the real CPU deployment, through the router, then ``bidikv calibrate
--from-bench`` on what it wrote.

What P reports it did not compute (``usage.prompt_tokens_details.cached_tokens``, with
``--enable-prompt-tokens-details``) counts local prefix-cache hits *and* tokens pulled from D on vLLM
0.32 (``num_local_cached_tokens + num_external_cached_tokens``): checked here against P's own
``prompt_tokens_by_source`` counters over the same run.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

from calibration.bench_records import read_jsonl
from tests.e2e.conftest import E2E
from tests.e2e.deployment import REPO
from tests.e2e.tiny_model import FIRST_ORDINARY_ID, VOCAB_SIZE

# 2 conversations x 3 requests (6 messages); every later turn continues 64 generated tokens, above
# the deployment's threshold of 48, so each should pull from D.
WORKLOAD_TOML = """\
seed = {seed}

[workload]
kind = "synthetic"
num_conversations = 2
messages_per_conversation = {{ kind = "constant", value = 6 }}
common_prefix_tokens = {{ kind = "constant", value = 64 }}
conversation_prefix_tokens = {{ kind = "constant", value = 160 }}
user_tokens = {{ kind = "constant", value = 40 }}
output_tokens = {{ kind = "constant", value = 64 }}
"""


def test_bench_through_the_router_records_what_p_pulled(e2e: E2E, tmp_path: Path):
    config = tmp_path / "bench.toml"
    # a fresh seed: this run's random prompts share no prefix with any earlier run's on P
    config.write_text(WORKLOAD_TOML.format(seed=uuid.uuid4().int % 1_000_000))
    out = tmp_path / "bench.jsonl"
    before = e2e.counters()
    run = subprocess.run(
        [sys.executable, "-m", "impl.cli", "bench", "--url", e2e.router, "--mode", "on", "--config", str(config),
         "--out", str(out), "--concurrency", "2", "--token-id-low", str(FIRST_ORDINARY_ID), "--token-id-high", str(VOCAB_SIZE)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    print("\n" + run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    d = e2e.settled_delta(before)
    records = read_jsonl(out)
    assert len(records) == 6 and all(r.ok for r in records), records
    later = [r for r in records if r.turn > 0]
    assert all(r.reuse_offered_tokens > 0 for r in later), "the router did not offer D's blocks on a later turn"
    assert all(r.output_tokens == 64 for r in records)
    # P pulled on every later turn (vLLM's own counters), and what P reported as cached covers it
    assert d["p"]["xfers"] >= len(later) and d["p"]["external_tokens"] >= 48 * len(later), d
    reported = sum(r.prefill_cached_tokens or 0 for r in records)
    assert reported == d["p"]["external_tokens"] + d["p"]["local_cache_tokens"], (reported, d)

    fit = subprocess.run([sys.executable, "-m", "impl.cli", "calibrate", "--from-bench", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    print(fit.stdout)
    assert fit.returncode == 0, fit.stdout + fit.stderr
    assert "fitted from 6 turns" in fit.stdout


# vLLM's multi-turn benchmark config format (benchmarks/multi_turn/generate_multi_turn.json), small:
# 4 conversations of 6 messages (3 requests), a 64-token common prefix, 160 tokens of context each
VLLM_MULTI_TURN_CONFIG = {
    "filetype": "generate_conversations", "num_conversations": 4, "text_files": ["unused.txt"],
    "prompt_input": {"num_turns": {"distribution": "constant", "value": 6},
                     "common_prefix_num_tokens": {"distribution": "constant", "value": 64},
                     "prefix_num_tokens": {"distribution": "constant", "value": 160},
                     "num_tokens": {"distribution": "uniform", "min": 30, "max": 50}},
    "prompt_output": {"num_tokens": {"distribution": "constant", "value": 64}},
}


def test_bench_replays_a_vllm_multi_turn_config_as_the_simulator_plans_it(e2e: E2E, tmp_path: Path):
    import csv
    import json

    config = tmp_path / "multi_turn.json"
    config.write_text(json.dumps(VLLM_MULTI_TURN_CONFIG))
    seed = str(uuid.uuid4().int % 1_000_000)  # fresh prompts: no prefix shared with an earlier run on P
    flags = ["--vllm-multi-turn-config", str(config), "--seed", seed, "--num-clients", "2",
             "--max-active-conversations", "4", "--no-early-stop"]
    out = tmp_path / "bench.jsonl"
    run = subprocess.run([sys.executable, "-m", "impl.cli", "bench", "--url", e2e.router, "--mode", "on", *flags,
                          "--out", str(out), "--token-id-low", str(FIRST_ORDINARY_ID), "--token-id-high", str(VOCAB_SIZE)],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    print("\n" + run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    sim_dir = tmp_path / "sim"
    sim = subprocess.run([sys.executable, "-m", "impl.cli", "simulate", *flags, "--out", str(sim_dir)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert sim.returncode == 0, sim.stdout + sim.stderr
    with open(sim_dir / "records.csv") as fh:
        plan = {(row["conversation"], int(row["turn"])): row for row in csv.DictReader(fh)}
    records = read_jsonl(out)
    assert all(r.ok for r in records), [r.error for r in records if r.error]
    # without early stop the requests sent do not depend on timing: the simulator's set, exactly. Each
    # client (2 active conversations) stops when its first one ends and the queue is empty, abandoning the
    # other's last request, as vLLM's client does: 2 x 5 of the 12 planned requests
    assert {(r.conversation, r.turn) for r in records} == set(plan) and len(records) == 10
    answered = {(r.conversation, r.turn): r.output_tokens for r in records}
    for r in records:
        planned = plan[(r.conversation, r.turn)]
        assert 1 <= r.output_tokens <= 64  # max_tokens only: the answer may stop at EOS
        # the prompt is the plan less what earlier answers fell short of max_tokens
        shortfall = sum(64 - answered[(r.conversation, k)] for k in range(r.turn))
        assert r.prompt_tokens == int(planned["prompt_tokens"]) - shortfall
        if r.turn:
            assert r.reuse_offered_tokens > 0, "the router did not offer D's blocks on a later turn"
