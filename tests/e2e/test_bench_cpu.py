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

from impl.bench.records import read_jsonl
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
