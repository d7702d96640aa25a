"""Agentic tool loops: many short model calls whose context grows by a tool result each step.

Why a separate shape: in an agent session the gap between turns is a tool's latency (seconds, not
a human's minutes), so D's retained KV is almost always still there, and each new prompt adds a
tool result that can be much larger than the model's own output. That is where bidirectional
transfer pays off most and where TTL matters least, the opposite corner from chat.

A session is a run of model calls. Each call either emits a tool call (short output) or answers the
user (longer output); the last call always answers. The next call resends everything plus the tool
result (after a tool call, following the tool's latency) or the user's follow-up (after an answer,
following the user's think time).

The defaults are illustrative assumptions, not measurements (no public measurement of agent think times that we know of): a
3,000-token system prompt with tool schemas, tool latency with median 2 s and p90 10 s, tool
results averaging 1,200 tokens. Streams as in :mod:`sim.workload.synthetic`: ``rng_workload``
for token counts and step kinds, ``rng_gaps`` for timing, with per-session sub-streams.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from sim.workload.arrivals import conversations
from sim.workload.distributions import Constant, Distribution, LogNormal, UniformInt, sample_count
from sim.workload.model import Conversation, Turn
from sim.workload.spec import check_generator_fields


@dataclass(frozen=True, slots=True)
class AgenticConfig:
    """One source of defaults for agent sessions (illustrative, see the module docstring)."""

    num_conversations: int = 16  # agent sessions (named like the synthetic count, so one override fits both)
    steps_per_session: Distribution = UniformInt(8, 40)  # model calls in one session (at least 1)
    system_prompt_tokens: Distribution = Constant(3000)  # drawn once per run, shared by all sessions
    task_tokens: Distribution = UniformInt(50, 400)  # the user's request that opens a session
    tool_call_tokens: Distribution = UniformInt(20, 200)  # output of a step that calls a tool
    tool_result_tokens: Distribution = LogNormal.from_mean(1200, max_value=16000)  # appended after a tool call
    answer_prob: float = 0.1  # chance that a step before the last answers the user instead of calling a tool
    answer_tokens: Distribution = UniformInt(300, 1500)  # output of a step that answers the user
    follow_up_tokens: Distribution = UniformInt(20, 200)  # user's next message after an answer
    tool_latency_s: Distribution = LogNormal.from_quantiles(p50=2.0, p90=10.0)  # gap after a tool call
    user_think_s: Distribution = LogNormal.from_quantiles(p50=126.0, p90=480.0)  # gap after an answer (Mooncake)
    arrival_rate_per_s: float | None = None  # None: every session starts at 0 s
    history_rewrite_prob: float = 0.0  # as in SyntheticMultiTurnConfig (e.g. context compaction)

    def __post_init__(self) -> None:
        check_generator_fields(self.num_conversations, self.arrival_rate_per_s, self.history_rewrite_prob)
        if not 0.0 <= self.answer_prob <= 1.0:
            raise ValueError(f"answer_prob must be in [0, 1], got {self.answer_prob!r}")


def generate(config: AgenticConfig, rng_workload: random.Random, rng_gaps: random.Random) -> list[Conversation]:
    """The sessions of one run, in start order; same config and stream states, same list."""
    system_prompt = sample_count(config.system_prompt_tokens, rng_workload)
    return conversations(config.num_conversations, config.arrival_rate_per_s, rng_workload, rng_gaps, "agentic",
                         system_prompt, lambda tokens_rng, gaps_rng: _turns(config, system_prompt, tokens_rng, gaps_rng))


def _turns(config: AgenticConfig, system_prompt: int, tokens_rng: random.Random,
           gaps_rng: random.Random) -> tuple[Turn, ...]:
    step_count = sample_count(config.steps_per_session, tokens_rng, minimum=1)
    prompt = system_prompt + sample_count(config.task_tokens, tokens_rng, minimum=1)
    revision = 0
    previous_answered = False
    turns = []
    for index in range(step_count):
        # every draw happens whatever the outcome, so one parameter never shifts another's draws
        wants_answer = tokens_rng.random() < config.answer_prob
        answers = wants_answer or index == step_count - 1
        tool_call = sample_count(config.tool_call_tokens, tokens_rng, minimum=1)
        answer = sample_count(config.answer_tokens, tokens_rng, minimum=1)
        output = answer if answers else tool_call
        gap_s = 0.0
        if index > 0:
            if tokens_rng.random() < config.history_rewrite_prob:
                revision += 1
            tool_latency_s = config.tool_latency_s.sample(gaps_rng)
            think_s = config.user_think_s.sample(gaps_rng)
            gap_s = think_s if previous_answered else tool_latency_s
        turns.append(Turn(prompt_tokens=prompt, output_tokens=output, gap_before_s=gap_s,
                          history_revision=revision, tool_call=not answers))
        tool_result = sample_count(config.tool_result_tokens, tokens_rng, minimum=1)
        follow_up = sample_count(config.follow_up_tokens, tokens_rng, minimum=1)
        prompt += output + (follow_up if answers else tool_result)
        previous_answered = answers
    return tuple(turns)
