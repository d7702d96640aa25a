"""Synthetic multi-turn chat: vLLM's multi-turn benchmark (``benchmarks/multi_turn``) as a workload.

The defaults are the settings published with the feature (vLLM PR #32553, p5en: https://github.com/vllm-project/vllm/pull/32553), so
the simulator's default run is the measured experiment. Each turn resends the whole history:

    prompt_tokens(k) = common prefix + conversation prefix + sum(user tokens, turns 0..k)
                       + sum(output tokens, turns 0..k-1)

Randomness comes from two streams the caller passes in: ``rng_workload`` for everything that
shapes token counts (and history rewrites), ``rng_gaps`` for timing (start times, inter-turn gaps).
Each conversation derives its own sub-streams from them, so changing the gap model never reshuffles
token counts, and a longer conversation does not shift the draws of the ones after it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from sim.workload.arrivals import conversations
from sim.workload.distributions import (Constant, Distribution, LogNormal, UniformInt, count_sampler, sample_count,
                                         value_sampler)
from sim.workload.model import Conversation, Turn
from sim.workload.spec import check_generator_fields


@dataclass(frozen=True, slots=True)
class SyntheticMultiTurnConfig:
    """One source of defaults: vLLM PR #32553's benchmark settings plus a Mooncake-like think time."""

    num_conversations: int = 24
    # vLLM's ``num_turns`` counts *messages* (user + assistant): it is raised to at least 2 and
    # rounded up to even, and each user message is one request. "12-18 turns" is therefore 6-9
    # requests per conversation (6 with probability 1/7, 7, 8, 9 with 2/7 each).
    messages_per_conversation: Distribution = UniformInt(12, 18)
    # drawn once per run, like vLLM's ``common_prefix_num_tokens``: a system prompt all conversations share
    common_prefix_tokens: Distribution = Constant(500)
    # per-conversation context on the first turn; vLLM's lognormal "average 4000, max 10000"
    conversation_prefix_tokens: Distribution = LogNormal.from_mean(4000, max_value=10000)
    user_tokens: Distribution = UniformInt(120, 160)  # new user text per turn (at least 1)
    output_tokens: Distribution = UniformInt(800, 1200)  # answer per turn (at least 1)
    # Think time from a turn's completion to the next turn's arrival. Default: a lognormal through
    # Mooncake's parent->child gap quantiles (the FAST'25 conversation trace, sim/workload/mooncake.py: p50 126 s, p90 480 s):
    #   mu = ln 126 = 4.836, sigma = ln(480/126) / z_0.9 = 1.3376 / 1.2816 = 1.044.
    # Its p10 is 126 / 3.81 = 33 s against Mooncake's 42 s: two quantiles cannot fit three. The
    # Mooncake gaps run arrival to arrival, so they also include the parent's own service time;
    # for the exact shape use ``Empirical(mooncake.sample_gaps(path))``.
    inter_turn_gap_s: Distribution = LogNormal.from_quantiles(p50=126.0, p90=480.0)
    arrival_rate_per_s: float | None = None  # None: every conversation starts at 0 s
    # probability that a turn (after the first) rewrites the history it resends (e.g. strips
    # reasoning): the turn's ``history_revision`` goes up by one; the token counts are unchanged
    history_rewrite_prob: float = 0.0

    def __post_init__(self) -> None:
        check_generator_fields(self.num_conversations, self.arrival_rate_per_s, self.history_rewrite_prob)


def generate(config: SyntheticMultiTurnConfig, rng_workload: random.Random,
             rng_gaps: random.Random) -> list[Conversation]:
    """The conversations of one run, in start order; same config and stream states, same list."""
    common_prefix = sample_count(config.common_prefix_tokens, rng_workload)
    # the per-turn draws, resolved once for the run (the same draws as sample_count and .sample)
    draws = (count_sampler(config.user_tokens, minimum=1), count_sampler(config.output_tokens, minimum=1),
             value_sampler(config.inter_turn_gap_s))
    return conversations(config.num_conversations, config.arrival_rate_per_s, rng_workload, rng_gaps, "synthetic",
                         common_prefix,
                         lambda tokens_rng, gaps_rng: _turns(config, common_prefix, tokens_rng, gaps_rng, draws))


def _turns(config: SyntheticMultiTurnConfig, common_prefix: int, tokens_rng: random.Random,
           gaps_rng: random.Random, draws: tuple[Callable[[random.Random], int], Callable[[random.Random], int],
                                                 Callable[[random.Random], float]]) -> tuple[Turn, ...]:
    draw_user, draw_output, draw_gap = draws
    rewrite_prob = config.history_rewrite_prob
    messages = max(2, sample_count(config.messages_per_conversation, tokens_rng))
    turn_count = (messages + 1) // 2
    context = common_prefix + sample_count(config.conversation_prefix_tokens, tokens_rng)
    revision = 0
    turns = []
    for index in range(turn_count):
        user = draw_user(tokens_rng)
        output = draw_output(tokens_rng)
        gap_s = 0.0
        if index > 0:
            # drawn whatever the probability, so changing it never shifts the token draws
            if tokens_rng.random() < rewrite_prob:
                revision += 1
            gap_s = draw_gap(gaps_rng)
        prompt = context + user
        turns.append(Turn(prompt_tokens=prompt, output_tokens=output, gap_before_s=gap_s,
                          history_revision=revision))
        context = prompt + output
    return tuple(turns)
