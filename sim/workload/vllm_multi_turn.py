"""vLLM's multi-turn benchmark config (``generate_multi_turn.json``) read as is, as conversations.

Source read (vLLM main, https://github.com/vllm-project/vllm/tree/main/benchmarks/multi_turn):
``bench_dataset.py`` (https://github.com/vllm-project/vllm/blob/0fdcab7e1f5ca53acbf5a1a6d88268a73ee4429a/benchmarks/multi_turn/bench_dataset.py),
``generate_multi_turn.json`` and ``README.md`` there. The client loop that sends these conversations
is :mod:`sim.clients.bench`.

The file (``"filetype": "generate_conversations"``)::

    {"filetype": "generate_conversations", "num_conversations": 24, "text_files": ["pg1184.txt"],
     "print_stats": false,
     "prompt_input": {"num_turns": D, "common_prefix_num_tokens": D (optional, default 0),
                      "prefix_num_tokens": D, "num_tokens": D},
     "prompt_output": {"num_tokens": D}}

where each D is ``{"distribution": kind, ...}``:

* ``constant``: ``value``;
* ``uniform``: ``min``, ``max``, both included (numpy ``randint(min, max + 1)``; vLLM asserts
  0 < min <= max and would crash on non-integer bounds, so they must be integers here);
* ``zipf``: ``alpha`` (> 1), optional ``max`` (a clip);
* ``poisson``: ``alpha`` (the mean), optional ``max``;
* ``lognormal``: either ``average`` (>= 1) with optional ``median_ratio`` in (0, 1), default 0.85,
  giving mu = ln(ratio x average), sigma = sqrt(2 ln(1/ratio)) -- and then **every batch of draws is
  rescaled so its mean is exactly the average**, before the clip -- or ``mean`` (> 0) and ``sigma``
  (>= 0), the underlying normal's parameters (numpy ``lognormal(mean, sigma)``), not rescaled;
  optional ``max``. Draws are rounded half to even (``np.round``). vLLM prints the first form as
  ``LognormalDistribution[average, median_ratio, max]``.

A ``max`` of 0 is no clip (vLLM tests it for truth). Unknown keys, which vLLM ignores, are errors
here: a misspelt ``"meadian_ratio"`` would otherwise silently give 0.85.

How vLLM turns the draws into messages (``generate_conversations``), in the order it draws them:

1. ``num_turns`` for every conversation (one batch): a count of *messages*, user and assistant; at
   least 2, rounded up to even (12-18 is 6-9 requests);
2. ``prefix_num_tokens`` for every conversation (one batch): context added to the conversation's
   first user message only;
3. ``common_prefix_num_tokens`` once (a batch of one; a lognormal "average" batch of one is the
   average itself): text every conversation's first message starts with;
4. per conversation, ``num_tokens`` of the user and of the answer, one batch each of the
   conversation's message count (user message i takes draw i for even i, answer i for odd i).

Token counts, text vs tokens: vLLM builds text from a book and counts with the model's tokenizer. A
user message of ``n`` tokens includes a header (``"<id> is a nice number... "``) and the instruction
``"Please rewrite the following text and add more content: "``; the first also starts with the
common prefix, counted *inside* ``n`` (the filler shrinks), while the conversation prefix is added on
top. So, in tokens:

    first user message = max(n_0, common prefix) + conversation prefix
    later user message = n_k
    answer k           = up to n (sent as ``max_tokens``, vLLM's ``--limit-max-tokens`` default;
                         ``min_tokens`` is never sent, so an answer may stop early at EOS)

and request k's prompt is everything before it: the first user message plus, for each earlier
request, its answer and the next user message (:mod:`sim.workload.synthetic`'s rule). What is left
out is tokenizer-dependent and small: the header and instruction (about 10-20 tokens) when the common
prefix is longer than ``n_0``, vLLM's floor of a user message at the instruction's length (about
11 tokens; here 1), the chat template's per-message tokens, and the few tokens by which decoding and
re-encoding book text can differ. The simulator sends answers of exactly ``max_tokens`` (it cannot
see EOS); ``bidikv bench`` sends ``max_tokens`` only, as vLLM does, and builds the next prompt from
the answer the server actually gave.

Randomness: one stream (:func:`sim.engine.rng.stream` ``"<seed>:workload"``) drawn in vLLM's order above,
so the same file and seed give the same conversations in ``bidikv simulate`` and ``bidikv bench``.
The numbers are not numpy's (numpy's generators are not reproduced), the distributions are.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

from sim.workload.distributions import (Constant, Distribution, LogNormal, Poisson, UniformInt, Zipf,
                                        split_kind)
from sim.workload.chat_template import DEFAULT_TEMPLATE, TEMPLATE_FAMILIES, ChatTemplateOverhead
from sim.workload.model import Conversation, Turn

FILETYPE = "generate_conversations"
# vLLM's default median/average ratio when "average" is given without "median_ratio"
DEFAULT_MEDIAN_RATIO = 0.85
TOP_LEVEL_KEYS = ("filetype", "num_conversations", "text_files", "print_stats", "prompt_input", "prompt_output")
INPUT_FIELDS = ("num_turns", "common_prefix_num_tokens", "prefix_num_tokens", "num_tokens")
OUTPUT_FIELDS = ("num_tokens",)
_KIND_KEYS = {
    "constant": ({"value"}, set()),
    "uniform": ({"min", "max"}, set()),
    "zipf": ({"alpha"}, {"max"}),
    "poisson": ({"alpha"}, {"max"}),
    "lognormal": (set(), {"average", "median_ratio", "mean", "sigma", "max"}),
}


@dataclass(frozen=True, slots=True)
class VllmDistribution:
    """One field as vLLM samples it: in batches, rounded, and (lognormal ``average``) rescaled per batch.

    ``rescale_to``: each batch is scaled so its mean is exactly this, then clipped at ``clip`` (the
    other kinds clip inside ``base``). ``label`` is vLLM's own repr, for messages.
    """

    base: Distribution
    label: str
    rescale_to: float | None = None
    clip: int | None = None

    def sample_batch(self, size: int, rng: random.Random) -> list[int]:
        draws = [self.base.sample(rng) for _ in range(size)]
        if self.rescale_to is not None and draws:
            scale = self.rescale_to / (sum(draws) / len(draws))
            draws = [x * scale for x in draws]
        if self.clip is not None:
            draws = [min(x, self.clip) for x in draws]
        return [int(round(x)) for x in draws]  # half to even, as np.round


@dataclass(frozen=True, slots=True)
class VllmMultiTurnConfig:
    """A ``generate_conversations`` file, checked; field names are the file's."""

    num_conversations: int
    num_turns: VllmDistribution  # messages (user + assistant) per conversation
    common_prefix_num_tokens: VllmDistribution
    prefix_num_tokens: VllmDistribution
    input_num_tokens: VllmDistribution
    output_num_tokens: VllmDistribution
    text_files: tuple[str, ...] = ()  # vLLM's source text; token-id prompts do not read it
    print_stats: bool = False


def load_config(path: str) -> VllmMultiTurnConfig:
    """Read and check a ``generate_multi_turn.json``; every error names the file and the field."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except OSError as exc:
        raise ValueError(f"vLLM multi-turn config {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"vLLM multi-turn config {path}: invalid JSON ({exc.msg}, line {exc.lineno})") from None
    try:
        return parse_config(data)
    except ValueError as exc:
        raise ValueError(f"vLLM multi-turn config {path}: {exc}") from None


def parse_config(data: object) -> VllmMultiTurnConfig:
    """The checked config of a parsed JSON document (see the module docstring for the format)."""
    if isinstance(data, list):
        raise ValueError("a list of conversations (vLLM's ShareGPT input) is not supported: give a "
                         f"'{FILETYPE}' config object")
    if not isinstance(data, Mapping):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    _known(data, TOP_LEVEL_KEYS, "the top level")
    for key in ("filetype", "num_conversations", "prompt_input", "prompt_output"):
        if key not in data:
            raise ValueError(f"missing field '{key}'")
    if data["filetype"] != FILETYPE:
        raise ValueError(f"field 'filetype' must be {FILETYPE!r}, got {data['filetype']!r}")
    count = data["num_conversations"]
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"field 'num_conversations' must be an integer >= 1, got {count!r}")
    text_files = data.get("text_files", [])
    if not isinstance(text_files, list) or not all(isinstance(f, str) for f in text_files):
        raise ValueError(f"field 'text_files' must be a list of file names, got {text_files!r}")
    print_stats = data.get("print_stats", False)
    if not isinstance(print_stats, bool):
        raise ValueError(f"field 'print_stats' must be true or false, got {print_stats!r}")
    prompt_input = _section(data, "prompt_input", INPUT_FIELDS)
    prompt_output = _section(data, "prompt_output", OUTPUT_FIELDS)
    for name in ("num_turns", "prefix_num_tokens", "num_tokens"):
        if name not in prompt_input:
            raise ValueError(f"missing field 'prompt_input.{name}'")
    if "num_tokens" not in prompt_output:
        raise ValueError("missing field 'prompt_output.num_tokens'")
    common = prompt_input.get("common_prefix_num_tokens", {"distribution": "constant", "value": 0})
    return VllmMultiTurnConfig(
        num_conversations=count,
        num_turns=parse_distribution(prompt_input["num_turns"], "prompt_input.num_turns"),
        common_prefix_num_tokens=parse_distribution(common, "prompt_input.common_prefix_num_tokens"),
        prefix_num_tokens=parse_distribution(prompt_input["prefix_num_tokens"], "prompt_input.prefix_num_tokens"),
        input_num_tokens=parse_distribution(prompt_input["num_tokens"], "prompt_input.num_tokens"),
        output_num_tokens=parse_distribution(prompt_output["num_tokens"], "prompt_output.num_tokens"),
        text_files=tuple(text_files), print_stats=print_stats)


def _section(data: Mapping, name: str, fields: tuple[str, ...]) -> Mapping:
    section = data[name]
    if not isinstance(section, Mapping):
        raise ValueError(f"field '{name}' must be an object, got {section!r}")
    _known(section, fields, f"'{name}'")
    return section


def _known(table: Mapping, allowed: tuple[str, ...] | set[str], where: str) -> None:
    for key in table:
        if key not in allowed:
            raise ValueError(f"unknown key '{key}' in {where} (allowed: {', '.join(sorted(allowed))})")


def _integer(spec: Mapping, key: str, field: str, minimum: int) -> int:
    value = spec[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"field '{field}.{key}' must be an integer >= {minimum}, got {value!r}")
    return value


def _real(spec: Mapping, key: str, field: str) -> float:
    value = spec[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"field '{field}.{key}' must be a finite number, got {value!r}")
    return float(value)


def _clip(spec: Mapping, field: str) -> int | None:
    if "max" not in spec:
        return None
    return _integer(spec, "max", field, 0) or None  # vLLM: a max of 0 is no clip


def parse_distribution(spec: object, field: str) -> VllmDistribution:
    """One ``{"distribution": ...}`` object; ``field`` (e.g. ``prompt_input.num_turns``) names errors."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"field '{field}' must be an object with 'distribution', got {spec!r}")
    try:
        kind, params = split_kind(spec, "distribution", _KIND_KEYS, lambda kind: f"for {kind}")
    except ValueError as exc:
        raise ValueError(f"field '{field}': {exc}") from None
    if kind == "constant":
        value = _integer(params, "value", field, 0)
        return VllmDistribution(Constant(value), f"Constant[{value}]")
    if kind == "uniform":
        low, high = _integer(params, "min", field, 1), _integer(params, "max", field, 1)
        if high < low:
            raise ValueError(f"field '{field}.max' ({high}) must be >= min ({low})")
        return VllmDistribution(UniformInt(low, high), f"UniformDistribution[{low}, {high}]")
    if kind in ("zipf", "poisson"):
        alpha = _real(params, "alpha", field)
        if kind == "zipf" and alpha <= 1.0:
            raise ValueError(f"field '{field}.alpha' must be > 1 (numpy's zipf), got {alpha!r}")
        if kind == "poisson" and alpha < 0:
            raise ValueError(f"field '{field}.alpha' (the mean) must be >= 0, got {alpha!r}")
        base = Zipf(alpha, _clip(params, field)) if kind == "zipf" else Poisson(alpha, _clip(params, field))
        return VllmDistribution(base, f"{kind.capitalize()}Distribution[{params['alpha']}]")
    return _lognormal(params, field)


def _lognormal(params: Mapping, field: str) -> VllmDistribution:
    clip = _clip(params, field)
    if "average" in params:
        if "mean" in params or "sigma" in params:
            raise ValueError(f"field '{field}': a lognormal given by 'average' cannot also take 'mean'/'sigma'")
        average = _real(params, "average", field)
        if average < 1:
            raise ValueError(f"field '{field}.average' must be >= 1, got {params['average']!r}")
        ratio = _real(params, "median_ratio", field) if "median_ratio" in params else DEFAULT_MEDIAN_RATIO
        if not 0.0 < ratio < 1.0:
            raise ValueError(f"field '{field}.median_ratio' must be in (0, 1), got {params['median_ratio']!r}")
        # unclipped draws: vLLM rescales a batch to the average first and clips after
        return VllmDistribution(LogNormal.from_mean(average, None, ratio),
                                f"LognormalDistribution[{params['average']}, {ratio}, {clip}]",
                                rescale_to=average, clip=clip)
    if "median_ratio" in params:
        raise ValueError(f"field '{field}.median_ratio' needs 'average' (with 'mean'/'sigma' it would be ignored)")
    for key in ("mean", "sigma"):
        if key not in params:
            raise ValueError(f"missing field '{field}.{key}' (lognormal needs 'average', or 'mean' and 'sigma')")
    mu, sigma = _real(params, "mean", field), _real(params, "sigma", field)
    if mu <= 0 or sigma < 0:
        raise ValueError(f"field '{field}': lognormal 'mean' must be > 0 and 'sigma' >= 0 (vLLM's check), "
                         f"got mean {mu!r}, sigma {sigma!r}")
    return VllmDistribution(LogNormal(mu, sigma, clip), f"LognormalDistribution[{mu}, {sigma}, {clip}]")


def requests_for_messages(messages: int) -> int:
    """Requests a conversation of ``messages`` drawn messages makes: at least 2, rounded up to even, halved."""
    messages = max(messages, 2)
    return (messages + messages % 2) // 2


def generate(config: VllmMultiTurnConfig, rng: random.Random,
             template: ChatTemplateOverhead = TEMPLATE_FAMILIES[DEFAULT_TEMPLATE]) -> list[Conversation]:
    """The conversations vLLM's generator would build, as token counts, drawn in its order; prompts
    include the chat template's tokens (:mod:`sim.workload.chat_template`)."""
    count = config.num_conversations
    message_counts = config.num_turns.sample_batch(count, rng)
    prefixes = config.prefix_num_tokens.sample_batch(count, rng)
    common = config.common_prefix_num_tokens.sample_batch(1, rng)[0]
    out = []
    for index in range(count):
        messages = 2 * requests_for_messages(message_counts[index])
        user = config.input_num_tokens.sample_batch(messages, rng)
        answer = config.output_num_tokens.sample_batch(messages, rng)
        context = max(user[0], common, 1) + prefixes[index]
        turns = []
        for request in range(messages // 2):
            if request:
                context += max(user[2 * request], 1)
            output = max(answer[2 * request + 1], 1)
            turns.append(Turn(prompt_tokens=template.prompt_tokens(context, 2 * request + 1), output_tokens=output))
            context += output
        # what every conversation's prompt starts with: the template's system part, then the common text
        # (after the first message's header)
        shared = template.system + (template.per_message + common if common else 0)
        out.append(Conversation(conversation_id=f"CONV_ID_{index}", start_s=0.0, turns=tuple(turns),
                                shared_prefix_tokens=shared))
    return out


def user_tokens(conversation: Conversation) -> list[int]:
    """The tokens each request adds after the previous prompt and its answer (the first: the whole prompt)."""
    added, previous_end = [], 0
    for turn in conversation.turns:
        added.append(turn.prompt_tokens - previous_end)
        previous_end = turn.prompt_tokens + turn.output_tokens
    return added
