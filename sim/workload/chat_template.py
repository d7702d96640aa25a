"""The tokens a chat template adds around a conversation's messages, for prompts counted in content tokens.

vLLM's multi-turn benchmark sizes every message's *content* in tokens; what the server prefills is the
chat template's rendering of the messages, which adds per message a header and an end marker, before
the first message whatever the template always emits (a BOS, a default system block), and after the
last one the generation prompt (the assistant header the answer follows). Left out, the simulated
prompts of a replayed ``generate_multi_turn.json`` were 13-19 % shorter than what the benchmark sent.
A prompt of ``m`` messages holding ``c`` content tokens is here ``c + system + m * per_message +
generation`` tokens; the next request's prompt extends it (the generation prompt becomes the answer's
header), so reuse stays prefix-consistent.

The families, read off their templates (the special tokens are one token each):

* ``llama3`` -- Llama 3.1 / 3.2 / 3.3 Instruct
  (https://huggingface.co/meta-llama/Llama-3.3-70B-Instruct/blob/main/tokenizer_config.json):
  per message ``<|start_header_id|>ROLE<|end_header_id|>\\n\\n ... <|eot_id|>`` = 5; generation
  ``<|start_header_id|>assistant<|end_header_id|>\\n\\n`` = 4; system: ``<|begin_of_text|>`` plus the system
  block the template always writes (header 4, ``Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul
  2024\\n\\n``, ``<|eot_id|>``) = 26, the date text's ~20 tokens estimated from Llama 3's BPE (digits in
  groups of up to three), not counted by its tokenizer here (none is downloaded).
* ``chatml`` -- plain ChatML: per message ``<|im_start|>ROLE\\n ... <|im_end|>\\n`` = 5, generation
  ``<|im_start|>assistant\\n`` = 3, nothing before the first message.
* ``qwen2.5`` -- ChatML with Qwen 2.5's default system message ("You are Qwen, created by Alibaba Cloud.
  You are a helpful assistant.", https://huggingface.co/Qwen/Qwen2.5-7B-Instruct/blob/main/tokenizer_config.json):
  system 5 + ~16 = 21, estimated the same way.
* ``none`` -- prompts are the content tokens alone (token-id prompts, a completion endpoint).

Any other template: ``PER_MESSAGE,SYSTEM,GENERATION`` as three integers (count them once with the model's
tokenizer: render one and two messages and subtract).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ChatTemplateOverhead:
    per_message: int  # header and end marker of every message
    system: int  # before the first message, the same in every conversation (BOS, a default system block)
    generation: int  # the assistant header that ends every prompt

    def __post_init__(self) -> None:
        for name in ("per_message", "system", "generation"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 10_000:
                raise ValueError(f"chat_template.{name} must be an integer in 0..10000, got {value!r}")

    def prompt_tokens(self, content_tokens: int, messages: int) -> int:
        """Tokens of a prompt of ``messages`` messages holding ``content_tokens`` content tokens."""
        return content_tokens + self.system + messages * self.per_message + self.generation


TEMPLATE_FAMILIES = {
    "llama3": ChatTemplateOverhead(per_message=5, system=26, generation=4),
    "chatml": ChatTemplateOverhead(per_message=5, system=0, generation=3),
    "qwen2.5": ChatTemplateOverhead(per_message=5, system=21, generation=3),
    "none": ChatTemplateOverhead(per_message=0, system=0, generation=0),
}
# vLLM's multi-turn benchmark README serves Meta-Llama-3.1-8B-Instruct, and bidikv's profiles are Llama 3.x
DEFAULT_TEMPLATE = "llama3"


def parse_template(value: object, where: str = "chat_template") -> ChatTemplateOverhead:
    """A family name, or ``"PER_MESSAGE,SYSTEM,GENERATION"``; a clear error naming ``where`` otherwise."""
    if isinstance(value, str) and value in TEMPLATE_FAMILIES:
        return TEMPLATE_FAMILIES[value]
    if isinstance(value, str) and value.count(",") == 2:
        parts = value.split(",")
        if all(p.strip().isdigit() for p in parts):
            per_message, system, generation = (int(p) for p in parts)
            return ChatTemplateOverhead(per_message, system, generation)
    raise ValueError(f"{where}: expected one of {', '.join(TEMPLATE_FAMILIES)} or PER_MESSAGE,SYSTEM,GENERATION "
                     f"(three integers), got {value!r}")
