"""The published benchmark, in the simulator: where calibration reads its "simulated" column.

The publication ran vLLM's multi-turn client on 1 prefill + 1 decode p5en.48xlarge node, prefix
caching OFF on P, and reports TTFT, prefill duration and KV transfer at given prompt lengths (2k and
24k/20k tokens). Closest published settings (vLLM PR #32553, https://github.com/vllm-project/vllm/pull/32553): 2 clients, 24
conversations, common prefix 500 tokens, per-conversation prefix lognormal (mean 4,000, max 10,000),
user 120-160 tokens/turn, output 800-1,200 tokens/turn, turns sent back to back.

To read a figure "at prompt length L", each conversation is built so that one of its later turns
(turn >= 1, so the ON path pulls) has exactly L prompt tokens; its per-conversation prefix is the
remainder, kept within [0, 10,000] like the benchmark's. The figure is the median over those turns.

Calibration does not import the simulator: these two runs are passed into it (``sim.commands.calibrate``),
:func:`simulate_published_point` for ``bidikv calibrate``'s simulated column and
:func:`simulate_heldout_benchmark` for the model no fit has seen (calibration.heldout).
"""

from __future__ import annotations

import statistics
from typing import Any

from calibration.heldout import ACTIVE_CONVERSATIONS, BENCH_CONFIG
from calibration.profile import LatencyProfile
from sim.engine.cluster import Cluster
from sim.engine.config import SimConfig
from sim.engine.rng import stream
from sim.engine.runner import run_config
from sim.workload.model import Conversation, Turn

COMMON_PREFIX_TOKENS = 500
MAX_CONVERSATION_PREFIX_TOKENS = 10_000
USER_TOKENS = (120, 160)
OUTPUT_TOKENS = (800, 1200)
NUM_CONVERSATIONS = 24
NUM_CLIENTS = 2


def published_conversations(prompt_tokens: int, seed: int = 0) -> tuple[list[Conversation], list[int]]:
    """24 conversations, each with one turn of exactly ``prompt_tokens``; returns them and that turn's index."""
    shortest_later_turn = COMMON_PREFIX_TOKENS + 2 * USER_TOKENS[0] + OUTPUT_TOKENS[0]
    if prompt_tokens < shortest_later_turn:
        raise ValueError(f"prompt_tokens must be >= {shortest_later_turn} so a later turn can have it")
    conversations, target_turns = [], []
    for c in range(NUM_CONVERSATIONS):
        rng = stream(seed, f"published:{c}")
        while True:  # draw turns until some later turn can land on the target with a legal prefix
            users = [rng.randint(*USER_TOKENS)]
            outputs = [rng.randint(*OUTPUT_TOKENS)]
            feasible = []
            while True:
                users.append(rng.randint(*USER_TOKENS))
                before = COMMON_PREFIX_TOKENS + sum(users) + sum(outputs)
                prefix = prompt_tokens - before
                if prefix < 0:
                    break
                if prefix <= MAX_CONVERSATION_PREFIX_TOKENS:
                    feasible.append((len(users) - 1, prefix))
                outputs.append(rng.randint(*OUTPUT_TOKENS))
            if feasible:
                break
        target, prefix = feasible[rng.randrange(len(feasible))]
        turns, context = [], COMMON_PREFIX_TOKENS + prefix
        for k in range(target + 1):
            context += users[k]
            turns.append(Turn(context, outputs[k] if k < len(outputs) else rng.randint(*OUTPUT_TOKENS)))
            context += turns[-1].output_tokens
        assert turns[target].prompt_tokens == prompt_tokens
        conversations.append(Conversation(f"pub{c}", 0.0, tuple(turns), COMMON_PREFIX_TOKENS))
        target_turns.append(target)
    return conversations, target_turns


# The publication does not give P's token budget; P/D recipes raise it so a long prompt prefills in
# one forward pass, which is also what a two-point fit of the published figures assumes.
PREFILL_TOKEN_BUDGET = 32_768


def published_config(bidirectional: bool, seed: int = 0) -> SimConfig:
    config = SimConfig(seed=seed, num_clients=NUM_CLIENTS)
    config.topology.max_num_batched_tokens = PREFILL_TOKEN_BUDGET
    config.policy.bidirectional = bidirectional
    config.policy.prefix_caching = False
    return config.validate()


def simulate_published_point(profile: LatencyProfile, prompt_tokens: int, bidirectional: bool, seed: int = 0) -> dict[str, Any]:
    """Median TTFT, prefill duration and D->P transfer (seconds) of the turns at ``prompt_tokens``."""
    conversations, targets = published_conversations(prompt_tokens, seed)
    result = Cluster(published_config(bidirectional, seed), profile).run(conversations)
    wanted = {(conv.conversation_id, t) for conv, t in zip(conversations, targets)}
    recs = [r for r in result.records if (r.conversation, r.turn) in wanted]
    if len(recs) != len(wanted) or any(r.rejected for r in recs):
        raise RuntimeError("published benchmark turns did not all complete")
    return {
        "ttft_s": statistics.median(r.ttft_s for r in recs),
        "prefill_s": statistics.median(r.prefill_s for r in recs),
        "transfer_s": statistics.median(r.d2p_transfer_s for r in recs),
        "turns": len(recs),
        "pulled_turns": sum(1 for r in recs if r.reused_tokens > 0),
    }


def simulate_heldout_benchmark(profile: LatencyProfile, bidirectional: bool, seed: int = 0) -> dict[str, float]:
    """``ttft_mean``, ``ttft_p50``, ``tpot_mean`` (ms) and ``requests`` of vLLM PR #32553's benchmark, simulated:
    its multi-turn config (:data:`calibration.heldout.BENCH_CONFIG`) on :func:`published_config`. What
    calibration.heldout passes a profile of a model no fit has seen to (its ``SimulatedBenchmark``)."""
    config = published_config(bidirectional, seed)
    config.workload = {"kind": "vllm_multi_turn", "path": str(BENCH_CONFIG),
                       "max_active_conversations": ACTIVE_CONVERSATIONS}
    completed = [r for r in run_config(config, profile=profile).records if not r.rejected]
    if not completed:
        raise RuntimeError("the simulated benchmark completed no request")
    ttft_ms = [r.ttft_s * 1e3 for r in completed]
    tpot_ms = [r.tpot_s * 1e3 for r in completed if r.output_tokens > 1]
    return {"ttft_mean": statistics.fmean(ttft_ms), "ttft_p50": statistics.median(ttft_ms),
            "tpot_mean": statistics.fmean(tpot_ms), "requests": float(len(completed))}
