"""Where a resent history departs from what D holds: reasoning the template drops, answers that
retokenize differently, tool calls the template re-serialises, edited histories.

P pulls only the prefix whose token ids it verified equal to what D holds (impl.policy.prefix_check),
so a turn's reuse ends at its first divergence from D's sequence (the previous turn's prompt and
output). This module rewrites a generator's conversations (synthetic or agentic) with that
divergence, stated per turn as :attr:`~sim.workload.model.Turn.reuse_agreement_tokens`; the simulator
turns it into verified and pulled tokens with ``verified_tokens_model``.

Effects, each off by default (:class:`HistoryConfig` is the one source of defaults):

* **Reasoning not resent.** Each model output starts with ``reasoning_tokens`` of thinking (added to
  the generator's output: the generator's output is the visible answer or tool call). Reasoning chat
  templates drop earlier turns' thinking from the history they render: Qwen3's keeps it only for
  assistant messages after the last user query, i.e. inside the current tool loop
  (https://huggingface.co/Qwen/Qwen3-32B: "No Thinking Content in History"; its chat template's
  ``last_query_index``), DeepSeek-R1's drops it from every assistant message (``content.split('</think>')``),
  and vLLM #43094 (https://github.com/vllm-project/vllm/issues/43094) is this hazard for reused KV.
  ``reasoning_resent``: ``never`` (DeepSeek-R1), ``within_tool_loop`` (Qwen3: after a tool call the
  thinking stays, at the next user message every assistant message's thinking since the previous user
  message goes) or ``always`` (a template that keeps it). Where thinking is dropped the next prompt
  diverges at the first dropped thinking token: for chat, right after the previous prompt (whose last
  tokens are the generation prompt ``<|im_start|>assistant\\n``).
* **Answer drift.** With probability ``drift_prob`` an output's last ``drift_tail_tokens`` tokens
  retokenize differently when resent (a byte-level BPE's generated split is often not the canonical
  split of the same text, most often where the text meets the template's closing tokens; a ``| trim``
  on trailing whitespace does the same). ASSUMPTION: no public measurement of how often or how far
  from the end; the presets use illustrative values.
* **Tool-call re-serialisation.** With probability ``tool_call_rerender_prob`` a tool call the model
  generated renders differently when the client resends it as structured ``tool_calls`` (the template
  re-serialises the arguments with ``tojson``: spacing, key order, escaping), diverging at a uniform
  point of the call. ASSUMPTION: illustrative rate, no public measurement.
* **Edited history.** With probability ``edit_prob`` a turn (after the first) rewrites the history it
  resends (a user edits an earlier message, an agent compacts its context) from a point a fraction
  ``edit_point`` into the part after the shared prefix (the system prompt is never edited); the
  turn's ``history_revision`` goes up (caches keyed by revision serve nothing across it) and its
  agreement is the rewrite point. Token counts are unchanged, as with ``history_rewrite_prob``.

Randomness: one stream (``history`` in :func:`sim.workload.load_workload`) with a sub-stream per
conversation, and every draw happens whatever the outcome, so these effects never shift the
generator's own draws (a workload without them is byte-identical) and one parameter never shifts
another's draws.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Sequence

from sim.workload.distributions import Constant, Distribution, LogNormal, Uniform, UniformInt, sample_count
from sim.workload.model import Conversation, Turn, held_tokens

REASONING_RESENT = ("never", "within_tool_loop", "always")


@dataclass(frozen=True, slots=True)
class HistoryConfig:
    """How the history a client resends departs from what D holds (all off by default; see the module)."""

    reasoning_tokens: Distribution = Constant(0)  # thinking at the start of every model output
    reasoning_resent: str = "never"  # never | within_tool_loop (Qwen3) | always
    drift_prob: float = 0.0  # chance an output's tail retokenizes differently when resent
    drift_tail_tokens: Distribution = UniformInt(2, 16)  # how many of its last tokens do
    tool_call_rerender_prob: float = 0.0  # chance a tool call re-serialises differently
    edit_prob: float = 0.0  # chance a turn (after the first) rewrites the history it resends
    edit_point: Distribution = Uniform(0.0, 1.0)  # where, as a fraction of the history after the shared prefix

    def __post_init__(self) -> None:
        if self.reasoning_resent not in REASONING_RESENT:
            raise ValueError(f"reasoning_resent must be one of {', '.join(REASONING_RESENT)}, "
                             f"got {self.reasoning_resent!r}")
        for name in ("drift_prob", "tool_call_rerender_prob", "edit_prob"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")

    @property
    def faithful(self) -> bool:
        """True when every turn continues what D holds: the conversations pass through unchanged."""
        return (self.reasoning_tokens == Constant(0) and self.drift_prob == 0.0
                and self.tool_call_rerender_prob == 0.0 and self.edit_prob == 0.0)


HISTORY_FIELDS = tuple(f.name for f in dataclasses.fields(HistoryConfig))


def apply(conversations: Sequence[Conversation], config: HistoryConfig, rng: random.Random) -> list[Conversation]:
    """``conversations`` with ``config``'s divergences; same inputs and stream state, same output."""
    if config.faithful:
        return list(conversations)
    out = []
    for conv in conversations:
        conv_rng = random.Random(rng.getrandbits(64))  # drawn per conversation whatever its length
        out.append(dataclasses.replace(conv, turns=_turns(conv, config, conv_rng)))
    return out


def _turns(conv: Conversation, config: HistoryConfig, rng: random.Random) -> tuple[Turn, ...]:
    turns: list[Turn] = []
    resent_reasoning = 0  # thinking tokens of earlier outputs the current history still carries
    first_resent_at = None  # where, in the current history, the first thinking it carries starts
    edits = 0
    for index, base in enumerate(conv.turns):
        # every draw happens whatever the outcome (see the module docstring)
        reasoning = sample_count(config.reasoning_tokens, rng)
        drifts = rng.random() < config.drift_prob
        drift_tail = sample_count(config.drift_tail_tokens, rng, minimum=1)
        rerenders = rng.random() < config.tool_call_rerender_prob
        rerender_at = rng.random()
        edited = rng.random() < config.edit_prob
        edit_fraction = min(max(config.edit_point.sample(rng), 0.0), 1.0)
        if index == 0:
            turns.append(dataclasses.replace(base, output_tokens=base.output_tokens + reasoning))
            continue
        previous_base, previous = conv.turns[index - 1], turns[index - 1]
        previous_reasoning = previous.output_tokens - previous_base.output_tokens
        same_loop = previous_base.tool_call  # after a tool call the agent resends at once: same tool loop
        keeps = config.reasoning_resent == "always" or (config.reasoning_resent == "within_tool_loop" and same_loop)
        held = held_tokens(previous)  # D holds the previous prompt, its thinking and its visible output
        agree = held
        if previous_reasoning and first_resent_at is None:
            first_resent_at = previous.prompt_tokens
        if keeps:
            resent_reasoning += previous_reasoning
        else:
            if first_resent_at is not None:  # every thinking block the history carried is dropped now
                agree = min(agree, first_resent_at)
            resent_reasoning, first_resent_at = 0, None
        answer_start = previous.prompt_tokens + previous_reasoning
        if drifts:  # the tail of the previous output (never more than its visible part) reads back differently
            agree = min(agree, answer_start + previous_base.output_tokens - min(drift_tail, previous_base.output_tokens))
        if previous_base.tool_call and rerenders:
            agree = min(agree, answer_start + int(rerender_at * previous_base.output_tokens))
        prompt = base.prompt_tokens + resent_reasoning
        revision = base.history_revision + edits
        if edited:
            edits += 1
            revision += 1
            history = max(previous.prompt_tokens - conv.shared_prefix_tokens, 0)
            agree = min(agree, conv.shared_prefix_tokens + int(edit_fraction * history))
        if base.history_revision != previous_base.history_revision:
            stated = None  # the generator's own rewrite (history_rewrite_prob) states nothing: shares nothing
        elif edited or agree < held:
            stated = max(agree, 0)
        else:
            stated = None  # a faithful continuation
        turns.append(dataclasses.replace(base, prompt_tokens=prompt, output_tokens=base.output_tokens + reasoning,
                                         history_revision=revision, reuse_agreement_tokens=stated))
    return tuple(turns)


@dataclass(frozen=True, slots=True)
class Preset:
    """A named workload: a generator (``synthetic`` or ``agentic``) and how its history diverges."""

    generator: str
    history: HistoryConfig
    help: str


# The presets' values are illustrative ASSUMPTIONS (no public measurement of thinking lengths in
# multi-turn traffic, of retokenization drift or of edit rates that we know of); every one is a
# [workload] key, so a measured value replaces it without code.
PRESETS: dict[str, Preset] = {
    "reasoning_chat": Preset(
        "synthetic",
        HistoryConfig(reasoning_tokens=LogNormal.from_mean(1000, max_value=8000), reasoning_resent="never"),
        "synthetic chat with a reasoning model whose thinking is not resent (Qwen3 / DeepSeek-R1 templates drop "
        "it): each answer adds thinking (mean 1,000 tokens, an assumption) that the next prompt omits, so reuse "
        "ends at the previous prompt"),
    "answer_drift": Preset(
        "synthetic", HistoryConfig(drift_prob=0.2, drift_tail_tokens=UniformInt(2, 16)),
        "synthetic chat where 20% of answers retokenize differently in their last 2-16 tokens when resent "
        "(an assumption)"),
    "edited_history": Preset(
        "synthetic", HistoryConfig(edit_prob=0.1, edit_point=Uniform(0.0, 1.0)),
        "synthetic chat where 10% of turns rewrite their history from a uniform point after the system prompt "
        "(an assumption)"),
    "reasoning_agent": Preset(
        "agentic",
        HistoryConfig(reasoning_tokens=LogNormal.from_mean(300, max_value=4000), reasoning_resent="within_tool_loop",
                      tool_call_rerender_prob=0.1),
        "agentic tool loops on a reasoning model with Qwen3's template: thinking (mean 300 tokens a step) is "
        "resent within a tool loop and dropped at the next user message; 10% of tool calls re-serialise "
        "differently (assumptions)"),
}
